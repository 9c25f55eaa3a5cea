"""The FastAPI app: OpenAI-compatible routes, health probes and metrics. Each generating route is the one
skeleton (door.py) given its API's parser and encoder (openai/, responses/, messages/), over the shared
AsyncEngine; errors become OpenAI error JSON in one handler (errors.py).

    GET  /v1/health/live, /v1/health/ready   200 / 503 (NIM-style probes; no auth)
    GET  /metrics (also /v1/metrics)          Prometheus text (no auth)
    GET  /health                              200 / 503 as readiness (vLLM's route; no auth)
    GET  /version                             {"version": the dgserve version} (no auth)
    HEAD, GET /api/hello                      200, empty: Claude Code's preconnect probe (no auth)
    GET  /v1/models, /v1/models/{id}          the served name and aliases; one of them (404 for another)
    POST /tokenize, /detokenize               vLLM's shapes (openai/tokens.py)
    POST /v1/completions                      prompt: string or token ids; stream: SSE
    POST /v1/chat/completions                 messages through the checkpoint's chat template; stream: SSE
    POST /v1/responses                        the Responses API (responses/); stream: its event sequence
    GET, DELETE /v1/responses/{id}            a stored response of the caller
    POST /v1/messages                         the Messages API (messages/); stream: its event stream
    POST /v1/messages/count_tokens            the input tokens /v1/messages would submit
    GET  /, /playground, /dashboard           the built-in pages (playground.py; off with --no-playground)

Errors are OpenAI error JSON, except on the Messages routes: Anthropic's error objects there.

Every request first passes the Host and Origin checks (site.py: 400 / 403), and every POST route reads its body
only when its Content-Type is JSON (body.py: 415). A request's id is the ``X-Request-Id`` header when given, else
a new one (access_log.py); the seed in use is returned in ``X-Dgserve-Seed`` and in the body's ``dgserve``
object (door.py).
"""

from __future__ import annotations

import functools
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import Counter, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from dgserve import __version__

from .. import errors
from . import playground
from .access_log import AccessLog
from .errors import HttpError, anthropic_error_response, error_response, error_response_for
from .gate import Gate
from .messages import api as messages_api
from .openai import api as openai_api
from .openai import tokens
from .responses import api as responses_api
from .site import HostPolicy, OriginPolicy, SiteGuard

_HTTP_REASONS = {404: "NOT_FOUND", 405: "METHOD_NOT_ALLOWED", 413: "REQUEST_TOO_LARGE"}


def build_app(gate: Gate, hosts: HostPolicy, origins: OriginPolicy, pages: bool = True) -> FastAPI:
    """The app; ``hosts`` and ``origins`` say who may reach it from a browser (site.py), checked before any
    route runs and after the access log has the request's id (refusals are logged and counted). ``pages``: serve
    the playground and dashboard (playground.py)."""
    app = FastAPI(title="dgserve", docs_url=None, redoc_url=None, openapi_url=None)
    counter = Counter(
        "dgserve_http_requests",
        "Finished HTTP requests by route and status",
        ["route", "status"],
        registry=gate.metrics.registry,
    )
    app.add_middleware(SiteGuard, hosts=hosts, origins=origins)
    # (the last added is the outermost); the router's routes give the counter its route label
    app.add_middleware(AccessLog, counter=counter, routes=app.router.routes)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        reason = _HTTP_REASONS.get(exc.status_code, "INVALID_ARGUMENT")
        error = HttpError(reason, f"{request.method} {errors.clip(request.url.path)}: {exc.detail}")
        return error_response_for(request.url.path, error)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return error_response_for(request.url.path, HttpError("INVALID_ARGUMENT", f"body: {exc.errors()[:1]}"))

    @app.get("/v1/health/live")
    async def live():
        return _health(gate.live(), "live")

    @app.get("/v1/health/ready")
    @app.get("/health")
    async def ready():
        return _health(gate.ready(), "ready")

    @app.head("/api/hello")
    @app.get("/api/hello")
    async def hello():
        # Claude Code's preconnect probe (HEAD; it reads nothing of the answer): 200 rather than a logged 404
        # (docs/messages-api.md, "Claude Code")
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    @app.get("/v1/metrics")
    async def metrics():
        return Response(generate_latest(gate.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    @_openai_errors
    async def models(request: Request):
        gate.authorize(request)
        gate.state.ready_engine()
        return _model_list(gate)

    @app.get("/v1/models/{model_id:path}")
    @_openai_errors
    async def model(request: Request):
        gate.authorize(request)
        gate.state.ready_engine()
        name = request.path_params["model_id"]
        gate.state.check_model(name)  # 404 naming the served ones
        found = [m for m in _model_list(gate)["data"] if m["id"] == name]
        if not found:
            raise ValueError("model: give a model id, e.g. GET /v1/models/" + gate.state.names[0])
        return found[0]

    for method, path, handler, shape in _api_routes():
        app.add_api_route(path, shape(_bound(gate, handler)), methods=[method])

    if pages:
        playground.add_routes(app, gate, _openai_errors)
    return app


# ---------------------------------------------------------------------------------------------- helpers


def _api_routes():
    """(method, path, handler, error shape) of every API route, in the order they are matched."""
    return (
        ("POST", "/tokenize", tokens.tokenize, _openai_errors),
        ("POST", "/detokenize", tokens.detokenize, _openai_errors),
        ("POST", "/v1/completions", openai_api.completions, _openai_errors),
        ("POST", "/v1/chat/completions", openai_api.chat_completions, _openai_errors),
        ("POST", "/v1/responses", responses_api.create, _openai_errors),
        ("GET", "/v1/responses/{response_id}", responses_api.get, _openai_errors),
        ("DELETE", "/v1/responses/{response_id}", responses_api.delete, _openai_errors),
        ("POST", "/v1/messages", messages_api.create, _anthropic_errors),
        ("POST", "/v1/messages/count_tokens", messages_api.count_tokens, _anthropic_errors),
    )


def _bound(gate: Gate, handler):
    """The route of ``handler(gate, request)``."""

    async def route(request: Request):
        return await handler(gate, request)

    route.__name__ = handler.__name__
    return route


def _errors(respond):
    """A wrapper of routes whose domain exceptions become ``respond(e)``: the API's error JSON (never a traceback
    to the client or the log; 500s are logged in error_body)."""

    def wrap(route):
        @functools.wraps(route)
        async def wrapper(request: Request):
            try:
                return await route(request)
            except Exception as e:  # noqa: BLE001 - every error gets its API's body
                return respond(e)

        return wrapper

    return wrap


_openai_errors = _errors(error_response)  # OpenAI's error JSON
_anthropic_errors = _errors(anthropic_error_response)  # Anthropic's error objects (the Messages routes)


def _model_list(gate: Gate) -> dict:
    info, now = gate.state.info, int(time.time())
    return {
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "model",
                "created": now,
                "owned_by": "dgserve",
                "root": gate.state.root or info.model,
                "max_model_len": info.max_model_len,
            }
            for name in gate.state.names
        ],
    }


def _health(ok: bool, what: str) -> JSONResponse:
    body = {
        "object": "health.response",
        "status": what if ok else f"not {what}",
        "message": f"service is {what}" if ok else f"service is not {what}",
    }
    return JSONResponse(body, status_code=200 if ok else 503)
