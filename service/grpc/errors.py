"""Exceptions → gRPC status codes, in one table keyed by the reason ``service.errors.reason`` gives every exception
(so gRPC and HTTP agree on what an error is; only the code differs), applied in one place (``set_status``, used by
the call interceptor).

Statuses carry google.rpc details: ``BadRequest`` with the field for INVALID_ARGUMENT, ``RetryInfo`` for
RESOURCE_EXHAUSTED (plus the ``grpc-retry-pushback-ms`` trailer of gRPC's retry design A6), ``ErrorInfo{reason}``
always; a prompt that does not fit is INVALID_ARGUMENT with reason CONTEXT_LENGTH_EXCEEDED and its numbers in the
ErrorInfo's metadata (``prompt_tokens``, ``max_prompt_tokens``, ``at_least``). Internal errors never leak tracebacks.
"""

from __future__ import annotations

import re

import grpc
from google.protobuf import duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from dgserve.engine.scheduler import QueueFullError
from dgserve.text.token_bounds import ContextLengthError

from .. import errors

DOMAIN = "dgserve.v1"
RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"

# reason (service.errors.REASONS) → status code
CODES: dict[str, grpc.StatusCode] = {
    "UNAUTHENTICATED": grpc.StatusCode.UNAUTHENTICATED,
    "DUPLICATE_REQUEST_ID": grpc.StatusCode.ALREADY_EXISTS,
    "MODEL_NOT_FOUND": grpc.StatusCode.NOT_FOUND,
    "REQUEST_NOT_FOUND": grpc.StatusCode.NOT_FOUND,
    "OVERLOADED": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "UNSUPPORTED": grpc.StatusCode.UNIMPLEMENTED,
    "INVALID_ARGUMENT": grpc.StatusCode.INVALID_ARGUMENT,
    "CONTEXT_LENGTH_EXCEEDED": grpc.StatusCode.INVALID_ARGUMENT,
    "NOT_READY": grpc.StatusCode.UNAVAILABLE,
    "DRAINING": grpc.StatusCode.UNAVAILABLE,
    "DEADLINE_EXCEEDED": grpc.StatusCode.DEADLINE_EXCEEDED,
    "ENGINE_UNAVAILABLE": grpc.StatusCode.UNAVAILABLE,
    "STREAM_STALLED": grpc.StatusCode.UNAVAILABLE,
    "ENGINE_FAULT": grpc.StatusCode.INTERNAL,
    "REQUEST_FAILED": grpc.StatusCode.INTERNAL,
    "INTERNAL": grpc.StatusCode.INTERNAL,
}

_FIELD = re.compile(r"^([A-Za-z_][\w.\[\]]*)")


def classify(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """(status code, ErrorInfo reason) of an exception; INTERNAL for anything unexpected."""
    reason = errors.reason(exc)
    return CODES[reason], reason


def to_status(exc: BaseException) -> grpc.Status:
    """The full status (code, message, google.rpc details, retry trailer) for an exception; the message is
    bounded (``bounded_message``)."""
    code, reason = classify(exc)
    message = errors.bounded_message(str(exc)) if reason != "INTERNAL" else "internal error"
    details = [error_details_pb2.ErrorInfo(reason=reason, domain=DOMAIN, metadata=_metadata(exc))]
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


def _metadata(exc: BaseException) -> dict[str, str]:
    """ErrorInfo metadata: a prompt that does not fit the context (CONTEXT_LENGTH_EXCEEDED) carries its numbers,
    ``prompt_tokens`` (a lower bound when ``at_least`` is "true") and ``max_prompt_tokens``."""
    if not isinstance(exc, ContextLengthError):
        return {}
    return {
        "prompt_tokens": str(exc.tokens),
        "max_prompt_tokens": str(exc.maximum),
        "at_least": "true" if exc.lower_bound else "false",
    }


def set_status(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """Give the call the status for ``exc``; the handler then returns and grpc.aio sends it.

    Not ``context.abort``: grpc.aio keeps the AbortError it raises on the call, and its traceback holds the
    handler frames, so every rejected call (the request in it: 15 MB for a huge prompt) stayed in a reference
    cycle until the cycle collector ran; RSS grew by ~35 MB per rejected 15 MB prompt."""
    status = to_status(exc)
    if status.code is grpc.StatusCode.INTERNAL:
        errors.log_internal(exc)
    context.set_code(status.code)
    context.set_details(status.details)
    context.set_trailing_metadata(status.trailing_metadata)


class _Status(grpc.Status):
    def __init__(self, code, details, trailing_metadata):
        self.code, self.details, self.trailing_metadata = code, details, trailing_metadata


_CODE_NUMBERS = {c: getattr(code_pb2, c.name) for c in grpc.StatusCode}
