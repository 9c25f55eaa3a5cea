"""The server: the gRPC door (service/grpc/: the grpc.aio server, its interceptor, health, reflection) and the
OpenAI-compatible HTTP front door (service/http/, uvicorn on this same event loop) over one AsyncEngine; model
loading, signals, graceful drain.

Lifecycle: ``start()`` checks the files it was given (auth tokens, TLS, the model directory), binds both ports and
serves at once — liveness (gRPC health ``liveness`` and /v1/health/live) SERVING, readiness (gRPC health "" and
``dgserve.v1.TextGeneration``, /v1/health/ready) NOT_SERVING, Generate UNAVAILABLE, HTTP generation 503 — while the
model downloads (a Hub id: service/hub.py), loads and warms up on a worker thread; then readiness flips to
SERVING. The empty service name "" follows
readiness because it is what a gRPC probe that names no service asks for (Kubernetes' grpc probe,
grpc_health_probe): a pool must not route to a replica that cannot generate yet.

Anything that makes startup impossible (a missing file, a port in use, a model that fails to load) raises
``StartupError`` with one line naming the problem and the flag that fixes it; ``run()`` then stops what it started
and re-raises (``dgserve serve`` prints the line and exits 2).

``drain()`` (SIGTERM/SIGINT under ``run()``): every health status NOT_SERVING at once, new calls UNAVAILABLE (gRPC)
or 503 (HTTP), in-flight streams of both front doors get ``drain_timeout`` seconds to finish; the requests still
running then are cancelled in the engine, so every stream ends cleanly (gRPC: Finished{CANCELLED} then OK; SSE: a
last chunk with finish_reason "abort", then [DONE]) within ``FLUSH_S`` more seconds; then the engine stops. An
engine fault fails in-flight calls (INTERNAL / 500) and turns liveness and readiness off, so an orchestrator
restarts the process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import socket
from collections.abc import Callable

import grpc
from grpc_health.v1 import health

from dgserve.engine.async_engine import AsyncEngine, fault_summary
from dgserve.engine.cpu_threads import ThreadChoice, on_passing_thread
from dgserve.engine.engine import Engine
from dgserve.engine.scheduler import SchedulerConfig
from dgserve.media.images import ImageCaps

from . import connections, hub
from .config import ServiceConfig
from .grpc import convert, door
from .grpc.door import LIVENESS_NAME, NOT_SERVING, SERVING
from .grpc.interceptors import BearerAuth, load_tokens
from .grpc.servicer import ServingState
from .http.front_door import HttpFrontDoor, bind, describe_bind_error
from .http.gate import Gate
from .http.responses.store import ResponseStore
from .http.site import HostPolicy, OriginPolicy
from .image_work import image_work
from .images import ImageReader
from .media_fetch import FetchPolicy
from .metrics import Metrics

log = logging.getLogger("dgserve.server")
FLUSH_S = 2.0  # after the drain grace: time the cancelled streams get to send their last event


class StartupError(Exception):
    """Startup cannot succeed; the message is one line naming the problem and the flag / env var that fixes it."""


def scheduler_config(cfg: ServiceConfig) -> SchedulerConfig:
    return SchedulerConfig(
        max_num_seqs=cfg.max_num_seqs,
        max_queue_len=cfg.max_queue_len,
        prefill_chunk=cfg.prefill_chunk,
        max_prefill_tokens=cfg.prefill_chunk,
        image_token_cost=cfg.image_token_cost,
    )


def model_path(cfg: ServiceConfig, log_progress: bool | None = None) -> str:
    """The checkpoint directory ``cfg`` names: the default model when cfg.model is None, a Hub id's snapshot
    (downloaded if need be: hub.HubError when it cannot be had), else the directory itself."""
    from dgserve.model.default_model import default_model_path

    if cfg.model is None:
        return str(default_model_path())
    if hub.is_hub_id(cfg.model):
        progress = cfg.json_logs if log_progress is None else log_progress
        return hub.fetch(cfg.model, cfg.revision, cfg.download_dir, log_progress=progress)
    return cfg.model


def load_engine(cfg: ServiceConfig) -> Engine:
    """The engine for ``cfg`` (the default model when cfg.model is None; a Hub id is downloaded first)."""
    path = model_path(cfg)
    return Engine.from_pretrained(
        path,
        device=cfg.device,
        dtype=cfg.dtype,
        native_ops=cfg.native_ops,
        scheduler_config=scheduler_config(cfg),
        max_model_len=cfg.max_model_len,
        hf_overrides=cfg.hf_overrides,
        allow_long_max_model_len=cfg.allow_long_max_model_len,
        cache_config=cfg.kv_cache_memory,
        max_request_steps=cfg.max_request_steps,
        max_request_seconds=cfg.max_request_seconds,
        default_max_tokens=cfg.default_max_tokens,
        max_tokens_policy=cfg.max_tokens_policy,
        prefix_caching=cfg.prefix_caching,
    )


class Server:
    """One dgserve gRPC server. ``engine_factory`` (default: ``load_engine(config)``) runs on a thread of its own that
    ends with it (``on_passing_thread``)."""

    def __init__(
        self,
        config: ServiceConfig,
        engine_factory: Callable[[], Engine] | None = None,
        cpu_threads: ThreadChoice | None = None,
    ):
        """``cpu_threads``: the thread count ``dgserve serve`` set for the process (``apply_cpu_threads``), logged
        once the server is listening; None: the embedding program keeps torch's as it is."""
        self.config = config
        self.cpu_threads = cpu_threads
        self.engine_factory = engine_factory or (lambda: load_engine(config))
        self.metrics = Metrics()
        self.state = ServingState()
        self.health = health.aio.HealthServicer()
        self.port: int | None = None
        self.http_port: int | None = None
        self.live = True
        self.loaded = asyncio.Event()  # set when loading ended (ready or failed)
        self.load_error: Exception | None = None
        self._grpc: grpc.aio.Server | None = None
        self._http: HttpFrontDoor | None = None
        self._load_task: asyncio.Task | None = None
        self._stopped = asyncio.Event()
        self.connection_events = connections.ConnectionEvents(self.metrics.connections_rejected)
        self.connection_plan: connections.ConnectionPlan | None = None

    # ---------------------------------------------------------------- start

    async def start(self) -> None:
        """Check the given files, bind both ports, serve health; the model loads in the background.
        StartupError (after releasing whatever was bound) when any of that cannot succeed."""
        cfg = self.config
        auth = BearerAuth(_tokens(cfg.auth_token_file)) if cfg.auth_token_file else None
        creds = _credentials(cfg)
        _check_model_dir(cfg.model)
        self.connection_plan = plan = connections.start_plan(cfg.max_connections, cfg.http_port is not None)
        self._grpc = server = door.new_server(cfg, self.metrics, auth, plan.grpc)
        try:
            await self._start_grpc(server, creds)
            if cfg.http_port is not None:
                await self._start_http(cfg.http_port, auth)
        except BaseException:
            await server.stop(None)
            raise
        self.metrics.connections.track(
            {"grpc": plan.grpc, "http": plan.http} if self._http is not None else {"grpc": plan.grpc},
            self.port,
            None if self._http is None else self._http.open_connections,
        )
        await self.health.set(LIVENESS_NAME, SERVING)
        await door.set_ready(self.health, NOT_SERVING)
        connections.log_plan(plan)
        if self.cpu_threads is not None:
            log.info("%s", self.cpu_threads.describe())
        log.info(
            "listening: gRPC %s:%s%s, HTTP %s",
            cfg.host,
            self.port,
            " (TLS)" if cfg.tls_cert else "",
            self.http_port if self.http_port is not None else "off",
        )
        self._load_task = asyncio.create_task(self._load())

    async def _start_grpc(self, server: grpc.aio.Server, creds: grpc.ServerCredentials | None) -> None:
        cfg = self.config
        door.add_services(server, self.state, self.health, cfg.reflection)
        address = f"{cfg.host}:{cfg.port}"
        fix = "(choose another with --port / env DGSERVE_GRPC_PORT)"
        if cfg.port != 0:  # grpc says only "Failed to bind" (and logs a core error line): probe first
            try:
                bind(cfg.host, cfg.port).close()
            except OSError as e:
                raise StartupError(f"gRPC port {address}: {describe_bind_error(e)} {fix}") from None
        try:
            self.port = server.add_insecure_port(address) if creds is None else server.add_secure_port(address, creds)
        except RuntimeError:
            raise StartupError(f"gRPC port {address}: cannot bind {fix}") from None
        await server.start()

    async def _start_http(self, port: int, auth: BearerAuth | None) -> None:
        cfg = self.config
        try:
            sock = bind(cfg.host, port)
        except OSError as e:
            raise StartupError(
                f"HTTP port {cfg.host}:{port}: {describe_bind_error(e)} (choose another "
                "with --http-port / env NIM_SERVER_PORT, or 'off')"
            ) from None
        owner = None if auth is None else (lambda value: auth.owner({"authorization": value}))
        store = ResponseStore(
            cfg.responses_store_max_entries,
            cfg.responses_store_max_bytes,
            cfg.responses_store_max_entries_per_caller,
            cfg.responses_store_max_bytes_per_caller,
        )
        gate = Gate(
            self.state,
            self.metrics,
            live=lambda: self.live,
            owner=owner,
            max_body_bytes=cfg.max_message_bytes,
            responses=store,
            trust_chat_template=cfg.trust_request_chat_template,
            caller_header=cfg.caller_header,
        )
        assert self.connection_plan is not None, "start() plans the connections before binding"
        own = (cfg.host, *await asyncio.to_thread(_machine_names))
        self._http = HttpFrontDoor(
            gate,
            sock,
            max_connections=self.connection_plan.http,
            request_timeout=cfg.request_timeout,
            events=self.connection_events,
            hosts=HostPolicy.build(cfg.allowed_hosts, own),
            origins=OriginPolicy.build(cfg.allowed_origins),
            pages=cfg.playground,
        )
        await self._http.start()
        self.http_port = self._http.port

    async def _load(self) -> None:
        try:
            # on threads that end with the work: an OpenMP pool left in a live thread slows every engine step
            # (engine/cpu_threads.py)
            engine = await on_passing_thread(self.engine_factory, "dgserve-load")
            aengine = AsyncEngine(
                engine, stall_timeout_s=self.config.stall_timeout, observer=self.metrics, on_fault=self._on_fault
            )
            if self.config.warm_up:
                await on_passing_thread(aengine.warm_up, "dgserve-warm-up")
            aengine.start()
            names = self.config.served_model_name or (_model_name(engine, self.config),)
            self.state.names = tuple(names)
            self.state.root = self.config.model or str(_default_model_path())
            self.state.info = convert.model_info(aengine, self.state.names)
            cfg = self.config
            caps = ImageCaps(cfg.max_images_per_request, cfg.max_image_bytes, cfg.max_image_pixels)
            remote = FetchPolicy(cfg.allowed_media_domains, cfg.media_fetch_timeout, cfg.media_fetch_max_redirects)
            chunk = engine.runner.prefill_chunk
            reader = ImageReader.for_model(engine.model, caps, remote, chunk)
            self.state.images = dataclasses.replace(reader, work=image_work(cfg, aengine))
            self.metrics.track_engine(
                lambda: aengine.num_running,
                lambda: aengine.num_waiting,
                aengine.max_num_seqs,
                engine.kv_cache_usage,
                engine.prefix_cache_stats,
                model_name=self.state.names[0],
                canvas_length=engine.model.config.canvas_length,
            )
            self.state.engine = aengine
            if not self.state.draining:
                await door.set_ready(self.health, SERVING)
            log.info("ready: serving %s (%s)", ", ".join(self.state.names), self.state.info.precision)
        except Exception as e:
            log.debug("model load failed", exc_info=True)
            path = self.config.model or "the shipped default model"
            detail = " ".join(f"{type(e).__name__}: {e}".split())
            self.state.loading_error = (
                str(e)  # a model by id that cannot be had: its own line (service/hub.py)
                if isinstance(e, hub.HubError)
                else f"model {path} failed to load: {detail} (--model / env NIM_MODEL_PATH)"
            )
            self.load_error = e
            self.live = False
            await self.health.set(LIVENESS_NAME, NOT_SERVING)
        finally:
            self.loaded.set()

    def _on_fault(self, error: Exception) -> None:
        log.error("engine fault, marking the server not live and not ready: %s", error)
        self.live = False
        self.state.engine = None
        # callers see the phase and the type only (fault_summary): never a request's content
        self.state.loading_error = f"engine fault ({fault_summary(error)}); see the server log"
        asyncio.get_running_loop().create_task(door.set_all(self.health, NOT_SERVING))

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
        # The gRPC server keeps accepting calls until the engine is idle, so a new call is answered UNAVAILABLE by
        # the servicer (DrainingError): grpc's own stop() would reject it in the core, as CANCELLED, racing the
        # client. Then stop() gives the last streams what is left of the grace to send their Finished.
        loop = asyncio.get_running_loop()
        end = loop.time() + grace
        waits = [self._engine_idle(end)] + ([self._http.wait_idle(grace)] if self._http is not None else [])
        await asyncio.gather(*waits)
        await self._end_streams()
        if self._grpc is not None:  # None: drained before start()
            await self._grpc.stop(max(0.0, end - loop.time()) + FLUSH_S)
        if self._load_task is not None and not self._load_task.done():
            self._load_task.cancel()
        if self.state.engine is not None:
            await self.state.engine.stop()
        if self.state.images is not None and self.state.images.work is not None:
            self.state.images.work.close()
        if self._http is not None:
            await self._http.stop()
        self.connection_events.close()
        log.info("stopped")
        self._stopped.set()

    async def _end_streams(self) -> None:
        """Past the grace: cancel what still runs, each stream told (Finished{CANCELLED} / finish_reason "abort"),
        and give the front doors FLUSH_S seconds to send those last events before the servers stop."""
        engine = self.state.engine
        if engine is None or not engine.num_in_flight:
            return
        n = engine.cancel_all("drain_timeout")
        log.warning("drain: grace over, %d request(s) cancelled; their streams end with finish reason cancelled", n)
        http = [self._http.wait_idle(FLUSH_S)] if self._http is not None else []
        await asyncio.gather(self.state.streams.wait_idle(FLUSH_S), *http)

    async def _engine_idle(self, end: float) -> None:
        """Until no request is running or waiting in the engine, or the loop's clock passes ``end``."""
        loop = asyncio.get_running_loop()
        while sum(self._load_counts()) and loop.time() < end:  # noqa: ASYNC110 - engine thread's counts: no event
            await asyncio.sleep(0.05)

    def _load_counts(self) -> tuple[int, int]:
        e = self.state.engine
        return (e.num_running, e.num_waiting) if e is not None else (0, 0)

    async def run(self) -> None:
        """Start, then serve until SIGTERM / SIGINT, then drain. StartupError when startup cannot succeed,
        including a model that fails to load (after stopping what was started)."""
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await self.start()
        signalled = asyncio.create_task(stop.wait())
        loaded = asyncio.create_task(self.loaded.wait())
        await asyncio.wait((signalled, loaded), return_when=asyncio.FIRST_COMPLETED)
        if not signalled.done() and self.load_error is None:
            await signalled
        loaded.cancel()
        signalled.cancel()
        await self.drain(grace=0 if self.load_error is not None else None)
        if self.load_error is not None and not stop.is_set():
            raise StartupError(self.state.loading_error) from self.load_error


def _default_model_path():
    from dgserve.model.default_model import default_model_path

    return default_model_path()


def _machine_names() -> tuple[str, ...]:
    """This machine's hostname and FQDN (getfqdn may ask the resolver: run it off the event loop)."""
    name = socket.gethostname()
    return name, socket.getfqdn(name)


def _model_name(engine: Engine, cfg: ServiceConfig) -> str:
    from dgserve.model.default_model import SHIPPED

    path = cfg.model
    if path is None:
        return "dgserve-small" if (SHIPPED / "config.json").is_file() else "dgserve-tiny-random"
    if hub.is_hub_id(path):
        return path  # a Hub id is its own name (org/name), as vLLM serves it
    return os.path.basename(os.path.normpath(path))


def _read(path: str, what: str, fix: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise StartupError(f"{what} {path}: {e.strerror or e} ({fix})") from None


def _tokens(path: str) -> list[str]:
    fix = "--auth-token-file / env DGSERVE_AUTH_TOKEN_FILE"
    try:
        return load_tokens(path)
    except OSError as e:
        raise StartupError(f"auth token file {path}: {e.strerror or e} ({fix})") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise StartupError(f"auth token file {path}: {e} ({fix})") from None


def _credentials(cfg: ServiceConfig) -> grpc.ServerCredentials | None:
    """Server TLS credentials (mTLS with a client CA), the files read now; None without TLS."""
    if cfg.tls_cert is None:
        return None
    assert cfg.tls_key is not None, "ServiceConfig: tls_cert and tls_key are given together"
    key = _read(cfg.tls_key, "TLS key", "--tls-key / env DGSERVE_TLS_KEY")
    cert = _read(cfg.tls_cert, "TLS certificate", "--tls-cert / env DGSERVE_TLS_CERT")
    ca = (
        _read(cfg.tls_client_ca, "TLS client CA", "--tls-client-ca / env DGSERVE_TLS_CLIENT_CA")
        if cfg.tls_client_ca
        else None
    )
    try:
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)
    except Exception as e:  # noqa: BLE001 - grpc raises plain errors on unusable PEM data
        raise StartupError(
            f"TLS certificate {cfg.tls_cert} / key {cfg.tls_key}: unusable ({e}) (--tls-cert, --tls-key)"
        ) from None


def _check_model_dir(path: str | None) -> None:
    """A model directory that cannot load fails here, before the ports are bound (the load itself may still
    fail later, e.g. on a corrupt weight file: run() then ends the process too)."""
    if path is None or hub.is_hub_id(path):  # an id is downloaded and checked in the background (service/hub.py)
        return
    fix = "set --model / env NIM_MODEL_PATH to a checkpoint directory or a Hub id (org/name)"
    if not os.path.isdir(path):
        raise StartupError(
            f"model {path}: {'not a directory' if os.path.exists(path) else 'no such directory'} ({fix})"
        )
    if not os.access(path, os.R_OK | os.X_OK):
        raise StartupError(f"model {path}: permission denied ({fix})")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise StartupError(f"model {path}: no config.json, not a Hugging Face-format checkpoint ({fix})")
