"""Exceptions → the reason every door names them by, in one table (``reason``); the doors map a reason to their
own status: gRPC status codes in ``grpc/errors.py``, HTTP statuses in ``http/errors.py``.

Domain code raises plain Python exceptions (ValueError naming the field, NotImplementedError, QueueFullError, ...);
nothing else in the service picks a status code. Messages are bounded (``clip``, ``bounded_message``) and internal
errors never leak tracebacks (``log_internal``).
"""

from __future__ import annotations

import logging

from dgserve.engine.async_engine import EngineFaultError, EngineUnavailableError, StreamStalledError
from dgserve.engine.request import RequestFailedError
from dgserve.engine.scheduler import DuplicateRequestError, QueueFullError
from dgserve.text.token_bounds import ContextLengthError

log = logging.getLogger("dgserve.service")
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
REASONS: list[tuple[type[BaseException], str]] = [
    (UnauthenticatedError, "UNAUTHENTICATED"),
    (DuplicateRequestError, "DUPLICATE_REQUEST_ID"),
    (ModelNotFoundError, "MODEL_NOT_FOUND"),
    (RequestNotFoundError, "REQUEST_NOT_FOUND"),
    (QueueFullError, "OVERLOADED"),
    (NotImplementedError, "UNSUPPORTED"),
    (ContextLengthError, "CONTEXT_LENGTH_EXCEEDED"),  # a ValueError: the prompt does not fit the context
    (ValueError, "INVALID_ARGUMENT"),
    (NotReadyError, "NOT_READY"),
    (DrainingError, "DRAINING"),
    (DeadlineExceededError, "DEADLINE_EXCEEDED"),
    (EngineUnavailableError, "ENGINE_UNAVAILABLE"),
    (StreamStalledError, "STREAM_STALLED"),
    (EngineFaultError, "ENGINE_FAULT"),
    (RequestFailedError, "REQUEST_FAILED"),
]


def reason(exc: BaseException) -> str:
    """The reason of an exception (gRPC's ErrorInfo reason); "INTERNAL" for anything unexpected."""
    for kind, name in REASONS:
        if isinstance(exc, kind):
            return name
    return "INTERNAL"


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


def log_internal(exc: BaseException) -> None:
    """Log an exception answered as INTERNAL / 500: with its traceback, except a request's own failure
    (``RequestFailedError``), which the engine logged where it happened (request id, phase, type) and whose
    traceback here would only show the door re-raising it."""
    if isinstance(exc, RequestFailedError):
        log.warning("request failed alone: %s", exc)
    else:
        log.error("internal error: %s: %s", type(exc).__name__, exc, exc_info=exc)
