"""Exceptions → OpenAI error bodies and HTTP statuses, in one table keyed by the reason ``service.errors.reason``
gives every exception (so gRPC and HTTP agree on what an error is; only the code differs).

Body: ``{"error": {"message", "type", "param", "code"}}`` (OpenAI's shape; ``param`` names the field of a 400).
"""

from __future__ import annotations

import logging
import re

from fastapi.responses import JSONResponse

from dgserve.engine.scheduler import QueueFullError
from dgserve.text.token_bounds import ContextLengthError

from .. import errors

log = logging.getLogger("dgserve.http")
_FIELD = re.compile(r"^([A-Za-z_][\w.\[\]]*)")  # the field a 400 message starts with

# ErrorInfo reason → (HTTP status, OpenAI error type)
STATUS: dict[str, tuple[int, str]] = {
    "INVALID_ARGUMENT": (400, "invalid_request_error"),
    "CONTEXT_LENGTH_EXCEEDED": (400, "invalid_request_error"),  # code "context_length_exceeded", OpenAI's
    "UNSUPPORTED": (400, "invalid_request_error"),
    "HOST_NOT_ALLOWED": (400, "invalid_request_error"),
    "UNAUTHENTICATED": (401, "authentication_error"),
    "ORIGIN_NOT_ALLOWED": (403, "permission_error"),
    "MODEL_NOT_FOUND": (404, "not_found_error"),
    "REQUEST_NOT_FOUND": (404, "not_found_error"),
    "NOT_FOUND": (404, "not_found_error"),
    "METHOD_NOT_ALLOWED": (405, "invalid_request_error"),
    "REQUEST_TIMEOUT": (408, "invalid_request_error"),
    "DUPLICATE_REQUEST_ID": (409, "invalid_request_error"),
    "REQUEST_TOO_LARGE": (413, "invalid_request_error"),
    "UNSUPPORTED_MEDIA_TYPE": (415, "invalid_request_error"),
    "OVERLOADED": (429, "rate_limit_error"),
    "CLIENT_CLOSED": (499, "invalid_request_error"),  # nobody reads it: the status of the access line
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
        reason = errors.reason(exc)
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


# ---------------------------------------------------------------------------------------------- Anthropic's shape

# HTTP status → Anthropic's error type (the Messages routes: docs/messages-api.md, "Errors")
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",  # a request not complete within --request-timeout (bounded.py)
    409: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",  # a body that is not JSON (the site guard's rule for a browser's simple POST)
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
# reasons whose status differs on the Messages routes: a full queue is Anthropic's "overloaded" (529)
ANTHROPIC_STATUS = {"OVERLOADED": 529}
MESSAGES_PATH = "/v1/messages"  # the Messages routes (and any path under this prefix) answer in Anthropic's shape


def anthropic_error_body(exc: BaseException) -> tuple[int, dict, dict[str, str]]:
    """(HTTP status, Anthropic error body ``{"type": "error", "error": {"type", "message"}}``, extra headers) for
    an exception: ``error_body``'s status, message and headers, in Anthropic's shape."""
    status, body, headers = error_body(exc)
    err = body["error"]
    status = ANTHROPIC_STATUS.get(err["code"].upper(), status)
    kind = ANTHROPIC_TYPES.get(status, "api_error")
    message = err["message"]
    if isinstance(exc, ContextLengthError):
        message = too_long(exc, message)
    return status, {"type": "error", "error": {"type": kind, "message": message}}, headers


def too_long(exc: ContextLengthError, message: str) -> str:
    """Anthropic's wording for a prompt that does not fit, ``prompt is too long: N tokens > M maximum`` (what
    Claude Code reads to compact the conversation), M the most prompt tokens that fit; N is a lower bound when
    counting stopped early, and our own message, which follows in parentheses, then says "at least"
    (docs/messages-api.md, "Errors")."""
    return errors.bounded_message(f"prompt is too long: {exc.tokens} tokens > {exc.maximum} maximum ({message})")


def anthropic_error_response(exc: BaseException) -> JSONResponse:
    """The Anthropic error response for an exception (``anthropic_error_body``)."""
    status, body, headers = anthropic_error_body(exc)
    return JSONResponse(body, status_code=status, headers=headers)


def is_messages_path(path: str) -> bool:
    """Whether ``path`` is one of the Messages routes (or under them), which answer in Anthropic's shape."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def error_body_for(path: str, exc: BaseException) -> tuple[int, dict, dict[str, str]]:
    """``anthropic_error_body`` on the Messages routes, ``error_body`` elsewhere."""
    return anthropic_error_body(exc) if is_messages_path(path) else error_body(exc)


def error_response_for(path: str, exc: BaseException) -> JSONResponse:
    """The error response of a failure on ``path`` that no route's own handler answered (the site guard, the
    request id check, an unknown route or method): Anthropic's shape on the Messages routes, OpenAI's elsewhere."""
    status, body, headers = error_body_for(path, exc)
    return JSONResponse(body, status_code=status, headers=headers)
