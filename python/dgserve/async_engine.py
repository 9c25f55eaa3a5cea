"""The engine for asyncio callers: the step loop on its own thread, one event stream per request.

``AsyncEngine.submit`` validates and admits a request at once (tokenization runs in a worker thread, never on
the event loop) and returns a ``RequestStream``: ``Started`` when the request leaves the queue, optional
``DraftOutput`` previews, one ``BlockOutput`` per committed canvas, ``Finished`` last. The engine thread hands
each step's events to the loop in one ``call_soon_threadsafe`` call.

Slow readers: committed blocks are buffered without limit and never dropped; drafts are latest-wins (an unread
draft is replaced, and dropped once its block commits). A reader that takes nothing for ``stall_timeout_s`` while
blocks wait is aborted, and its stream raises ``StreamStalledError`` after the buffered events.
Cancellation: ``RequestStream.cancel`` / ``AsyncEngine.abort`` free the slot before the engine's next step.
Ownership: a request submitted with an ``owner`` (the caller's identity, e.g. a digest of its token) can only be
aborted by the same owner; to anyone else it looks exactly like an id never seen.
An exception in the step loop fails every in-flight stream with ``EngineFaultError`` and stops the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dgserve.engine import DraftOutput, Engine, Prompt, check_request_id
from dgserve.outputs import FINISH_CANCELLED, BlockOutput
from dgserve.sampling_params import SamplingParams
from dgserve.scheduler import DuplicateRequestError

log = logging.getLogger("dgserve.engine")

# What the engine thread hands the loop after a step: ("step", None, seconds), ("started", stream, admit time),
# ("block", stream, (BlockOutput, GenerationResult | None)) or ("draft", stream, Draft).
_Event = tuple[str, "RequestStream | None", Any]

ABORT_CANCELLED, ABORT_ALREADY_FINISHED = "cancelled", "already_finished"


class EngineUnavailableError(Exception):
    """The engine is not running (not started, stopping, or stopped after a fault)."""


class EngineFaultError(Exception):
    """The step loop failed; in-flight requests cannot complete."""


class StreamStalledError(Exception):
    """The reader took nothing for too long while committed blocks waited; the request was aborted."""


@dataclass(frozen=True)
class DraftSpec:
    every_n_steps: int = 1
    include_text: bool = False


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


class EngineObserver:
    """Hooks for metrics; every method runs on the event loop and must be cheap."""

    def on_started(self, queue_seconds: float) -> None: ...
    def on_block(self, block: BlockOutput, first: bool, seconds_since_arrival: float) -> None: ...
    def on_finished(self, finished: Finished) -> None: ...
    def on_abort(self, reason: str) -> None: ...
    def on_draft_dropped(self) -> None: ...
    def on_step(self, seconds: float) -> None: ...


class RequestStream:
    """Events of one request, in order (async iterator). Lives on the event loop."""

    def __init__(
        self,
        engine: AsyncEngine,
        request_id: str,
        prompt_tokens: int,
        params: SamplingParams,
        drafts: DraftSpec | None,
        owner: str | None = None,
    ):
        self.request_id, self.prompt_tokens, self.params, self.drafts = request_id, prompt_tokens, params, drafts
        self.owner = owner
        self._engine = engine
        self._events: deque = deque()
        self._draft: Draft | None = None
        self._wake = asyncio.Event()
        self._error: Exception | None = None
        self.done = False  # the last event (Finished or an error) has been pushed
        self.arrival = time.monotonic()
        self.admitted_at: float | None = None
        self.first_block_at: float | None = None
        self.last_read = self.arrival
        self.reading = False  # the reader is awaiting the next event (so it is not stalled)

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
            self._engine._abort(self.request_id, reason, notify=False)
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


class AsyncEngine:
    """Owns an Engine and its step thread; safe to use from one asyncio event loop."""

    def __init__(
        self,
        engine: Engine,
        *,
        stall_timeout_s: float = 30.0,
        observer: EngineObserver | None = None,
        remember_finished: int = 10_000,
        on_fault: Callable[[Exception], None] | None = None,
    ):
        self.engine = engine
        self.on_fault = on_fault
        self.stall_timeout_s = stall_timeout_s
        self.observer = observer or EngineObserver()
        self.fault: Exception | None = None
        self._streams: dict[str, RequestStream] = {}
        self._finished_ids: OrderedDict[str, str | None] = OrderedDict()  # recently finished id -> owner
        self._remember = remember_finished
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---------------------------------------------------------------- lifecycle

    def warm_up(self) -> None:
        """Run one tiny generation (before start) so the first request does not pay for lazy initialisation."""
        cfg = self.engine.model.config
        prompt = [cfg.bos_token_id if cfg.bos_token_id is not None else 0]
        self.engine.generate(prompt, SamplingParams(max_new_tokens=1, max_denoising_steps=2, seed=0))

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="dgserve-engine", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping and self.fault is None

    async def stop(self) -> None:
        """Stop the step loop (in-flight streams are cancelled)."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        for stream in list(self._streams.values()):
            self._abort(stream.request_id, "shutdown")

    @property
    def num_running(self) -> int:
        return self.engine.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.engine.scheduler.num_waiting

    # ---------------------------------------------------------------- requests

    async def submit(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        timeout_s: float | None = None,
        drafts: DraftSpec | None = None,
        owner: str | None = None,
    ) -> RequestStream:
        """Validate and admit a request; raises ValueError (bad input), DuplicateRequestError, QueueFullError,
        NotImplementedError (unsupported chat part) or EngineUnavailableError. ``timeout_s``: a request still
        queued after this long is dropped without model work. ``owner``: who may abort it (see ``abort``)."""
        if request_id is not None:
            check_request_id(request_id)
        if not self.running:
            raise EngineUnavailableError(
                "the engine is not running" if self.fault is None else f"the engine stopped after a fault: {self.fault}"
            )
        params = params or self.engine.default_params()
        if params.seed is None:
            params = dataclasses.replace(params, seed=secrets.randbits(64))
        rid = request_id or f"dg-{uuid.uuid4().hex}"
        if isinstance(prompt, (list, tuple)):
            ids = self.engine.request_prompt_ids(prompt, params.max_new_tokens)
        else:
            ids = await asyncio.get_running_loop().run_in_executor(
                None, self.engine.request_prompt_ids, prompt, params.max_new_tokens
            )
        if params.response_format is not None:  # compile (or find cached) off the event loop; errors: ValueError
            await asyncio.get_running_loop().run_in_executor(None, self.engine.compile_response_format, params)
        stream = RequestStream(self, rid, len(ids), params, drafts, owner)
        with self._lock:
            if rid in self._streams:
                raise DuplicateRequestError(f"request_id: {rid!r} is already in flight")
            self._streams[rid] = stream
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            self.engine.add_request(ids, params, rid, deadline=deadline)
        except BaseException:
            with self._lock:
                self._streams.pop(rid, None)
            raise
        self._wake.set()
        return stream

    def abort(
        self, request_id: str, *, owner: str | None = None, reason: str = "abort", notify: bool = True
    ) -> str | None:
        """Cancel a request for the caller ``owner``: "cancelled" when it was queued or running, "already_finished"
        when it had finished recently, None when unknown — or when it belongs to another owner, so that ids of
        other callers can be neither stopped nor discovered. With ``notify`` its stream ends with
        Finished("cancelled"). ValueError for an id that is not 1 to 256 printable characters."""
        check_request_id(request_id)
        with self._lock:
            stream = self._streams.get(request_id)
            if stream is not None and stream.owner != owner:
                return None
        if stream is not None and self._abort(request_id, reason, notify) is not None:
            return ABORT_CANCELLED
        with self._lock:  # finished (possibly just now, between the two locked sections)
            known = request_id in self._finished_ids and self._finished_ids[request_id] == owner
        return ABORT_ALREADY_FINISHED if known else None

    def _abort(self, request_id: str, reason: str, notify: bool = False) -> str | None:
        """Cancel a request whoever owns it (client gone, stalled reader, shutdown, or a checked ``abort``)."""
        with self._lock:
            stream = self._streams.pop(request_id, None)
            if stream is None:
                return None
            self._remember_finished(request_id, stream.owner)
        self.engine.abort(request_id)
        self.engine.take_result(request_id)
        self.observer.on_abort(reason)
        if notify:
            stream._push(self._finished(stream, FINISH_CANCELLED, 0, 0, 0))
        return ABORT_CANCELLED

    def _remember_finished(self, request_id: str, owner: str | None) -> None:
        self._finished_ids[request_id] = owner
        while len(self._finished_ids) > self._remember:
            self._finished_ids.popitem(last=False)

    @staticmethod
    def _finished(stream: RequestStream, reason: str, completion: int, blocks: int, steps: int) -> Finished:
        now = time.monotonic()
        admitted = stream.admitted_at if stream.admitted_at is not None else now
        first = stream.first_block_at - stream.arrival if stream.first_block_at is not None else float("nan")
        return Finished(
            reason,
            stream.prompt_tokens,
            completion,
            blocks,
            steps,
            admitted - stream.arrival,
            first,
            now - stream.arrival,
        )

    # ---------------------------------------------------------------- engine thread

    def _run(self) -> None:
        loop = self._loop
        assert loop is not None, "start() sets the loop before the thread runs"
        while not self._stopping:
            if not self.engine.has_unfinished():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                batch = self._step()
            except Exception as e:
                log.exception("engine step failed")
                self.fault = e
                loop.call_soon_threadsafe(self._fail_all, e)
                return
            if batch:
                loop.call_soon_threadsafe(self._deliver, batch)

    def _step(self) -> list[_Event]:
        t0 = time.monotonic()
        events = self.engine.step()
        batch: list[_Event] = [("step", None, time.monotonic() - t0)]
        streams = self._streams
        batch.extend(("started", streams[rid], t0) for rid in self.engine.last_schedule.admitted if rid in streams)
        for rid, block in events:
            stream = streams.get(rid)
            if stream is None:
                continue
            result = self.engine.take_result(rid) if block.finish_reason is not None else None
            batch.append(("block", stream, (block, result)))
        for rid in self.engine.last_schedule.decode:
            stream = streams.get(rid)
            if stream is not None and stream.drafts is not None:
                draft = self._make_draft(rid, stream.drafts)
                if draft is not None:
                    batch.append(("draft", stream, draft))
        return batch

    def _make_draft(self, rid: str, spec: DraftSpec) -> Draft | None:
        d = self.engine.draft(rid)
        if d is None or d.step % max(1, spec.every_n_steps):
            return None
        tok = self.engine.tokenizer
        text = tok.decode(d.token_ids) if spec.include_text and tok is not None else ""
        return Draft(d, text)

    # ---------------------------------------------------------------- back on the loop

    def _deliver(self, batch: list[_Event]) -> None:
        now = time.monotonic()
        for kind, stream, payload in batch:
            if stream is None:  # ("step", None, seconds)
                self.observer.on_step(payload)
            elif self._streams.get(stream.request_id) is not stream:
                continue  # aborted or cancelled meanwhile
            elif kind == "started":
                self._on_started(stream, payload)
            elif kind == "draft":
                if stream._push_draft(payload):
                    self.observer.on_draft_dropped()
            else:
                block, result = payload
                self._on_block(stream, block, result, now)

    def _on_started(self, stream: RequestStream, t_admit: float) -> None:
        stream.admitted_at = t_admit
        queue = t_admit - stream.arrival
        self.observer.on_started(queue)
        seed = stream.params.seed
        assert seed is not None, "submit() draws a seed for every request"
        stream._push(Started(stream.request_id, seed, stream.prompt_tokens, stream.params, queue))

    def _on_block(self, stream: RequestStream, block: BlockOutput, result, now: float) -> None:
        if stream.admitted_at is None:  # expired in the queue: never started
            stream.admitted_at = now
        first = stream.first_block_at is None and block.stats.denoising_steps > 0
        if first:
            stream.first_block_at = now
        if block.stats.denoising_steps > 0:
            stream._push(block)
            self.observer.on_block(block, first, now - stream.arrival)
        if result is not None:
            with self._lock:
                self._streams.pop(stream.request_id, None)
                self._remember_finished(stream.request_id, stream.owner)
            fin = self._finished(
                stream, result.finish_reason, len(result.token_ids), len(result.blocks), result.denoising_steps
            )
            stream._push(fin)
            self.observer.on_finished(fin)
        elif not stream.reading and stream.buffered > 1 and now - stream.last_read > self.stall_timeout_s:
            self._abort(stream.request_id, "stalled")
            stream._fail(
                StreamStalledError(
                    f"request {stream.request_id}: the reader took nothing for {self.stall_timeout_s:g} s; aborted"
                )
            )

    def _fail_all(self, error: Exception) -> None:
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            stream._fail(EngineFaultError(f"engine failure: {type(error).__name__}: {error}"))
        if self.on_fault is not None:
            self.on_fault(error)
