"""uvicorn on the running asyncio loop (the grpc.aio server's): we bind the socket ourselves, so a port in use is
reported as one line, and run uvicorn's startup / tick loop / shutdown steps as tasks, never ``uvicorn.run`` or
``Server.serve`` (which would own the loop and replace our SIGTERM handling)."""

from __future__ import annotations

import asyncio
import errno
import logging
import socket

import uvicorn

from ..connections import ConnectionEvents
from .app import build_app
from .bounded import BoundedListener, DoorState, protocol_class
from .gate import Gate
from .site import HostPolicy, OriginPolicy

log = logging.getLogger("dgserve.http")
KEEP_ALIVE_S = 30  # an idle keep-alive connection is closed after this (uvicorn's own timer)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: ephemeral); OSError with the reason when it cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets whose proto says TCP (with proto 0 every
    # small response write would wait out the peer's delayed ACK, ~40 ms a request)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT after a restart; not a shared port
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


class HttpFrontDoor:
    """The FastAPI app served by uvicorn on ``sock``, in this event loop, holding at most ``max_connections``
    connections, each of which must deliver a complete request within ``request_timeout`` seconds
    (service/http/bounded.py); ``events`` counts and logs the connections closed or shed for that. ``hosts`` and
    ``origins``: who may reach it from a browser (service/http/site.py); ``pages``: serve the playground and
    dashboard (service/http/playground.py)."""

    def __init__(
        self,
        gate: Gate,
        sock: socket.socket,
        *,
        max_connections: int,
        request_timeout: float,
        events: ConnectionEvents,
        hosts: HostPolicy,
        origins: OriginPolicy,
        pages: bool = True,
    ):
        self.door = DoorState(max_connections, request_timeout, events)
        self.gate, self.sock = gate, BoundedListener.wrap(sock, self.door)
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(
            build_app(gate, hosts, origins, pages),
            lifespan="off",
            http=protocol_class(self.door),
            loop="none",
            log_config=None,
            access_log=False,
            server_header=False,
            timeout_graceful_shutdown=1,
            timeout_keep_alive=KEEP_ALIVE_S,
        )
        config.load()
        logging.getLogger("uvicorn.error").setLevel(logging.WARNING)  # its lifecycle lines duplicate ours
        self._server = uvicorn.Server(config)
        self._server.lifespan = config.lifespan_class(config)
        self._ticker: asyncio.Task | None = None

    def open_connections(self) -> int:
        return len(self.door.open)

    async def start(self) -> None:
        await self._server.startup(sockets=[self.sock])
        self._ticker = asyncio.create_task(self._server.main_loop())

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no generation request is in flight (at most ``timeout`` s); True when idle."""
        if await self.gate.calls.wait_idle(timeout):
            return True
        log.warning("drain: %d HTTP request(s) still running after %.1f s", self.gate.calls.count, timeout)
        return False

    async def stop(self) -> None:
        self._server.should_exit = True
        if self._ticker is not None:
            await self._ticker
        await self._server.shutdown(sockets=[self.sock])


def describe_bind_error(e: OSError) -> str:
    if e.errno == errno.EADDRINUSE:
        return "address already in use"
    if e.errno == errno.EACCES:
        return "permission denied"
    if e.errno == errno.EADDRNOTAVAIL:
        return "address not available on this host"
    return e.strerror or str(e)
