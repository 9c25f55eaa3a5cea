"""The one route skeleton every generating HTTP API shares (``serve``): each API supplies its parser and its
encoder (an ``Api``), and its route handler is a line.

A request is authorized, its JSON body read (``body.read_json``), the engine checked ready, the body parsed off the
event loop (``body.off_loop``), the model checked, its images read (``images.with_images``), its choices opened
together in the engine (``choices.Choices``: one for every API but chat and completions' ``n``), the seed in use
sent in the ``X-Dgserve-Seed`` header, and the answer counted in ``Gate.calls`` until it is over (the drain waits
for it): a stream (``sse.EventStream``) or the whole output read into one JSON body. Either way the request is
cancelled in the engine as soon as the client disconnects; a body nobody reads any more is a 499.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator, Callable
from typing import Any, Generic, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from dgserve.sampling_params import SamplingParams

from .. import events
from ..images import MM_KWARGS, request_reader, with_images
from . import sse
from .body import off_loop, read_json
from .call import Call
from .choices import Choices, check_admissible
from .gate import Gate

P = TypeVar("P")  # what an API's parser returns (a Call, or a Call with what that API keeps besides)


class Answer:
    """What an API answers one request with, from the events of its choices: ``add`` each (non-streaming) and
    then ``body``, or ``stream`` them all."""

    def add(self, index: int, event: events.Event) -> None:
        """Takes choice ``index``'s next event (the whole output is read before ``body``)."""
        raise NotImplementedError

    def body(self) -> dict:
        """The finished answer as one JSON body."""
        raise NotImplementedError

    def stream(self) -> AsyncGenerator[bytes, None]:
        """The answer as server-sent events, read from the choices' events as they come."""
        raise NotImplementedError


class Api(Generic[P]):
    """What one API supplies to ``serve``: its parser (``parser``, ``call``) and its encoder (``answer``)."""

    def parser(self, gate: Gate, owner: str | None, body) -> Callable[[Any, SamplingParams, Any], P]:
        """The body's parser ``(body, the model's default params, the served model's info) → P``, run off the
        event loop; what it needs of the server's state is read here, on the loop."""
        raise NotImplementedError

    def call(self, parsed: P) -> Call:
        """The ``Call`` (the engine's submission and the door's options) of a parsed request."""
        raise NotImplementedError

    def answer(self, parsed: P, feeds: Choices, model: str, gate: Gate, owner: str | None) -> Answer:
        """The encoder of one request's answer (``model``: the name it answers with)."""
        raise NotImplementedError


async def serve(gate: Gate, request: Request, api: Api[P]) -> Response:
    """Answer one request of ``api`` (module doc)."""
    owner = gate.authorize(request)
    body = await read_json(request, gate.max_body_bytes)
    engine = gate.state.ready_engine()
    parse = api.parser(gate, owner, body)
    parsed = await off_loop(request, parse, body, engine.default_params(), gate.state.info)
    call = api.call(parsed)
    gate.state.check_model(call.model)
    check_admissible(engine, call.n)  # before the images' work (Choices.open checks again)
    sub = await with_images(call.submission, request_reader(gate.state.images, body.get(MM_KWARGS)))
    call = dataclasses.replace(call, submission=sub)
    feeds = await Choices.open(engine, call.submissions(request.state.request_id, owner))
    answer = api.answer(parsed, feeds, call.model or gate.state.names[0], gate, owner)
    headers = {"X-Dgserve-Seed": str(feeds.feeds[0].seed)}
    gate.calls.enter()
    if call.stream:
        return sse.EventStream(answer.stream(), feeds.cancel, gate.calls.leave, headers)
    try:
        if not await read_all(request, feeds, answer.add):
            return Response(status_code=499)  # the client went away: nobody reads this
        return JSONResponse(answer.body(), headers=headers)
    finally:
        gate.calls.leave()


async def read_all(request: Request, feeds: Choices, add: Callable[[int, events.Event], object]) -> bool:
    """Read every choice's events to the end into ``add``, cancelling them in the engine as soon as the client
    disconnects; True when every choice finished, False when one was cancelled. An ErrorEvent's error is raised
    (the route answers with its error body)."""
    watcher = asyncio.create_task(_cancel_on_disconnect(request, feeds))
    finished = 0
    try:
        async for i, event in feeds.events():
            if isinstance(event, events.ErrorEvent):
                raise event.error
            finished += isinstance(event, events.FinishEvent)
            add(i, event)
        return finished == len(feeds.feeds)
    finally:
        watcher.cancel()
        feeds.cancel("client_cancelled")


async def _cancel_on_disconnect(request: Request, feeds: Choices) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            feeds.cancel("client_cancelled")
            return
