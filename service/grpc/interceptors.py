"""The per-call wrapper for dgserve.v1 calls: bearer-token auth, identifiers, error mapping, access log, metrics.

The wrapper is where ``errors.set_status`` is applied: servicer methods just raise domain exceptions. Everything the
wrapper needs from the call (peer, caller identity, deadline) is read once, when the call starts, into a
``CallInfo``: a call may end (client cancel, deadline) while the handler is suspended, and grpc.aio then finishes
our generator later, after the core call is released — ``context.peer()`` at that point read freed memory and
crashed the server (SIGSEGV; grpc/grpc#29069). After a call ends nothing here touches its context again.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hashlib
import hmac
import logging
import time
import uuid
from dataclasses import dataclass

import grpc

from dgserve.engine.request_checks import check_request_id

from .. import callers
from ..errors import UnauthenticatedError
from ..logs import request_id_var
from . import errors

log = logging.getLogger("dgserve.access")
EXEMPT_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
OUR_PREFIX = "/dgserve.v1."
REQUEST_ID_HEADER = "x-request-id"
DEADLINE_SLACK_S = 0.25  # a cancel this close to the deadline is the deadline (CallInfo.expired)
# how long after a call's deadline the engine ends its request itself (CallInfo.engine_timeout): grpc cancels the
# call at the deadline (DEADLINE_EXCEEDED, the abort counted as "deadline"); the engine's end is the backstop should
# that cancel not reach the request, and comes late enough not to race it
DEADLINE_GRACE_S = 1.0


def load_tokens(path: str) -> list[str]:
    """Accepted bearer tokens: one a line; blank lines and '#' comments ignored. ValueError when none."""
    with open(path, encoding="utf-8") as f:
        tokens = [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
    if not tokens:
        raise ValueError(f"auth_token_file: {path} holds no tokens")
    return tokens


class BearerAuth:
    """Checks ``authorization: Bearer <token>`` against the accepted tokens.

    Tokens are compared as SHA-256 digests with ``hmac.compare_digest`` against every accepted token (constant
    time in the token's content). The digest is also the caller's identity for Abort (never the raw token).
    """

    def __init__(self, tokens: list[str]):
        self._digests = [hashlib.sha256(t.encode()).digest() for t in tokens]

    def owner(self, metadata: dict) -> str:
        """The caller's identity (hex SHA-256 of its token); UnauthenticatedError when the token is not accepted."""
        digest = _token_digest(metadata)
        ok = False
        for d in self._digests:
            ok |= hmac.compare_digest(digest or b"", d)
        if not ok or digest is None:  # no token: never ok (no digest equals b"")
            raise UnauthenticatedError(_DENIED)
        return digest.hex()


_DENIED = "missing or invalid bearer token (send metadata 'authorization: Bearer <token>')"


def _token_digest(metadata: dict) -> bytes | None:
    value = metadata.get("authorization", "")
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return hashlib.sha256(token.strip().encode()).digest()


@dataclass
class CallInfo:
    """What the wrapper and the servicer know about a call, read when it starts (see the module docstring)."""

    method: str
    peer: str
    owner: str | None  # the caller's identity for Abort scoping; None when calls are not authenticated
    deadline: float | None  # time.monotonic() seconds; None without a deadline
    t0: float
    # for the access log: the request's own id, else a valid x-request-id header, else one the server assigned
    # (``assigned``; Generate then runs under it, so the log line and the response carry the same id)
    request_id: str = ""
    assigned: bool = False
    outcome: str = "OK"  # the status code name the call ended with
    ended: bool = False  # the call is over: its context must not be used any more

    def expired(self) -> bool:
        """The deadline has passed, or nearly: the client's own deadline fires first (it started the clock
        earlier) and its RST_STREAM reaches us as a plain cancel up to a network delay before ours."""
        return self.deadline is not None and time.monotonic() >= self.deadline - DEADLINE_SLACK_S

    def past_deadline(self) -> bool:
        """The deadline has passed (no slack): whatever the request sends now, the call's answer is
        DEADLINE_EXCEEDED."""
        return self.deadline is not None and time.monotonic() >= self.deadline

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def engine_timeout(self) -> float | None:
        """The seconds the engine gives this call's request: its time remaining plus ``DEADLINE_GRACE_S`` (None
        without a deadline)."""
        left = self.time_remaining()
        return None if left is None else left + DEADLINE_GRACE_S


_call_var: contextvars.ContextVar[CallInfo | None] = contextvars.ContextVar("dgserve_call", default=None)


def current_call() -> CallInfo | None:
    """The CallInfo of the dgserve.v1 call being handled (None outside one)."""
    return _call_var.get()


class CallInterceptor(grpc.aio.ServerInterceptor):
    """For dgserve.v1 calls: authenticates (when ``auth`` is given), checks identifiers, sets the request id log
    context, maps exceptions to statuses (errors.set_status), logs one access line and counts the outcome
    (``on_rpc(method, code_name, seconds)`` of the metrics object) — for denied calls too.

    ``peer_owner``: without ``auth``, use the client certificate's identity (mTLS) as the caller's identity.
    ``caller_header``: a trusted gateway's metadata key whose value names the caller (service/callers.py).
    Health and reflection are not wrapped (and need no token).
    """

    def __init__(
        self,
        metrics=None,
        *,
        auth: BearerAuth | None = None,
        peer_owner: bool = False,
        caller_header: str | None = None,
    ):
        self.metrics = metrics
        self.auth = auth
        self.peer_owner = peer_owner
        self.caller_header = caller_header  # a trusted gateway's metadata key naming the caller (service/callers.py)

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(OUR_PREFIX):
            return handler
        metadata = dict(details.invocation_metadata or ())
        handler = handler._replace(request_deserializer=_tolerant(handler.request_deserializer))
        if handler.unary_unary:
            return handler._replace(unary_unary=self._unary(handler.unary_unary, details.method, metadata))
        if handler.unary_stream:
            return handler._replace(unary_stream=self._stream(handler.unary_stream, details.method, metadata))
        return handler

    def _unary(self, behavior, method, metadata):
        async def wrapper(request, context):
            call = self._enter(method, context)
            try:
                self._admit(call, request, metadata, context)
                return await behavior(request, context)
            except BaseException as e:  # noqa: BLE001 - _fail re-raises all but Exceptions (a status)
                self._fail(e, context, call)
            finally:
                self._exit(call)

        return wrapper

    def _stream(self, behavior, method, metadata):
        async def wrapper(request, context):
            call = self._enter(method, context)
            try:
                self._admit(call, request, metadata, context)
                # aclosing: when the call ends while we wait at a yield, the servicer's generator is closed now
                # (its finally frees the engine slot), not whenever the garbage collector gets to it
                async with contextlib.aclosing(behavior(request, context)) as items:
                    async for item in items:
                        yield item
            except BaseException as e:  # noqa: BLE001 - _fail re-raises all but Exceptions (a status)
                self._fail(e, context, call)
            finally:
                self._exit(call)

        return wrapper

    # ---------------------------------------------------------------- steps of a call

    @staticmethod
    def _enter(method: str, context) -> CallInfo:
        """Read everything needed from the (still live) call; mark the CallInfo ended when the call is done."""
        remaining = context.time_remaining()
        call = CallInfo(
            method,
            context.peer(),
            None,
            None if remaining is None else time.monotonic() + remaining,
            time.perf_counter(),
        )
        context.add_done_callback(lambda _ctx: setattr(call, "ended", True))
        _call_var.set(call)
        call.request_id, call.assigned = new_request_id(), True  # until the client's own (``_admit``)
        request_id_var.set(call.request_id)
        return call

    def _admit(self, call: CallInfo, request, metadata: dict, context) -> None:
        """Authenticate, then check the request decoded and its identifiers are clean (raises domain errors)."""
        if self.auth is not None:
            call.owner = self.auth.owner(metadata)
        elif self.peer_owner:
            call.owner = _peer_identity(context)
        if self.caller_header is not None:
            callers.note(call.owner, metadata.get(self.caller_header))
        _check_decoded(request)
        header = metadata.get(REQUEST_ID_HEADER, "")
        header = header.decode("latin-1") if isinstance(header, bytes) else header
        if header:
            check_request_id(header, REQUEST_ID_HEADER)
        rid = getattr(request, "request_id", "") or header
        if rid:
            check_request_id(rid, "request_id")
            call.request_id, call.assigned = rid, False
            request_id_var.set(rid)

    @staticmethod
    def _fail(e: BaseException, context, call: CallInfo) -> None:
        """Re-raise what ends the call under us; turn an Exception into the call's status (the handler returns)."""
        if isinstance(e, (asyncio.CancelledError, GeneratorExit)):  # the call ended under us
            call.outcome = "DEADLINE_EXCEEDED" if call.expired() else "CANCELLED"
            raise e
        if isinstance(e, grpc.aio.AbortError):
            call.outcome = (context.code() or grpc.StatusCode.UNKNOWN).name
            raise e
        if not isinstance(e, Exception):
            raise e
        call.outcome = errors.classify(e)[0].name
        if call.ended:  # nobody to tell, and the call must not be touched
            raise e
        errors.set_status(context, e)

    def _exit(self, call: CallInfo) -> None:
        dt = time.perf_counter() - call.t0
        code = call.outcome
        # request_id explicitly: grpc.aio may finish a cancelled call's generator in another task's context
        log.info(
            "%s %s %.1f ms",
            call.method,
            code,
            dt * 1e3,
            extra={
                "rpc": call.method,
                "code": code,
                "duration_ms": round(dt * 1e3, 3),
                "peer": call.peer,
                "request_id": call.request_id,
            },
        )
        if self.metrics is not None:
            self.metrics.on_rpc(call.method, code, dt)


def new_request_id() -> str:
    """An id for a call whose client sent none (the HTTP door's form: ``dg-`` and 32 hex digits)."""
    return f"dg-{uuid.uuid4().hex}"


def _peer_identity(context) -> str | None:
    """Hex SHA-256 of the client certificate's identities (mTLS), None without one."""
    identities = context.peer_identities()
    if not identities:
        return None
    return hashlib.sha256(b"\0".join(identities)).hexdigest()


class _Undecodable:
    """Stands in for a request whose bytes are not a valid message (grpcio would answer UNKNOWN and log a
    traceback; we answer INVALID_ARGUMENT)."""

    request_id = ""

    def __init__(self, error: Exception):
        self.error = error


def _tolerant(deserializer):
    if deserializer is None:
        return None

    def deserialize(data: bytes):
        try:
            return deserializer(data)
        except Exception as e:  # noqa: BLE001 - protobuf raises DecodeError (and others on odd input)
            return _Undecodable(e)

    return deserialize


def _check_decoded(request) -> None:
    if isinstance(request, _Undecodable):
        raise ValueError(f"request: not a valid protobuf message ({request.error})")
