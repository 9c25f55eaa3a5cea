"""Exceptions → gRPC status codes, in one table, applied in one place (``abort``, used by the call interceptor).

Domain code raises plain Python exceptions (ValueError naming the field, NotImplementedError, QueueFullError, ...);
nothing else in the service picks a status code. Statuses carry google.rpc details: ``BadRequest`` with the
field for INVALID_ARGUMENT, ``RetryInfo`` for RESOURCE_EXHAUSTED (plus the ``grpc-retry-pushback-ms`` trailer of
gRPC's retry design A6), ``ErrorInfo{reason}`` always. Internal errors never leak tracebacks.
"""

from __future__ import annotations

import logging
import re

import grpc
from google.protobuf import duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from dgserve.engine.async_engine import EngineFaultError, EngineUnavailableError, StreamStalledError
from dgserve.engine.request import RequestFailedError
from dgserve.engine.scheduler import DuplicateRequestError, QueueFullError

log = logging.getLogger("dgserve.service")
DOMAIN = "dgserve.v1"
RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"
# what an error message may quote of a client's value, and how long a whole message may be: a client must not
# get its 15 MB model name back in a 404, nor make us log it
MAX_ECHO_CHARS = 80
MAX_MESSAGE_CHARS = 2048


class ModelNotFoundError(LookupError):
    """GenerateRequest.model names a model this server does not serve."""


class RequestNotFoundError(LookupError):
    """Abort of a request id this server has never seen (or long forgotten)."""


class UnauthenticatedError(Exception):
    """The call carries no accepted bearer token."""


class NotReadyError(Exception):
    """The model is still loading or warming up."""


class DrainingError(Exception):
    """The server is shutting down and takes no new requests."""


class DeadlineExceededError(Exception):
    """The call's deadline passed before its request's end was sent (the engine ended it at its backstop)."""


# most specific first: DuplicateRequestError is a ValueError
TABLE: list[tuple[type[BaseException], grpc.StatusCode, str]] = [
    (UnauthenticatedError, grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED"),
    (DuplicateRequestError, grpc.StatusCode.ALREADY_EXISTS, "DUPLICATE_REQUEST_ID"),
    (ModelNotFoundError, grpc.StatusCode.NOT_FOUND, "MODEL_NOT_FOUND"),
    (RequestNotFoundError, grpc.StatusCode.NOT_FOUND, "REQUEST_NOT_FOUND"),
    (QueueFullError, grpc.StatusCode.RESOURCE_EXHAUSTED, "OVERLOADED"),
    (NotImplementedError, grpc.StatusCode.UNIMPLEMENTED, "UNSUPPORTED"),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT"),
    (NotReadyError, grpc.StatusCode.UNAVAILABLE, "NOT_READY"),
    (DrainingError, grpc.StatusCode.UNAVAILABLE, "DRAINING"),
    (DeadlineExceededError, grpc.StatusCode.DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED"),
    (EngineUnavailableError, grpc.StatusCode.UNAVAILABLE, "ENGINE_UNAVAILABLE"),
    (StreamStalledError, grpc.StatusCode.UNAVAILABLE, "STREAM_STALLED"),
    (EngineFaultError, grpc.StatusCode.INTERNAL, "ENGINE_FAULT"),
    (RequestFailedError, grpc.StatusCode.INTERNAL, "REQUEST_FAILED"),
]

_FIELD = re.compile(r"^([A-Za-z_][\w.\[\]]*)")


def classify(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """(status code, ErrorInfo reason) of an exception; INTERNAL for anything unexpected."""
    for kind, code, reason in TABLE:
        if isinstance(exc, kind):
            return code, reason
    return grpc.StatusCode.INTERNAL, "INTERNAL"


def clip(value: str, limit: int = MAX_ECHO_CHARS) -> str:
    """``value`` as an error message may quote it: unchanged when at most ``limit`` characters, else its first
    ``limit`` characters, an ellipsis and its full length."""
    if len(value) <= limit:
        return value
    return f"{value[:limit]}… ({len(value)} characters)"


def bounded_message(message: str) -> str:
    """An error message fit to send and log: at most MAX_MESSAGE_CHARS characters (the leading field name kept),
    and lone surrogates (which no UTF-8 encoder accepts) written as backslash escapes."""
    message = clip(message, MAX_MESSAGE_CHARS)
    if message.isascii():
        return message
    return message.encode("utf-8", "backslashreplace").decode("utf-8")


def to_status(exc: BaseException) -> grpc.Status:
    """The full status (code, message, google.rpc details, retry trailer) for an exception; the message is
    bounded (``bounded_message``)."""
    code, reason = classify(exc)
    message = bounded_message(str(exc)) if reason != "INTERNAL" else "internal error"
    details = [error_details_pb2.ErrorInfo(reason=reason, domain=DOMAIN)]
    trailers: list[tuple[str, str]] = []
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        field = _FIELD.match(message)
        details.append(
            error_details_pb2.BadRequest(
                field_violations=[
                    error_details_pb2.BadRequest.FieldViolation(
                        field=field.group(1) if field else "", description=message
                    )
                ]
            )
        )
    if isinstance(exc, QueueFullError):
        ms = max(1, int(exc.retry_after_s * 1000))
        details.append(
            error_details_pb2.RetryInfo(
                retry_delay=duration_pb2.Duration(seconds=ms // 1000, nanos=(ms % 1000) * 1_000_000)
            )
        )
        trailers.append((RETRY_PUSHBACK_KEY, str(ms)))
    status = status_pb2.Status(code=_CODE_NUMBERS[code], message=message)
    for d in details:
        status.details.add().Pack(d)
    rich = rpc_status.to_status(status)
    return _Status(rich.code, rich.details, tuple(rich.trailing_metadata) + tuple(trailers))


def set_status(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """Give the call the status for ``exc``; the handler then returns and grpc.aio sends it.

    Not ``context.abort``: grpc.aio keeps the AbortError it raises on the call, and its traceback holds the
    handler frames, so every rejected call (the request in it: 15 MB for a huge prompt) stayed in a reference
    cycle until the cycle collector ran; RSS grew by ~35 MB per rejected 15 MB prompt."""
    status = to_status(exc)
    if status.code is grpc.StatusCode.INTERNAL:
        log_internal(exc)
    context.set_code(status.code)
    context.set_details(status.details)
    context.set_trailing_metadata(status.trailing_metadata)


def log_internal(exc: BaseException) -> None:
    """Log an exception answered as INTERNAL / 500: with its traceback, except a request's own failure
    (``RequestFailedError``), which the engine logged where it happened (request id, phase, type) and whose
    traceback here would only show the door re-raising it."""
    if isinstance(exc, RequestFailedError):
        log.warning("request failed alone: %s", exc)
    else:
        log.error("internal error: %s: %s", type(exc).__name__, exc, exc_info=exc)


class _Status(grpc.Status):
    def __init__(self, code, details, trailing_metadata):
        self.code, self.details, self.trailing_metadata = code, details, trailing_metadata


_CODE_NUMBERS = {c: getattr(code_pb2, c.name) for c in grpc.StatusCode}
