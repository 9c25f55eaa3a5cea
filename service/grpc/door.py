"""The gRPC door's server: grpc core's channel arguments, the call interceptor, and the services it serves
(TextGeneration, health, reflection) on one grpc.aio server; ``service/server.py`` binds, starts and drains it.

Health names: ``liveness`` is SERVING while the process is live (loading included); readiness is the empty name ""
and ``dgserve.v1.TextGeneration`` together (``set_ready``).
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from dgserve.v1 import text_generation_pb2 as pb
from dgserve.v1 import text_generation_pb2_grpc as pb_grpc

from ..config import ServiceConfig
from .interceptors import BearerAuth, CallInterceptor
from .servicer import ServingState, TextGenerationServicer

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TextGeneration"].full_name  # "dgserve.v1.TextGeneration"
MAX_METADATA_BYTES = 16 << 10  # what a client's own request metadata may take (README), counted as HTTP/2 does
# what the transport's own headers add to it (:path, :authority, user-agent, te, content-type, grpc-timeout ...)
HEADER_ALLOWANCE_BYTES = 1 << 10
# a connection with no call for this long gets GOAWAY (clients reconnect on their next call): without it a peer
# that completed the HTTP/2 handshake and answers pings would hold its descriptor forever
GRPC_MAX_IDLE_MS = 300_000
LIVENESS_NAME = "liveness"  # gRPC health name that is SERVING while the process is live (loading included)
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def grpc_options(cfg: ServiceConfig, max_connections: int) -> list[tuple[str, int]]:
    """grpc core's channel arguments for the server; ``max_connections``: this door's cap."""
    return [
        # grpc core closes a connection at once when it holds this many (accept, then close: no accept() loop)
        ("grpc.max_allowed_incoming_connections", max_connections),
        # from accept to the client's HTTP/2 SETTINGS: a silent or trickling connection is closed after this
        ("grpc.server_handshake_timeout_ms", max(1, round(cfg.request_timeout * 1000))),
        ("grpc.max_connection_idle_ms", GRPC_MAX_IDLE_MS),
        ("grpc.max_receive_message_length", cfg.max_message_bytes),
        ("grpc.max_send_message_length", cfg.max_message_bytes),
        # request headers (x-request-id, authorization, ...) are small: a client may not make us log megabytes. The
        # soft limit alone refuses at random between it and twice it (17 KiB passed 12 times in 20); with the hard
        # limit at the same size, the bound is exact (each entry counts name + value + 32 bytes, HTTP/2's measure)
        ("grpc.max_metadata_size", MAX_METADATA_BYTES + HEADER_ALLOWANCE_BYTES),
        ("grpc.absolute_max_metadata_size", MAX_METADATA_BYTES + HEADER_ALLOWANCE_BYTES),
        # a block can take seconds with no DATA frames: let clients ping often without GOAWAY too_many_pings
        ("grpc.keepalive_time_ms", cfg.keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", 20_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", cfg.keepalive_min_ping_ms),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.so_reuseport", 0),
    ]


def new_server(cfg: ServiceConfig, metrics, auth: BearerAuth | None, max_connections: int) -> grpc.aio.Server:
    """The grpc.aio server, not yet serving anything: every dgserve.v1 call goes through the call interceptor
    (``auth``: the accepted bearer tokens, None without auth; ``metrics``: what counts the calls)."""
    interceptors = [
        CallInterceptor(metrics, auth=auth, peer_owner=cfg.tls_client_ca is not None, caller_header=cfg.caller_header)
    ]
    return grpc.aio.server(interceptors=interceptors, options=grpc_options(cfg, max_connections))


def add_services(
    server: grpc.aio.Server, state: ServingState, health_servicer: health.aio.HealthServicer, with_reflection: bool
) -> None:
    """TextGeneration (answering from ``state``), gRPC health, and reflection when ``with_reflection``."""
    pb_grpc.add_TextGenerationServicer_to_server(TextGenerationServicer(state), server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if with_reflection:
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)


async def set_ready(health_servicer: health.aio.HealthServicer, status) -> None:
    """Readiness: "" (what a probe that names no service asks for) and TextGeneration, together."""
    await health_servicer.set("", status)
    await health_servicer.set(SERVICE_NAME, status)


async def set_all(health_servicer: health.aio.HealthServicer, status) -> None:
    """Liveness and readiness."""
    await health_servicer.set(LIVENESS_NAME, status)
    await set_ready(health_servicer, status)
