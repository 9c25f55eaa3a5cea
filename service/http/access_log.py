"""ASGI middleware: the request id (``X-Request-Id`` in and out), one access line and one counter sample per request.

A request's id: the ``X-Request-Id`` header when given (≤ 256 printable ASCII characters; anything else is a 400
naming the header), else a new one. It becomes the engine request id and the response ``id``, is echoed in
``X-Request-Id`` and logged on the access line. Probes and /metrics are counted but not logged.

The counter's ``route`` label is the route the request was for, by its path template (``/v1/messages``,
``/v1/models/{model_id}``, ``/playground/static/{name}``): the route the app matched, or for a request refused
before routing (the Host check, a bad request id) the route its path and method match; ``other`` for a path no
route has (a bounded set of labels whatever paths clients send).
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Sequence

from prometheus_client import Counter
from starlette.routing import BaseRoute, Match

from ..logs import request_id_var
from .errors import HttpError, error_response_for

log = logging.getLogger("dgserve.access")
MAX_REQUEST_ID = 256
OTHER = "other"  # the route label of a path no route has
_CONVERTOR = re.compile(r"\{(\w+):\w+\}")  # {model_id:path} → {model_id}


def _valid_request_id(value: str) -> bool:
    return 0 < len(value) <= MAX_REQUEST_ID and value.isascii() and value.isprintable()


class AccessLog:
    """The middleware (see the module docstring) around the app, counting into ``counter``."""

    def __init__(self, app, counter: Counter, routes: Sequence[BaseRoute] = ()):
        # routes: the app's (its router's list, filled as routes are added), for the route label
        self.app, self.counter, self.routes = app, counter, routes

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
                return await error_response_for(  # the route's own error shape (Anthropic's on the Messages routes)
                    scope["path"],
                    HttpError(
                        "INVALID_ARGUMENT",
                        f"X-Request-Id: must be 1 to {MAX_REQUEST_ID} printable ASCII characters",
                        param="X-Request-Id",
                    ),
                )(scope, receive, send_with_id)
            await self.app(scope, receive, send_with_id)
        finally:
            self._record(scope, status[0], time.perf_counter() - t0)

    def _record(self, scope, status: int, seconds: float) -> None:
        path = scope["path"]
        self.counter.labels(self._route(scope), str(status)).inc()
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

    def _route(self, scope) -> str:
        """The route label of a request (module doc)."""
        route = scope.get("route")  # set by the router when it matched (a method it lacks: a partial match)
        if route is None:
            partial = None
            for candidate in self.routes:
                match, _ = candidate.matches(scope)
                if match == Match.FULL:
                    route = candidate
                    break
                if match == Match.PARTIAL and partial is None:
                    partial = candidate
            route = route or partial
        path = getattr(route, "path", None)
        return _CONVERTOR.sub(r"{\1}", path) if isinstance(path, str) and path else OTHER
