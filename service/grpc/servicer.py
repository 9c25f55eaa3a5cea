"""TextGeneration servicer: one short method per RPC — check state, convert, call the engine, convert back.

Errors are raised as domain exceptions and mapped to status codes by the call interceptor (service/grpc/errors.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from dgserve.engine.async_engine import ABORT_CANCELLED, AsyncEngine
from dgserve.v1 import text_generation_pb2 as pb
from dgserve.v1 import text_generation_pb2_grpc as pb_grpc

from .. import events
from ..body_thread import in_body_thread
from ..errors import (
    DeadlineExceededError,
    DrainingError,
    ModelNotFoundError,
    NotReadyError,
    RequestNotFoundError,
    clip,
)
from ..events import ErrorEvent, FinishEvent
from ..images import ImageReader, read_images, with_images
from ..in_flight import InFlight
from . import convert
from .interceptors import CallInfo, current_call

T = TypeVar("T")
INLINE_CHAT_MESSAGES = 256  # a chat of more messages is converted off the event loop (``_off_loop``)


@dataclass
class ServingState:
    """What the servicer serves; filled in by the server once the model is loaded and warmed up."""

    names: tuple[str, ...] = ()  # served name, then aliases
    root: str = ""  # what --model named: the Hub id or the directory (/v1/models "root")
    engine: AsyncEngine | None = None
    info: pb.GetModelInfoResponse | None = None
    draining: bool = False
    loading_error: str | None = field(default=None)
    images: ImageReader | None = None  # how image parts are read for the served model (service/images.py)
    streams: InFlight = field(default_factory=InFlight)  # Generate calls (the drain waits for their last event)

    def ready_engine(self) -> AsyncEngine:
        if self.draining:
            raise DrainingError("server is draining for shutdown: retry on another instance")
        if self.engine is None:
            raise NotReadyError(f"not ready: {self.loading_error or 'model is loading'}")
        return self.engine

    def ready_info(self) -> pb.GetModelInfoResponse:
        """The served model's description (set just before the engine, so present once ready_engine() passes)."""
        if self.info is None:
            raise NotReadyError(f"not ready: {self.loading_error or 'model is loading'}")
        return self.info

    def check_model(self, name: str) -> None:
        if name and name not in self.names:
            raise ModelNotFoundError(f"model: {clip(name)!r} is not served here (served: {', '.join(self.names)})")


class TextGenerationServicer(pb_grpc.TextGenerationServicer):
    def __init__(self, state: ServingState):
        self.state = state

    async def Generate(self, request: pb.GenerateRequest, context):
        engine = self.state.ready_engine()
        self.state.check_model(request.model)
        info = self.state.ready_info()
        call = _call(context)
        # the id the access log has: the client's, else the one assigned at entry
        request_id = request.request_id or (call.request_id if call.assigned else None)
        sub = await _off_loop(
            request, convert.submission, request, info, engine.default_params(), call.owner, request_id
        )
        sub = await with_images(sub, _reader(self.state.images, request))
        feed = await events.open_events(engine, sub, timeout_s=call.engine_timeout())
        self.state.streams.enter()
        try:
            async for event in feed:
                if isinstance(event, ErrorEvent):
                    raise event.error  # the call interceptor maps it to a status
                if isinstance(event, FinishEvent) and call.past_deadline():
                    # ended after the deadline (grpc's own cancel did not reach it first): still the deadline's answer
                    raise DeadlineExceededError("the call's deadline passed before the request ended")
                yield convert.response(feed.request_id, event)
        finally:  # the call may be over here: use what was read at its start, never the context
            feed.cancel("deadline" if call.expired() else "client_cancelled")
            self.state.streams.leave()

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        outcome = self.state.ready_engine().abort(request.request_id, owner=_call(context).owner, reason="abort_rpc")
        if outcome is None:  # unknown, or another caller's: the same answer, so ids cannot be probed
            raise RequestNotFoundError(f"request_id: {request.request_id!r} is not known to this server")
        return pb.AbortResponse(
            outcome=pb.ABORT_OUTCOME_CANCELLED if outcome == ABORT_CANCELLED else pb.ABORT_OUTCOME_ALREADY_FINISHED
        )

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        engine = self.state.ready_engine()
        self.state.check_model(request.model)
        info = self.state.ready_info()
        prompt = await _off_loop(request, convert.prompt, request, info.vocab_size, info.max_model_len)
        prompt = await read_images(prompt, _reader(self.state.images, request))
        # at most max_model_len ids: a longer prompt could never be used, and is rejected with bounded work
        ids = await engine.tokenize(prompt)
        return pb.TokenizeResponse(token_ids=ids, max_model_len=engine.max_model_len)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context) -> pb.GetModelInfoResponse:
        self.state.ready_engine()
        return self.state.ready_info()


async def _off_loop(request: pb.GenerateRequest | pb.TokenizeRequest, convert_fn: Callable[..., T], *args) -> T:
    """``convert_fn(*args)``: the request's conversion, in the body thread (service/body_thread.py) for a chat of
    more than INLINE_CHAT_MESSAGES messages (its cost is per message: a 16 MB chat of 2,000 takes ~25 ms), on the
    event loop otherwise (less than a thread hop). grpc has parsed the message on the loop already (~10 ms for
    16 MB)."""
    if request.WhichOneof("input") == "chat" and len(request.chat.messages) > INLINE_CHAT_MESSAGES:
        return await in_body_thread(convert_fn, *args)
    return convert_fn(*args)


def _reader(reader: ImageReader | None, request) -> ImageReader | None:
    """The image reader of a Generate or Tokenize request: its ``chat.max_soft_tokens`` applied (docs/images.md,
    "Per request")."""
    if reader is None or request.WhichOneof("input") != "chat" or not request.chat.HasField("max_soft_tokens"):
        return reader
    return reader.with_soft_tokens(request.chat.max_soft_tokens, "chat.max_soft_tokens")


def _call(context) -> CallInfo:
    """The call's CallInfo (set by the call interceptor); built from the live context when there is none
    (a servicer used without the interceptor, as in unit tests)."""
    call = current_call()
    if call is None:
        remaining = context.time_remaining()
        call = CallInfo("", "", None, None if remaining is None else time.monotonic() + remaining, 0.0)
    return call
