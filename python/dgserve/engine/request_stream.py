"""What an asyncio caller reads of one request (docs/architecture.md, "The life of a request", step 4): its events
(``Started``, ``Draft`` previews, the engine's ``BlockOutput`` per committed canvas, ``Finished`` last) in a
``RequestStream``, and the ``EngineObserver`` hooks the metrics read them through. ``AsyncEngine``
(dgserve.engine.async_engine) feeds the streams on the event loop; everything here lives on the loop.

Slow readers: committed blocks are buffered without limit and never dropped; drafts are latest-wins (an unread
draft is replaced, and dropped once its block commits). A reader that takes nothing for the async engine's
``stall_timeout_s`` while blocks wait is aborted, and its stream raises ``StreamStalledError`` after the buffered
events.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dgserve.engine.request import DraftSpec, Request
from dgserve.engine.step_output import DraftOutput, draft
from dgserve.outputs import FINISH_STOP, BlockOutput
from dgserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from dgserve.text.tokenizer import Tokenizer


class StreamStalledError(Exception):
    """The reader took nothing for too long while committed blocks waited; the request was aborted."""


@dataclass(frozen=True)
class Started:
    request_id: str
    seed: int
    prompt_tokens: int
    params: SamplingParams
    queue_seconds: float


@dataclass(frozen=True)
class Draft:
    output: DraftOutput
    text: str = ""

    @classmethod
    def of(cls, req: Request, spec: DraftSpec, tokenizer: Tokenizer | None) -> Draft | None:
        """The preview ``spec`` asks for of ``req``'s block after its latest denoising step (``step_output.draft``;
        with its text when ``include_text`` and there is a tokenizer), or None (between blocks, or not a step of
        every ``every_n_steps``). Call from the thread that runs the engine's step."""
        d = draft(req)
        if d is None or d.step % max(1, spec.every_n_steps):
            return None
        text = tokenizer.decode(d.token_ids) if spec.include_text and tokenizer is not None else ""
        return cls(d, text)


@dataclass(frozen=True)
class Finished:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    blocks: int
    denoising_steps: int
    queue_seconds: float
    first_block_seconds: float  # NaN when no block was committed
    total_seconds: float
    cached_tokens: int = 0  # of prompt_tokens, those the prefix cache supplied
    stop_sequence: str | None = None  # the stop string that ended the output (finish_reason "stop")

    @classmethod
    def of(cls, req: Request, reason: str, completion: int, blocks: int, steps: int) -> Finished:
        """``req``'s last event, now: its usage (``completion`` tokens in ``blocks`` blocks of ``steps`` denoising
        steps in all) and its times since arrival."""
        now = time.monotonic()
        admitted = req.admitted_at if req.admitted_at is not None else now
        first = req.first_block_at - req.arrival if req.first_block_at is not None else float("nan")
        return cls(
            reason,
            req.prompt_len,
            completion,
            blocks,
            steps,
            admitted - req.arrival,
            first,
            now - req.arrival,
            req.cached_tokens,
            req.tracker.stop_sequence if reason == FINISH_STOP else None,
        )


class EngineObserver:
    """Hooks for metrics; every method runs on the event loop and must be cheap."""

    def on_started(self, queue_seconds: float) -> None: ...
    def on_prefix_cache(self, queried_tokens: int, hit_tokens: int) -> None: ...
    def on_block(self, block: BlockOutput, first: bool, seconds_since_arrival: float) -> None: ...
    def on_finished(self, finished: Finished) -> None: ...
    def on_abort(self, reason: str) -> None: ...
    def on_draft_dropped(self) -> None: ...
    def on_step(self, seconds: float) -> None: ...


class RequestStream:
    """The event queue of one request, in order (async iterator); everything else about the request is on its
    ``Request`` (``request``). Lives on the event loop."""

    def __init__(self, request: Request, cancelled: Callable[[Request, str], None]):
        """``cancelled(request, reason)``: the owner's abort of the request (``AsyncEngine``), without notifying."""
        self.request = request
        self._cancelled = cancelled
        self._events: deque = deque()
        self._draft: Draft | None = None
        self._wake = asyncio.Event()
        self._error: Exception | None = None
        self.done = False  # the last event (Finished or an error) has been pushed
        self.last_read = time.monotonic()
        self.reading = False  # the reader is awaiting the next event (so it is not stalled)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def params(self) -> SamplingParams:
        """The request's params, with the seed in use."""
        return self.request.params

    def __aiter__(self):
        return self

    async def __anext__(self):
        while True:
            if self._events:
                self.last_read = time.monotonic()
                return self._events.popleft()
            if self._draft is not None:
                draft, self._draft = self._draft, None
                return draft
            if self.done:
                if self._error is not None:
                    raise self._error
                raise StopAsyncIteration
            self._wake.clear()
            self.reading = True
            try:
                await self._wake.wait()
            finally:
                self.reading = False
                self.last_read = time.monotonic()

    @property
    def buffered(self) -> int:
        return len(self._events)

    def cancel(self, reason: str = "client_cancelled") -> None:
        """Stop the request (client went away): frees its slot before the next step; no more events."""
        if not self.done:
            self._cancelled(self.request, reason)
            self.done = True
            self._wake.set()

    # ---------------------------------------------------------------- fed by AsyncEngine on the loop

    def _push(self, event) -> None:
        if self.done:
            return
        self._events.append(event)
        if isinstance(event, BlockOutput):
            self._draft = None  # a preview of a block that is now committed
        if isinstance(event, Finished):
            self.done = True
        self._wake.set()

    def _push_draft(self, draft: Draft) -> bool:
        """Latest-wins; returns True when an unread draft was replaced (dropped)."""
        if self.done:
            return False
        dropped = self._draft is not None
        self._draft = draft
        self._wake.set()
        return dropped

    def _fail(self, error: Exception) -> None:
        if not self.done:
            self._error, self.done = error, True
            self._wake.set()
