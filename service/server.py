"""The grpc.aio server: options, interceptors, health, reflection, model loading, signals and graceful drain.

Lifecycle: ``start()`` binds the ports and serves at once — liveness ("" and /v1/health/live) SERVING, readiness
(``dgserve.v1.TextGeneration`` and /v1/health/ready) NOT_SERVING, Generate answers UNAVAILABLE — while the model
loads and warms up on a worker thread; then readiness flips to SERVING. ``drain()`` (SIGTERM/SIGINT under
``run()``): every health status NOT_SERVING at once, new calls UNAVAILABLE, in-flight streams get
``drain_timeout`` seconds to finish, then the engine stops. An engine fault fails in-flight calls (INTERNAL) and
turns both liveness and readiness off, so an orchestrator restarts the process.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from dgserve.async_engine import AsyncEngine
from dgserve.engine import Engine
from dgserve.scheduler import SchedulerConfig
from dgserve.v1 import text_generation_pb2 as pb
from dgserve.v1 import text_generation_pb2_grpc as pb_grpc
from service import convert
from service.config import ServiceConfig
from service.interceptors import BearerAuthInterceptor, CallInterceptor, load_tokens
from service.metrics import HttpSidecar, Metrics
from service.servicer import ServingState, TextGenerationServicer

log = logging.getLogger("dgserve.server")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TextGeneration"].full_name  # "dgserve.v1.TextGeneration"
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def scheduler_config(cfg: ServiceConfig) -> SchedulerConfig:
    return SchedulerConfig(
        max_num_seqs=cfg.max_num_seqs,
        max_queue_len=cfg.max_queue_len,
        prefill_chunk=cfg.prefill_chunk,
        max_prefill_tokens=cfg.prefill_chunk,
    )


def load_engine(cfg: ServiceConfig) -> Engine:
    """The engine for ``cfg`` (the default model when cfg.model is None)."""
    import torch

    from dgserve.default_model import default_model_path

    path = cfg.model or default_model_path()
    return Engine.from_pretrained(
        path,
        device=cfg.device,
        dtype=getattr(torch, cfg.dtype),
        scheduler_config=scheduler_config(cfg),
        max_model_len=cfg.max_model_len,
    )


def grpc_options(cfg: ServiceConfig) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", cfg.max_message_bytes),
        ("grpc.max_send_message_length", cfg.max_message_bytes),
        # a block can take seconds with no DATA frames: let clients ping often without GOAWAY too_many_pings
        ("grpc.keepalive_time_ms", cfg.keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", 20_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", cfg.keepalive_min_ping_ms),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.so_reuseport", 0),
    ]


class Server:
    """One dgserve gRPC server. ``engine_factory`` (default: ``load_engine(config)``) runs on a worker thread."""

    def __init__(self, config: ServiceConfig, engine_factory: Callable[[], Engine] | None = None):
        self.config = config
        self.engine_factory = engine_factory or (lambda: load_engine(config))
        self.metrics = Metrics()
        self.state = ServingState()
        self.health = health.aio.HealthServicer()
        self.port: int | None = None
        self.http_port: int | None = None
        self.live = True
        self.loaded = asyncio.Event()  # set when loading ended (ready or failed)
        self._grpc: grpc.aio.Server | None = None
        self._http: HttpSidecar | None = None
        self._load_task: asyncio.Task | None = None
        self._stopped = asyncio.Event()

    # ---------------------------------------------------------------- start

    async def start(self) -> None:
        cfg = self.config
        interceptors: list[grpc.aio.ServerInterceptor] = [CallInterceptor(self.metrics)]
        if cfg.auth_token_file:
            interceptors.insert(0, BearerAuthInterceptor(load_tokens(cfg.auth_token_file)))
        self._grpc = grpc.aio.server(interceptors=interceptors, options=grpc_options(cfg))
        pb_grpc.add_TextGenerationServicer_to_server(TextGenerationServicer(self.state), self._grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._grpc)
        if cfg.reflection:
            reflection.enable_server_reflection(
                (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self._grpc
            )
        self.port = self._bind(self._grpc, f"{cfg.host}:{cfg.port}")
        await self._grpc.start()
        await self.health.set("", SERVING)
        await self.health.set(SERVICE_NAME, NOT_SERVING)
        if cfg.http_port is not None:
            self._http = HttpSidecar(
                cfg.host,
                cfg.http_port,
                self.metrics,
                lambda: self.live,
                lambda: self.live and self.state.engine is not None and not self.state.draining,
            )
            self._http.start()
            self.http_port = self._http.port
        log.info(
            "listening: gRPC %s:%s%s, HTTP %s",
            cfg.host,
            self.port,
            " (TLS)" if cfg.tls_cert else "",
            self.http_port if self.http_port is not None else "off",
        )
        self._load_task = asyncio.create_task(self._load())

    def _bind(self, server: grpc.aio.Server, address: str) -> int:
        cfg = self.config
        if cfg.tls_cert is None or cfg.tls_key is None:  # ServiceConfig: both or neither
            return server.add_insecure_port(address)
        creds = grpc.ssl_server_credentials(
            [(_read(cfg.tls_key), _read(cfg.tls_cert))],
            root_certificates=_read(cfg.tls_client_ca) if cfg.tls_client_ca else None,
            require_client_auth=cfg.tls_client_ca is not None,
        )
        return server.add_secure_port(address, creds)

    async def _load(self) -> None:
        try:
            engine = await asyncio.to_thread(self.engine_factory)
            aengine = AsyncEngine(
                engine, stall_timeout_s=self.config.stall_timeout, observer=self.metrics, on_fault=self._on_fault
            )
            if self.config.warm_up:
                await asyncio.to_thread(aengine.warm_up)
            aengine.start()
            names = self.config.served_model_name or (_model_name(engine, self.config),)
            self.state.names = tuple(names)
            self.state.info = convert.model_info(engine, self.state.names, engine.scheduler.config)
            self.metrics.track_engine(
                lambda: aengine.num_running, lambda: aengine.num_waiting, engine.scheduler.config.max_num_seqs
            )
            self.state.engine = aengine
            if not self.state.draining:
                await self.health.set(SERVICE_NAME, SERVING)
            log.info("ready: serving %s (%s)", ", ".join(self.state.names), self.state.info.precision)
        except Exception as e:  # report, stay alive but never ready
            log.exception("model load failed")
            self.state.loading_error = f"model failed to load: {type(e).__name__}: {e}"
            self.live = False
            await self.health.set("", NOT_SERVING)
        finally:
            self.loaded.set()

    def _on_fault(self, error: Exception) -> None:
        log.error("engine fault, marking the server not live and not ready: %s", error)
        self.live = False
        self.state.engine = None
        self.state.loading_error = f"engine fault: {error}"
        asyncio.get_running_loop().create_task(self._set_all(NOT_SERVING))

    async def _set_all(self, status) -> None:
        await self.health.set("", status)
        await self.health.set(SERVICE_NAME, status)

    # ---------------------------------------------------------------- stop

    async def drain(self, grace: float | None = None) -> None:
        """Graceful stop: NOT_SERVING everywhere, new calls UNAVAILABLE, in-flight calls get ``grace`` seconds."""
        if self.state.draining:
            await self._stopped.wait()
            return
        grace = self.config.drain_timeout if grace is None else grace
        log.info("draining: %d running, %d waiting; grace %.1f s", *self._load_counts(), grace)
        self.state.draining = True
        await self.health.enter_graceful_shutdown()
        if self._grpc is not None:  # None: drained before start()
            await self._grpc.stop(grace)
        if self._load_task is not None and not self._load_task.done():
            self._load_task.cancel()
        if self.state.engine is not None:
            await self.state.engine.stop()
        if self._http is not None:
            self._http.stop()
        log.info("stopped")
        self._stopped.set()

    def _load_counts(self) -> tuple[int, int]:
        e = self.state.engine
        return (e.num_running, e.num_waiting) if e is not None else (0, 0)

    async def run(self) -> None:
        """Start, then serve until SIGTERM / SIGINT, then drain."""
        await self.start()
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await self.drain()


def _model_name(engine: Engine, cfg: ServiceConfig) -> str:
    from dgserve.default_model import SHIPPED

    path = cfg.model
    if path is None:
        return "dgserve-small" if (SHIPPED / "config.json").is_file() else "dgserve-tiny-random"
    return os.path.basename(os.path.normpath(path))


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()
