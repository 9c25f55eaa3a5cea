"""uvicorn's h11 protocol with the two bounds uvicorn lacks: a connection must deliver a complete request (headers
and body) within ``request_timeout`` seconds of connecting, or of its first byte after a keep-alive pause, and the
door holds at most ``max_connections`` connections.

uvicorn only times out *idle keep-alive* connections (its ``timeout_keep_alive``, armed after a response): a
connection that never sends a request, or trickles its headers (slow loris), is otherwise held forever. This
class arms its own timer at ``connection_made`` and whenever a new request starts, and disarms it once h11 has the
whole request; when it fires, a connection still sending its headers or its body is answered 408 (an OpenAI error
body) and closed. When the body was being read, its app task is told the client is gone (its own answer goes
nowhere) and finds ``request_timed_out`` in the request's state (``body.read_json`` then reports 408, not a
disconnect, on the access line).

The cap is enforced twice. At accept() (``BoundedListener``): asyncio accepts up to its backlog of sockets in one
callback before any protocol sees them, so a burst could exhaust the descriptors before ``connection_made`` runs
(and asyncio then logs one error per remaining accept() of the burst); the listener therefore closes at once any
socket beyond what the door can take. At ``connection_made``: over the cap, a new connection first evicts the
oldest connection that holds no request in flight (one still waiting for or receiving its request, or idle
between keep-alive requests): those cost a descriptor and do no work, and evicting them keeps the door open to
health probes under a flood of silent connections. Only when every connection is busy with a request is the new
one shed (reset at once).
"""

from __future__ import annotations

import asyncio
import errno
import json
import socket
from dataclasses import dataclass, field
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..connections import ConnectionEvents
from .errors import HttpError, error_body_for

DOOR = "http"
_RECEIVING = (h11.IDLE, h11.SEND_BODY)  # h11 states of a request not yet complete (IDLE: none yet)
EVICT_SLACK = 16  # sockets accepted beyond the cap (each to evict an idle one): descriptors in flight, bounded
SHED_BURST = 64  # sockets closed at accept() in one call before yielding to the event loop
TIMED_OUT = "request_timed_out"  # the request state's flag (scope["state"]) when the timer cut its body off


def timeout_response(seconds: float, path: str = "") -> bytes:
    """A whole 408 response, to close a connection with: the error body of the route ``path`` asked for
    (Anthropic's on the Messages routes), OpenAI's when its request line never came."""
    status, body, _ = error_body_for(
        path, HttpError("REQUEST_TIMEOUT", f"request: not complete within {seconds:g} s (--request-timeout)")
    )
    data = json.dumps(body).encode()
    head = f"HTTP/1.1 {status} Request Timeout\r\ncontent-type: application/json\r\ncontent-length: {len(data)}\r\n"
    return head.encode() + b"connection: close\r\n\r\n" + data


@dataclass
class DoorState:
    """The HTTP door's connections, shared by every protocol instance of one server."""

    max_connections: int
    request_timeout: float
    events: ConnectionEvents
    open: set[BoundedH11Protocol] = field(default_factory=set)
    idle: dict[BoundedH11Protocol, None] = field(default_factory=dict)  # evictable, oldest first
    accepting: int = 0  # sockets accepted whose protocol does not exist yet
    exhausted: bool = False  # accept() ran out of descriptors in this event-loop iteration

    def admits(self) -> bool:
        """Whether a socket accepted now could be kept: fewer connections busy with a request than the cap (an
        idle one can be evicted for it), and no more than EVICT_SLACK sockets beyond the cap in flight."""
        held = len(self.open) + self.accepting
        return len(self.open) - len(self.idle) < self.max_connections and held < self.max_connections + EVICT_SLACK


class BoundedListener(socket.socket):
    """The HTTP door's listening socket: ``accept()`` closes at once what the door cannot take (module docstring),
    and reports running out of descriptors once per event-loop iteration rather than once per queued socket."""

    door: DoorState

    @classmethod
    def wrap(cls, sock: socket.socket, door: DoorState) -> BoundedListener:
        listener = cls(sock.family, sock.type, sock.proto, fileno=sock.detach())
        listener.door = door
        return listener

    def accept(self) -> tuple[socket.socket, Any]:
        door = self.door
        for _ in range(SHED_BURST):
            conn, addr = self._accept_one()
            if door.admits():
                door.accepting += 1
                return conn, addr
            conn.close()
            door.events.note(DOOR, "limit")
        raise BlockingIOError  # asyncio's "queue empty": the rest waits for the next iteration

    def _accept_one(self) -> tuple[socket.socket, Any]:
        door = self.door
        try:
            return super().accept()
        except OSError as e:
            if e.errno not in (errno.EMFILE, errno.ENFILE):
                raise
            if door.exhausted:  # asyncio would log this again for every socket still queued
                raise BlockingIOError from None
            door.exhausted = True
            asyncio.get_running_loop().call_soon(setattr, door, "exhausted", False)
            door.events.note(DOOR, "no_descriptors")
            raise  # asyncio logs it once and pauses this listener for a second


class BoundedH11Protocol(H11Protocol):
    """See the module docstring. ``door`` is set on the subclass ``protocol_class`` makes for one server."""

    door: DoorState

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.door.accepting = max(0, self.door.accepting - 1)  # asyncio makes the protocol right after accept()
        self._deadline: asyncio.TimerHandle | None = None
        self._shed = False

    # -------------------------------------------------------------- asyncio.Protocol

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        door = self.door
        if len(door.open) >= door.max_connections and not self._evict_oldest_idle():
            self._shed, self.transport = True, transport
            door.events.note(DOOR, "limit")
            transport.abort()  # a reset frees the descriptor now; no response: nothing was asked yet
            return
        super().connection_made(transport)
        door.open.add(self)
        self._mark_idle()
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._shed:  # never entered uvicorn's bookkeeping
            return
        self._forget()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._deadline is None and self.conn.their_state in _RECEIVING:
            self._arm()  # a new request after a keep-alive pause (uvicorn's timer covered the pause)
        super().data_received(data)
        if self.conn.their_state not in _RECEIVING:
            self._disarm()  # the request is complete: the response may take as long as it takes
            self.door.idle.pop(self, None)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._mark_idle()

    # -------------------------------------------------------------- the bounds

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.door.request_timeout, self._timed_out)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _mark_idle(self) -> None:
        self.door.idle.pop(self, None)
        self.door.idle[self] = None  # newest last

    def _forget(self) -> None:
        self._disarm()
        self.door.open.discard(self)
        self.door.idle.pop(self, None)

    def _timed_out(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        self.door.events.note(DOOR, "timeout")
        cycle = self.cycle
        if cycle is not None and cycle.response_started:  # the app answered early, and is still answering
            self._close()
            return
        path = cycle.scope.get("path", "") if cycle is not None else ""
        self.transport.write(timeout_response(self.door.request_timeout, path))
        if cycle is not None:  # the app task is reading the body: it sees a disconnect, and why
            cycle.scope.setdefault("state", {})[TIMED_OUT] = True
            cycle.disconnected = True  # (uvicorn's own flag: its send() drops what the app writes from now on)
            cycle.message_event.set()
        self._forget()
        self.transport.close()  # (not abort: the 408 is flushed first)

    def _evict_oldest_idle(self) -> bool:
        """Close the oldest connection with no request in flight; False when there is none."""
        for victim in self.door.idle:
            self.door.events.note(DOOR, "evicted")
            victim._close()
            return True
        return False

    def _close(self) -> None:
        """Close now and leave the door's books at once (connection_lost comes a loop iteration later)."""
        self._forget()
        if self.cycle is not None and not self.cycle.response_complete:
            self.transport.abort()  # an app task may still write: the client must not read a torn response
        else:
            self.transport.close()


def protocol_class(door: DoorState) -> type[BoundedH11Protocol]:
    """A BoundedH11Protocol subclass bound to ``door``, for ``uvicorn.Config(http=...)``."""
    return type("BoundedH11Protocol", (BoundedH11Protocol,), {"door": door})
