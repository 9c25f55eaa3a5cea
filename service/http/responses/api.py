"""The Responses API (docs/responses-api.md): ``POST /v1/responses`` through the route skeleton (``door.serve``)
with its parser (``input``) and its encoder (``output``); ``GET`` and ``DELETE /v1/responses/{id}`` read and drop
a stored response (``store``) of the caller.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ... import events
from ..call import Call
from ..choices import Choices
from ..door import Answer, Api, serve
from ..errors import HttpError
from ..gate import Gate
from .input import ResponsesCall, responses_request
from .output import ResponseOutput, stream
from .store import Stored

log = logging.getLogger("dgserve.http")


class Responses(Api[ResponsesCall]):
    def parser(self, gate: Gate, owner: str | None, body):
        # the store is the event loop's: the previous response is looked up here, and the body converted off it
        prior = _previous(gate, owner, body)
        return lambda body, defaults, info: responses_request(body, defaults, info.max_model_len, prior)

    def call(self, parsed: ResponsesCall) -> Call:
        if parsed.tools.left_out:  # once per request, on the loop (the request id's context); types only
            log.info("responses: hosted tools left out of the prompt: %s", ", ".join(parsed.tools.left_out))
        return parsed.call

    def answer(self, parsed: ResponsesCall, feeds: Choices, model: str, gate: Gate, owner: str | None) -> Answer:
        feed = feeds.feeds[0]
        return _Answer(feed, ResponseOutput(parsed, model, feed.request_id, feed.seed), gate, owner)


class _Answer(Answer):
    def __init__(self, feed: events.Events, out: ResponseOutput, gate: Gate, owner: str | None):
        self.feed, self.out, self.gate, self.owner = feed, out, gate, owner

    def add(self, index: int, event: events.Event) -> None:
        self.out.add(event)

    def body(self) -> dict:
        return self.out.finish(self.gate, self.owner)

    def stream(self) -> AsyncGenerator[bytes, None]:
        return stream(self.feed, self.out, self.gate, self.owner)


RESPONSES = Responses()


async def create(gate: Gate, request: Request) -> Response:
    return await serve(gate, request, RESPONSES)


async def get(gate: Gate, request: Request) -> Response:
    owner = gate.authorize(request)
    stored = gate.responses.get(owner, request.path_params["response_id"])
    if stored is None:
        raise _not_found(request.path_params["response_id"])
    return JSONResponse(stored.response)


async def delete(gate: Gate, request: Request) -> Response:
    owner = gate.authorize(request)
    rid = request.path_params["response_id"]
    if not gate.responses.delete(owner, rid):
        raise _not_found(rid)
    return JSONResponse({"id": rid, "object": "response", "deleted": True})


def _previous(gate: Gate, owner: str | None, body) -> Callable[[str], Stored | None]:
    """``responses_request``'s lookup of the previous response: the caller's stored response of the body's
    ``previous_response_id``, read from the store now (on the event loop, the store's one thread)."""
    rid = body.get("previous_response_id") if isinstance(body, dict) else None
    found = gate.responses.get(owner, rid) if isinstance(rid, str) and rid else None
    return lambda asked: found if asked == rid else None


def _not_found(rid: str) -> HttpError:
    # unknown, dropped and another caller's are the same answer: ids cannot be probed
    return HttpError("NOT_FOUND", f"response_id: {rid[:80]!r} is not a stored response of this caller")
