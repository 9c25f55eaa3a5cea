"""ASGI middleware: the request id (``X-Request-Id`` in and out), one access line and one counter sample per request.

A request's id: the ``X-Request-Id`` header when given (≤ 256 printable ASCII characters; anything else is a 400
naming the header), else a new one. It becomes the engine request id and the response ``id``, is echoed in
``X-Request-Id`` and logged on the access line. Probes and /metrics are counted but not logged.
"""

from __future__ import annotations

import logging
import time
import uuid

from prometheus_client import Counter

from ..logs import request_id_var
from .errors import HttpError, error_response

log = logging.getLogger("dgserve.access")
MAX_REQUEST_ID = 256
ROUTES = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/v1/health/live",
    "/v1/health/ready",
    "/metrics",
    "/v1/metrics",
)


def _valid_request_id(value: str) -> bool:
    return 0 < len(value) <= MAX_REQUEST_ID and value.isascii() and value.isprintable()


class AccessLog:
    """The middleware (see the module docstring) around the app, counting into ``counter``."""

    def __init__(self, app, counter: Counter):
        self.app, self.counter = app, counter

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        rid = given if _valid_request_id(given) else f"dg-{uuid.uuid4().hex}"
        scope.setdefault("state", {})["request_id"] = rid
        request_id_var.set(rid)
        status = [500]

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())]}
            await send(message)

        try:
            if given and rid != given:
                return await error_response(
                    HttpError(
                        "INVALID_ARGUMENT",
                        f"X-Request-Id: must be 1 to {MAX_REQUEST_ID} printable ASCII characters",
                        param="X-Request-Id",
                    )
                )(scope, receive, send_with_id)
            await self.app(scope, receive, send_with_id)
        finally:
            self._record(scope, status[0], time.perf_counter() - t0)

    def _record(self, scope, status: int, seconds: float) -> None:
        path = scope["path"]
        self.counter.labels(_route(path), str(status)).inc()
        if path.startswith(("/v1/health/", "/metrics", "/v1/metrics")):
            return
        dt = seconds * 1e3
        client = scope.get("client") or ("", 0)
        log.info(
            "%s %s %d %.1f ms",
            scope["method"],
            path,
            status,
            dt,
            extra={
                "http_method": scope["method"],
                "path": path,
                "status": status,
                "duration_ms": round(dt, 3),
                "peer": f"{client[0]}:{client[1]}",
            },
        )


def _route(path: str) -> str:
    return path if path in ROUTES else "other"
