"""The FastAPI app: OpenAI-compatible routes, health probes and metrics. Routes only translate (protocol.py) and
call the shared AsyncEngine; errors become OpenAI error JSON in one handler (errors.py).

    GET  /v1/health/live, /v1/health/ready   200 / 503 (NIM-style probes; no auth)
    GET  /metrics (also /v1/metrics)          Prometheus text (no auth)
    GET  /v1/models                           the served name and aliases
    POST /v1/completions                      prompt: string or token ids; stream: SSE
    POST /v1/chat/completions                 messages through the checkpoint's chat template; stream: SSE

A request's id: the ``X-Request-Id`` header when given (≤ 256 printable ASCII characters), else a new one; it is
the engine request id, the response ``id``, echoed in ``X-Request-Id`` and logged on the access line. The seed
used is returned in ``X-Dgserve-Seed`` and in the body's ``dgserve`` object.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import Counter, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from dgserve.engine.async_engine import Draft, Finished, Started
from dgserve.outputs import BlockOutput

from .. import errors
from ..in_flight import InFlight
from ..logs import request_id_var
from . import protocol
from .errors import HttpError, error_body

log = logging.getLogger("dgserve.access")
MAX_REQUEST_ID = 256
INLINE_BODY_BYTES = 64 << 10  # decoded on the event loop: at most ~1 ms of json.loads, less than a thread hop
_HTTP_REASONS = {404: "NOT_FOUND", 405: "METHOD_NOT_ALLOWED", 413: "REQUEST_TOO_LARGE"}


class Gate:
    """What the routes need from the server: its serving state, auth and limits (all owned by Server)."""

    def __init__(
        self, state, metrics, *, live: Callable[[], bool], owner: Callable[[str], str] | None, max_body_bytes: int
    ):
        # owner: the caller's identity from its Authorization header (errors.UnauthenticatedError when the token
        # is not accepted); None when auth is off. The same BearerAuth.owner the gRPC door uses, so a request
        # started over HTTP can be aborted over gRPC only with the same token.
        self.state, self.metrics, self.live, self.owner = state, metrics, live, owner
        self.max_body_bytes = max_body_bytes
        self.calls = InFlight()  # generation requests not yet finished (the drain waits for them)

    def ready(self) -> bool:
        return self.live() and self.state.engine is not None and not self.state.draining


def build_app(gate: Gate) -> FastAPI:
    app = FastAPI(title="dgserve", docs_url=None, redoc_url=None, openapi_url=None)
    counter = Counter(
        "dgserve_http_requests",
        "Finished HTTP requests by route and status",
        ["route", "status"],
        registry=gate.metrics.registry,
    )
    app.add_middleware(AccessLog, counter=counter)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        reason = _HTTP_REASONS.get(exc.status_code, "INVALID_ARGUMENT")
        return error_response(HttpError(reason, f"{request.method} {errors.clip(request.url.path)}: {exc.detail}"))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return error_response(HttpError("INVALID_ARGUMENT", f"body: {exc.errors()[:1]}"))

    @app.get("/v1/health/live")
    async def live():
        return _health(gate.live(), "live")

    @app.get("/v1/health/ready")
    async def ready():
        return _health(gate.ready(), "ready")

    @app.get("/metrics")
    @app.get("/v1/metrics")
    async def metrics():
        return Response(generate_latest(gate.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    @_openai_errors
    async def models(request: Request):
        _authorize(gate, request)
        gate.state.ready_engine()
        info, now = gate.state.info, int(time.time())
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": now,
                    "owned_by": "dgserve",
                    "root": info.model,
                    "max_model_len": info.max_model_len,
                }
                for name in gate.state.names
            ],
        }

    @app.post("/v1/completions")
    @_openai_errors
    async def completions(request: Request):
        return await _generate(gate, request, chat=False)

    @app.post("/v1/chat/completions")
    @_openai_errors
    async def chat_completions(request: Request):
        return await _generate(gate, request, chat=True)

    return app


# ---------------------------------------------------------------------------------------------- generation


async def _generate(gate: Gate, request: Request, chat: bool):
    owner = _authorize(gate, request)
    body = await _read_json(request, gate.max_body_bytes)
    engine = gate.state.ready_engine()
    defaults = engine.default_params()
    info = gate.state.info
    call = (
        protocol.chat_request(body, defaults, info.max_model_len)
        if chat
        else protocol.completion_request(body, defaults, info.vocab_size, info.max_model_len)
    )
    gate.state.check_model(call.model)
    rid = request.state.request_id
    stream = await engine.submit(call.prompt, call.params, rid, drafts=call.drafts, owner=owner)
    out = protocol.Output(stream.request_id, call.model or gate.state.names[0], stream.params.seed, chat)
    headers = {"X-Dgserve-Seed": str(out.seed)}
    gate.calls.enter()
    if call.stream:
        return EventStream(_events(stream, out, call), stream.cancel, gate.calls.leave, headers)
    watcher = asyncio.create_task(_cancel_on_disconnect(request, stream))
    try:
        async for event in stream:
            if isinstance(event, BlockOutput):
                out.add_block(event)
            elif isinstance(event, Finished):
                out.finished = event
        if out.finished is None:  # cancelled: the client went away, nobody reads this
            return Response(status_code=499)
        return JSONResponse(protocol.response(out), headers=headers)
    finally:
        watcher.cancel()
        stream.cancel("client_cancelled")
        gate.calls.leave()


async def _events(stream, out: protocol.Output, call: protocol.Call) -> AsyncGenerator[bytes, None]:
    """The SSE body: role opener (chat), one chunk per committed block, drafts as ``event: dgserve.draft`` chunks
    with no choices (no text for an OpenAI client), the finishing chunk with the ``dgserve`` extension, usage,
    ``[DONE]``."""
    if out.chat:
        yield protocol.sse(protocol.chunk(out, role=True))
    try:
        async for event in stream:
            if isinstance(event, BlockOutput):
                stats = out.add_block(event)
                yield protocol.sse(protocol.chunk(out, event.text, extra={"block": stats}))
            elif isinstance(event, Draft):
                yield protocol.sse(
                    protocol.chunk(out, no_choices=True, extra={"draft": protocol.draft_event(event)}),
                    event="dgserve.draft",
                )
            elif isinstance(event, Finished):
                out.finished = event
                reason = protocol.FINISH_REASONS.get(event.finish_reason, event.finish_reason)
                yield protocol.sse(protocol.chunk(out, finish=reason, extra=protocol.extension(out)))
                if call.include_usage:
                    yield protocol.sse(protocol.chunk(out, no_choices=True, usage_=protocol.usage(event)))
            elif not isinstance(event, Started):
                raise TypeError(f"unknown event {type(event).__name__}")
    except Exception as e:  # noqa: BLE001 - after the headers, an error can only travel as an SSE event
        yield protocol.sse(error_body(e)[1])
    yield protocol.sse("[DONE]")


async def _cancel_on_disconnect(request: Request, stream) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            stream.cancel("client_cancelled")
            return


class EventStream(StreamingResponse):
    """``text/event-stream`` whose request is cancelled in the engine as soon as the client disconnects (not only
    when the next write fails), so the slot is free before the engine's next step, as a gRPC cancel frees it."""

    media_type = "text/event-stream"

    def __init__(
        self,
        body: AsyncGenerator[bytes, None],
        cancel: Callable[[str], None],
        done: Callable[[], None],
        headers: dict[str, str],
    ):
        super().__init__(body, headers={"Cache-Control": "no-cache", **headers}, media_type=self.media_type)
        self.cancel, self.done = cancel, done
        self._body = body  # the body_iterator, kept with its type: an async generator, closed in __call__

    async def __call__(self, scope, receive, send) -> None:
        async def watch():
            while (await receive())["type"] != "http.disconnect":
                pass
            self.cancel("client_cancelled")

        watcher = asyncio.create_task(watch())
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for data in self.body_iterator:
                await send({"type": "http.response.body", "body": data, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client went away between two writes
            self.cancel("client_cancelled")
        finally:
            watcher.cancel()
            self.cancel("client_cancelled")
            await self._body.aclose()
            self.done()


# ---------------------------------------------------------------------------------------------- helpers


def _openai_errors(route):
    """Domain exceptions raised by a route → OpenAI error JSON (never a traceback to the client or the log)."""

    @functools.wraps(route)
    async def wrapper(request: Request):
        try:
            return await route(request)
        except Exception as e:  # noqa: BLE001 - every error gets its OpenAI body; 500s are logged in error_body
            return error_response(e)

    return wrapper


def error_response(exc: BaseException) -> JSONResponse:
    status, body, headers = error_body(exc)
    return JSONResponse(body, status_code=status, headers=headers)


def _authorize(gate: Gate, request: Request) -> str | None:
    """The caller's identity (None when auth is off); HttpError UNAUTHENTICATED without an accepted token."""
    if gate.owner is None:
        return None
    try:
        return gate.owner(request.headers.get("authorization", ""))
    except errors.UnauthenticatedError:
        raise HttpError(
            "UNAUTHENTICATED", "missing or invalid bearer token (send 'Authorization: Bearer <token>')"
        ) from None


async def _read_json(request: Request, limit: int):
    """The request's JSON body (``protocol.decode_body``: bounded values and depth, valid Unicode). A body over
    INLINE_BODY_BYTES is decoded in the one body thread: json.loads holds the GIL while it runs, so decoding two
    16 MB bodies at once would only take turns at the GIL away from the event loop; one at a time, the loop gets
    it back between bodies."""
    raw = await _read_body(request, limit)
    if len(raw) <= INLINE_BODY_BYTES:
        return protocol.decode_body(raw)
    return await asyncio.get_running_loop().run_in_executor(_body_thread(), protocol.decode_body, raw)


@functools.cache
def _body_thread() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dgserve-body")


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HttpError("REQUEST_TOO_LARGE", f"body: {declared} bytes exceed the limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HttpError("REQUEST_TOO_LARGE", f"body: more than the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _health(ok: bool, what: str) -> JSONResponse:
    body = {
        "object": "health.response",
        "status": what if ok else f"not {what}",
        "message": f"service is {what}" if ok else f"service is not {what}",
    }
    return JSONResponse(body, status_code=200 if ok else 503)


def _valid_request_id(value: str) -> bool:
    return 0 < len(value) <= MAX_REQUEST_ID and value.isascii() and value.isprintable()


class AccessLog:
    """ASGI middleware: the request id (``X-Request-Id`` in and out), one access line and one counter sample per
    request (probes and /metrics are counted but not logged)."""

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
            path = scope["path"]
            self.counter.labels(_route(path), str(status[0])).inc()
            if not path.startswith(("/v1/health/", "/metrics", "/v1/metrics")):
                dt = (time.perf_counter() - t0) * 1e3
                client = scope.get("client") or ("", 0)
                log.info(
                    "%s %s %d %.1f ms",
                    scope["method"],
                    path,
                    status[0],
                    dt,
                    extra={
                        "http_method": scope["method"],
                        "path": path,
                        "status": status[0],
                        "duration_ms": round(dt, 3),
                        "peer": f"{client[0]}:{client[1]}",
                    },
                )


def _route(path: str) -> str:
    known = (
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/v1/health/live",
        "/v1/health/ready",
        "/metrics",
        "/v1/metrics",
    )
    return path if path in known else "other"
