"""Exceptions → OpenAI error bodies and HTTP statuses, in one table keyed by the reason ``service.errors.classify``
gives every exception (so gRPC and HTTP agree on what an error is; only the code differs).

Body: ``{"error": {"message", "type", "param", "code"}}`` (OpenAI's shape; ``param`` names the field of a 400).
"""

from __future__ import annotations

import logging
import re

from fastapi.responses import JSONResponse

from dgserve.engine.scheduler import QueueFullError

from .. import errors

log = logging.getLogger("dgserve.http")
_FIELD = re.compile(r"^([A-Za-z_][\w.\[\]]*)")  # the field a 400 message starts with

# ErrorInfo reason → (HTTP status, OpenAI error type)
STATUS: dict[str, tuple[int, str]] = {
    "INVALID_ARGUMENT": (400, "invalid_request_error"),
    "UNSUPPORTED": (400, "invalid_request_error"),
    "UNAUTHENTICATED": (401, "authentication_error"),
    "MODEL_NOT_FOUND": (404, "not_found_error"),
    "REQUEST_NOT_FOUND": (404, "not_found_error"),
    "NOT_FOUND": (404, "not_found_error"),
    "METHOD_NOT_ALLOWED": (405, "invalid_request_error"),
    "DUPLICATE_REQUEST_ID": (409, "invalid_request_error"),
    "REQUEST_TOO_LARGE": (413, "invalid_request_error"),
    "OVERLOADED": (429, "rate_limit_error"),
    "NOT_READY": (503, "service_unavailable_error"),
    "DRAINING": (503, "service_unavailable_error"),
    "ENGINE_UNAVAILABLE": (503, "service_unavailable_error"),
    "STREAM_STALLED": (503, "service_unavailable_error"),
    "ENGINE_FAULT": (500, "server_error"),
    "REQUEST_FAILED": (500, "server_error"),
    "INTERNAL": (500, "server_error"),
}


class HttpError(Exception):
    """An error decided by the HTTP layer itself (auth, body size, routing), with its reason."""

    def __init__(self, reason: str, message: str, param: str | None = None):
        super().__init__(message)
        self.reason, self.param = reason, param


def error_body(exc: BaseException) -> tuple[int, dict, dict[str, str]]:
    """(HTTP status, OpenAI error body, extra headers) for an exception; the message is bounded
    (``errors.bounded_message``: a client's huge value is never echoed back whole)."""
    if isinstance(exc, HttpError):
        reason, param = exc.reason, exc.param
    else:
        reason = errors.classify(exc)[1]
        param = None
    status, kind = STATUS.get(reason, (500, "server_error"))
    message = errors.bounded_message(str(exc)) if status != 500 or isinstance(exc, HttpError) else "internal error"
    if status == 500 and not isinstance(exc, HttpError):
        errors.log_internal(exc)
    if status == 400 and param is None:
        field = _FIELD.match(message)
        param = field.group(1) if field else None
    headers: dict[str, str] = {}
    if isinstance(exc, QueueFullError):
        headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return status, {"error": {"message": message, "type": kind, "param": param, "code": reason.lower()}}, headers


def error_response(exc: BaseException) -> JSONResponse:
    """The OpenAI error response for an exception (``error_body``)."""
    status, body, headers = error_body(exc)
    return JSONResponse(body, status_code=status, headers=headers)
