"""The Messages API (docs/messages-api.md): ``POST /v1/messages`` through the route skeleton (``door.serve``) with
its parser (``input``) and its encoder (``output``), and ``POST /v1/messages/count_tokens``: the prompt
``/v1/messages`` would submit for the same body, tokenized as it would be. Errors on these routes are Anthropic's
error objects (app.py's wrapper: ``errors.anthropic_error_response``).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ... import events
from ...images import MM_KWARGS, read_images, request_reader
from ..body import off_loop, read_json
from ..call import Call
from ..choices import Choices
from ..door import Answer, Api, serve
from ..gate import Gate
from .input import count_request, messages_request
from .output import MessageOutput, stream


class Messages(Api[Call]):
    def parser(self, gate: Gate, owner: str | None, body):
        return lambda body, defaults, info: messages_request(body, defaults, info.max_model_len)

    def call(self, parsed: Call) -> Call:
        return parsed

    def answer(self, parsed: Call, feeds: Choices, model: str, gate: Gate, owner: str | None) -> Answer:
        feed = feeds.feeds[0]
        return _Answer(feed, MessageOutput(model, feed.request_id, feed.seed, feed.stream.request.prompt_len))


class _Answer(Answer):
    def __init__(self, feed: events.Events, out: MessageOutput):
        self.feed, self.out = feed, out

    def add(self, index: int, event: events.Event) -> None:
        self.out.add(event)

    def body(self) -> dict:
        return self.out.body()

    def stream(self) -> AsyncGenerator[bytes, None]:
        return stream(self.feed, self.out)


MESSAGES = Messages()


async def create(gate: Gate, request: Request) -> Response:
    return await serve(gate, request, MESSAGES)


async def count_tokens(gate: Gate, request: Request) -> Response:
    """``{"input_tokens": n}``: the prompt ``create`` would submit for the same body, tokenized as it would be."""
    gate.authorize(request)
    body = await read_json(request, gate.max_body_bytes)
    engine = gate.state.ready_engine()
    prompt, model = await off_loop(request, count_request, body, gate.state.info.max_model_len)
    gate.state.check_model(model)
    prompt = await read_images(prompt, request_reader(gate.state.images, body.get(MM_KWARGS)))
    return JSONResponse({"input_tokens": len(await engine.tokenize(prompt))})
