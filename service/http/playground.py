"""The built-in web pages on the HTTP port (docs/playground.md): the playground, which draws a request's canvas as it
denoises, and the live dashboard over ``/metrics``. ``--no-playground`` leaves all of these routes out.

    GET  /                           307 to /playground
    GET  /playground, /dashboard     the pages (static HTML, no auth: they hold no data)
    GET  /playground/static/{name}   their scripts, styles and the vendored chart library (a fixed list)
    POST /playground/pieces          {"ids": [...]} → {"pieces": [...]}: each token id's own text, to label the
                                     canvas cells (authorized like every API route; JSON only)
    POST /playground/draft           {"text": str} → {"ids": [...], "pieces": [...]}: a draft's tokens exactly as
                                     the engine tokenizes an ``initial_canvas`` text (as content: no BOS, and
                                     special-token texts stay characters, which /tokenize does not do), so the
                                     page can show them as cells to pin (docs/edit-in-place.md)

The pages are files in the package (``static/``): no CDN, nothing from the network. Every page and asset answer
carries a Content-Security-Policy that allows only this origin (no inline script or style, no framing), so the
page can talk to nothing but this server; its API calls are same-origin ``fetch``es with ``Content-Type:
application/json`` and, with ``--auth-token-file``, ``Authorization: Bearer`` with the token the user typed, kept
in the tab's sessionStorage only. They pass the Host / Origin / Content-Type checks (site.py, body.py) as any
client's calls do: nothing here bypasses them or the auth check.
"""

from __future__ import annotations

import asyncio
import functools
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import RedirectResponse, Response

from dgserve.text.token_bounds import PromptTooLongError

from .. import events
from .body import read_json
from .gate import Gate

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
PAGES = {"/playground": "playground.html", "/dashboard": "dashboard.html"}
ASSETS = {  # file → media type: the only files served from static/
    "playground.js": "text/javascript; charset=utf-8",
    "draft.js": "text/javascript; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "common.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
    "uPlot.iife.min.js": "text/javascript; charset=utf-8",
    "uPlot.min.css": "text/css; charset=utf-8",
}
MAX_PIECES = 4096  # ids in one /playground/pieces call (the page asks only for ids it has not seen)


@functools.cache
def asset(name: str) -> bytes:
    """A file of the package's static/ folder (read once)."""
    return resources.files(__package__).joinpath("static").joinpath(name).read_bytes()


def add_routes(app: FastAPI, gate: Gate, api_errors) -> None:
    """Add the pages and their routes (module doc) to ``app``; ``api_errors`` wraps an API route so that its
    errors become OpenAI error JSON (app.py's wrapper)."""

    @app.get("/", include_in_schema=False)
    async def root():
        return RedirectResponse("/playground", status_code=307)

    for path, name in PAGES.items():
        app.add_api_route(path, _page(name), methods=["GET"], include_in_schema=False)

    @app.get("/playground/static/{name}", include_in_schema=False)
    async def static(name: str):
        if name not in ASSETS:
            return Response(f"no asset {name[:80]!r}\n", status_code=404, media_type="text/plain")
        return Response(asset(name), media_type=ASSETS[name], headers=HEADERS)

    @app.post("/playground/pieces", include_in_schema=False)
    @api_errors
    async def pieces(request: Request):
        return await token_pieces(gate, request)

    @app.post("/playground/draft", include_in_schema=False)
    @api_errors
    async def draft(request: Request):
        return await draft_tokens(gate, request)


def _page(name: str):
    async def page():
        return Response(asset(name), media_type="text/html; charset=utf-8", headers=HEADERS)

    return page


async def token_pieces(gate: Gate, request: Request) -> dict:
    """Each id's text (the tokenizer's decode of that id alone): ValueError naming ``ids`` unless the body is
    ``{"ids": [token ids]}`` with 1..MAX_PIECES ids in the vocabulary."""
    gate.authorize(request)
    body = await read_json(request, gate.max_body_bytes)
    engine = gate.state.ready_engine()
    if not isinstance(body, dict) or set(body) != {"ids"}:
        raise ValueError('ids: the body must be {"ids": [token ids]}')
    ids = body["ids"]
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError("ids: must be a list of token ids")
    if len(ids) > MAX_PIECES:
        raise ValueError(f"ids: at most {MAX_PIECES} ids, got {len(ids)}")
    ids = events.token_ids(ids, gate.state.info.vocab_size, "ids")
    tok = engine.tokenizer
    if tok is None:
        raise ValueError("ids: this model has no tokenizer")
    return {"pieces": await _pieces(tok, ids)}


async def draft_tokens(gate: Gate, request: Request) -> dict:
    """A draft text's token ids and each one's text, tokenized as ``initial_canvas.read_initial_canvas`` tokenizes an
    ``initial_canvas`` text (``Tokenizer.encode_content``): ValueError naming ``text`` unless the body is
    ``{"text": str}`` with a non-empty text of at most max_model_len tokens (a longer draft could never be used;
    refused with bounded work). Whether the draft fits a request's canvases is the generation route's check."""
    gate.authorize(request)
    body = await read_json(request, gate.max_body_bytes)
    engine = gate.state.ready_engine()
    if not isinstance(body, dict) or set(body) != {"text"} or not isinstance(body["text"], str):
        raise ValueError('text: the body must be {"text": the draft as a string}')
    tok = engine.tokenizer
    if tok is None:
        raise ValueError("text: this model has no tokenizer; send the draft as token ids")
    limit = gate.state.info.max_model_len
    try:
        ids = await asyncio.to_thread(tok.encode_content, body["text"], limit, "text")
    except PromptTooLongError as e:
        raise ValueError(f"text: at least {e.at_least} tokens, more than the context window of {limit}") from e
    if not ids:
        raise ValueError("text: the draft is empty")
    return {"ids": ids, "pieces": await _pieces(tok, ids)}


async def _pieces(tok, ids: list[int]) -> list[str]:
    """Each id's own text (the tokenizer's decode of that id alone), decoded off the event loop."""
    return await asyncio.to_thread(lambda: [tok.decode([t]) for t in ids])
