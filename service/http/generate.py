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
from ..images import MM_KWARGS, request_reader, with_images
from . import protocol, responses, sse
from .body import off_loop, read_json
from .choices import Choices, check_admissible
from .gate import Gate


async def generate(gate: Gate, request: Request, chat: bool) -> Response:
    owner = gate.authorize(request)
    body = await read_json(request, gate.max_body_bytes)
    engine = gate.state.ready_engine()
    call = await off_loop(
        request, _parse, body, engine.default_params(), gate.state.info, chat, gate.trust_chat_template
    )
    gate.state.check_model(call.model)
    check_admissible(engine, call.n)  # before the images' work (Choices.open checks again)
    call = await with_images(call, request_reader(gate.state.images, body.get(MM_KWARGS)))
    feeds = await Choices.open(engine, call.submissions(request.state.request_id, owner))
    rid, model = feeds.feeds[0].request_id, call.model or gate.state.names[0]
    outs = [responses.Output(rid, model, f.seed, chat, index=i) for i, f in enumerate(feeds.feeds)]
    headers = {"X-Dgserve-Seed": str(outs[0].seed)}
    gate.calls.enter()
    if call.stream:
        return sse.EventStream(sse.body(feeds, outs, call.include_usage), feeds.cancel, gate.calls.leave, headers)
    try:
        return await _complete(request, feeds, outs, headers)
    finally:
        gate.calls.leave()


def _parse(body, defaults, info, chat: bool, trust_chat_template: bool) -> protocol.Call:
    if chat:
        return protocol.chat_request(body, defaults, info.max_model_len, trust_chat_template)
    return protocol.completion_request(body, defaults, info.vocab_size, info.max_model_len)


async def _complete(request: Request, feeds: Choices, outs: list[responses.Output], headers: dict) -> Response:
    """The non-streaming answer: every choice's whole output as one JSON body (499, unread, when the client went
    away: every choice is cancelled)."""
    watcher = asyncio.create_task(_cancel_on_disconnect(request, feeds))
    try:
        async for i, event in feeds.events():
            if isinstance(event, events.ErrorEvent):
                raise event.error
            if isinstance(event, events.BlockEvent):
                outs[i].add_block(event)
            elif isinstance(event, events.FinishEvent):
                outs[i].finish(event)
    finally:
        watcher.cancel()
        feeds.cancel("client_cancelled")
    if any(o.finished is None for o in outs):  # cancelled: the client went away, nobody reads this
        return Response(status_code=499)
    return JSONResponse(responses.response(outs), headers=headers)


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


async def _cancel_on_disconnect(request: Request, feed: events.Events | Choices) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            feed.cancel("client_cancelled")
            return
