"""POST /v1/completions and /v1/chat/completions: check the body, submit it to the engine, answer from its events.

The request's events (``service.events``) are encoded as one JSON body (``responses.response``) or, with
``stream: true``, as server-sent events (``sse``). Either way the request is cancelled in the engine as soon as
the client disconnects, and counted in ``Gate.calls`` until its answer is over (the drain waits for it). The seed
in use is returned in the ``X-Dgserve-Seed`` header and in the body's ``dgserve`` object.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from .. import events
from . import protocol, responses, sse
from .body import read_json
from .gate import Gate


async def generate(gate: Gate, request: Request, chat: bool) -> Response:
    owner = gate.authorize(request)
    body = await read_json(request, gate.max_body_bytes)
    engine = gate.state.ready_engine()
    call = _parse(body, engine.default_params(), gate.state.info, chat, gate.trust_chat_template)
    gate.state.check_model(call.model)
    feed = await events.open_events(engine, call.submission(request.state.request_id, owner))
    out = responses.Output(feed.request_id, call.model or gate.state.names[0], feed.seed, chat)
    headers = {"X-Dgserve-Seed": str(out.seed)}
    gate.calls.enter()
    if call.stream:
        return sse.EventStream(sse.body(feed, out, call.include_usage), feed.cancel, gate.calls.leave, headers)
    try:
        return await _complete(request, feed, out, headers)
    finally:
        gate.calls.leave()


def _parse(body, defaults, info, chat: bool, trust_chat_template: bool) -> protocol.Call:
    if chat:
        return protocol.chat_request(body, defaults, info.max_model_len, trust_chat_template)
    return protocol.completion_request(body, defaults, info.vocab_size, info.max_model_len)


async def _complete(request: Request, feed: events.Events, out: responses.Output, headers: dict) -> Response:
    """The non-streaming answer: the whole output as one JSON body (499, unread, when the client went away)."""

    def add(event: events.Event) -> None:
        if isinstance(event, events.BlockEvent):
            out.add_block(event)
        elif isinstance(event, events.FinishEvent):
            out.finish(event)

    if not await read_all(request, feed, add):  # cancelled: the client went away, nobody reads this
        return Response(status_code=499)
    return JSONResponse(responses.response(out), headers=headers)


async def read_all(request: Request, feed: events.Events, add: Callable[[events.Event], object]) -> bool:
    """Read a request's events to the end into ``add``, cancelling it in the engine as soon as the client
    disconnects; True when it finished, False when it was cancelled. An ErrorEvent's error is raised (the route
    answers with its error body)."""
    watcher = asyncio.create_task(_cancel_on_disconnect(request, feed))
    finished = False
    try:
        async for event in feed:
            if isinstance(event, events.ErrorEvent):
                raise event.error
            finished = finished or isinstance(event, events.FinishEvent)
            add(event)
        return finished
    finally:
        watcher.cancel()
        feed.cancel("client_cancelled")


async def _cancel_on_disconnect(request: Request, feed: events.Events) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            feed.cancel("client_cancelled")
            return
