"""POST /v1/completions and /v1/chat/completions (docs/generation.md): the chat and completions API given to the
route skeleton (``door.serve``): its parser (``input``) and its encoder, one ``Output`` per choice answered as one
JSON body (``output.response``) or, with ``stream: true``, as server-sent events (``stream.body``). The seed in use
is returned in the ``X-Dgserve-Seed`` header and in the body's ``dgserve`` object.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncGenerator

from fastapi import Request
from fastapi.responses import Response

from ... import events
from ..call import Call
from ..choices import Choices
from ..door import Answer, Api, serve
from ..gate import Gate
from . import output, stream
from .input import chat_request, completion_request


class Completions(Api[Call]):
    """Chat completions (``chat``) or completions."""

    def __init__(self, chat: bool):
        self.chat = chat

    def parser(self, gate: Gate, owner: str | None, body):
        return functools.partial(_parse, chat=self.chat, trust_chat_template=gate.trust_chat_template)

    def call(self, parsed: Call) -> Call:
        return parsed

    def answer(self, parsed: Call, feeds: Choices, model: str, gate: Gate, owner: str | None) -> Answer:
        rid = feeds.feeds[0].request_id
        outs = [output.Output(rid, model, f.seed, self.chat, index=i) for i, f in enumerate(feeds.feeds)]
        return _Answer(feeds, outs, parsed.include_usage)


def _parse(body, defaults, info, chat: bool, trust_chat_template: bool) -> Call:
    if chat:
        return chat_request(body, defaults, info.max_model_len, trust_chat_template)
    return completion_request(body, defaults, info.vocab_size, info.max_model_len)


class _Answer(Answer):
    """Every choice's output (``outs``, in choice order)."""

    def __init__(self, feeds: Choices, outs: list[output.Output], include_usage: bool):
        self.feeds, self.outs, self.include_usage = feeds, outs, include_usage

    def add(self, index: int, event: events.Event) -> None:
        if isinstance(event, events.BlockEvent):
            self.outs[index].add_block(event)
        elif isinstance(event, events.FinishEvent):
            self.outs[index].finish(event)

    def body(self) -> dict:
        return output.response(self.outs)

    def stream(self) -> AsyncGenerator[bytes, None]:
        return stream.body(self.feeds, self.outs, self.include_usage)


CHAT, COMPLETIONS = Completions(chat=True), Completions(chat=False)


async def chat_completions(gate: Gate, request: Request) -> Response:
    return await serve(gate, request, CHAT)


async def completions(gate: Gate, request: Request) -> Response:
    return await serve(gate, request, COMPLETIONS)
