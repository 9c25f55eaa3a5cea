"""The engine for asyncio callers: the step loop on its own thread, one event stream per request.

``AsyncEngine.submit`` validates and admits a request at once (the engine's ``Admission``, run on the async
engine's own bounded pool of tokenization threads, ``TokenizePool``: never on the event loop nor on a pool other
work shares; ``tokenize_workers`` threads, at most ``tokenize_queue_len`` prompts waiting, beyond which
QueueFullError) and returns a ``RequestStream`` (dgserve.engine.request_stream): ``Started`` when the request
leaves the queue, optional ``DraftOutput`` previews, one ``BlockOutput`` per committed canvas, ``Finished`` last.
The engine thread hands each step's events to the loop in one ``call_soon_threadsafe`` call.

Slow readers: a reader that takes nothing for ``stall_timeout_s`` while blocks wait is aborted, and its stream
raises ``StreamStalledError`` after the buffered events (``RequestStream``).
Cancellation: ``RequestStream.cancel`` / ``AsyncEngine.abort`` free the slot before the engine's next step.
Ownership: a request submitted with an ``owner`` (the caller's identity, e.g. a digest of its token) can only be
aborted by the same owner; to anyone else it looks exactly like an id never seen.
A request that fails alone (``Engine.step``: its admission, prefill, block or commit; its grammar; here, building
its events) ends its stream with its error, after the blocks it committed; the others carry on. An exception out of
the step itself (``SharedWorkError``: work shared by every request) is an engine bug: it fails every in-flight
stream with ``EngineFaultError`` and stops the engine. Neither message carries another request's content: the
fault is named by its type only (the server log has the phase and the rest).

The request is the engine's ``Request`` (dgserve.engine.request), minted once by ``Admission.mint``; the
stream hangs on it (``Request.stream``) and is all this layer keeps. Ids, owners, duplicates and the recently
finished ids live in the engine, under its one lock. The service talks to this facade only (``model_info``,
``tokenize``, ``default_params``, ``max_num_seqs``), never to the engine behind it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from dgserve.engine.engine import Engine
from dgserve.engine.prompt import Prompt, Submission
from dgserve.engine.request import DraftSpec, Request, RequestFailedError, SharedWorkError
from dgserve.engine.request_checks import check_request_id
from dgserve.engine.request_stream import Draft, EngineObserver, Finished, RequestStream, Started, StreamStalledError
from dgserve.engine.step_output import StepOutput
from dgserve.engine.tokenize_pool import MIN_TOKENIZE_QUEUE, TokenizePool, default_tokenize_workers
from dgserve.outputs import FINISH_CANCELLED, BlockOutput
from dgserve.sampling_params import SamplingParams

# the names the service imports from here (the stream's types live in dgserve.engine.request_stream)
__all__ = [
    "ABORT_ALREADY_FINISHED",
    "ABORT_CANCELLED",
    "AsyncEngine",
    "Draft",
    "DraftSpec",
    "EngineFaultError",
    "EngineObserver",
    "EngineUnavailableError",
    "Finished",
    "RequestStream",
    "Started",
    "StreamStalledError",
    "fault_summary",
]

log = logging.getLogger("dgserve.engine.engine")

# What the engine thread hands the loop after a step: ("step", None, seconds), ("started", stream, None),
# ("block", stream, (BlockOutput, GenerationResult | None)), ("draft", stream, Draft) or ("failed", stream, error).
_Event = tuple[str, "RequestStream | None", Any]

ABORT_CANCELLED, ABORT_ALREADY_FINISHED = "cancelled", "already_finished"
T = TypeVar("T")


class EngineUnavailableError(Exception):
    """The engine is not running (not started, stopping, or stopped after a fault)."""


class EngineFaultError(Exception):
    """The step loop failed; in-flight requests cannot complete."""


def fault_summary(error: Exception) -> str:
    """What callers may be told of an engine fault: a ``SharedWorkError``'s message (the phase that failed and the
    cause's type, never a request's content), else the exception's type only (its message may hold content)."""
    if isinstance(error, SharedWorkError):
        return str(error)
    return f"an internal error ({type(error).__name__})"


class AsyncEngine:
    """Owns an Engine and its step thread; safe to use from one asyncio event loop."""

    def __init__(
        self,
        engine: Engine,
        *,
        stall_timeout_s: float = 30.0,
        observer: EngineObserver | None = None,
        on_fault: Callable[[Exception], None] | None = None,
        tokenize_workers: int | None = None,
        tokenize_queue_len: int | None = None,
    ):
        """``tokenize_workers``: tokenization threads (None: one per core, at most 4); ``tokenize_queue_len``:
        prompts that may wait for one (None: the scheduler's capacity, at least 64)."""
        self.engine = engine
        self.on_fault = on_fault
        self.stall_timeout_s = stall_timeout_s
        self.observer = observer or EngineObserver()
        self.fault: Exception | None = None
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        workers = tokenize_workers if tokenize_workers is not None else default_tokenize_workers()
        if tokenize_queue_len is None:
            cfg = engine.scheduler.config
            tokenize_queue_len = max(MIN_TOKENIZE_QUEUE, cfg.max_num_seqs + (cfg.max_queue_len or 0))
        self._tokenize_pool = TokenizePool(workers, tokenize_queue_len, engine.scheduler.retry_after_s)

    # ---------------------------------------------------------------- lifecycle

    def warm_up(self) -> None:
        """Run one tiny generation (before start) so the first request does not pay for lazy initialisation."""
        bos = self.engine.model.config.bos_token_id
        prompt = [bos if bos is not None else 0]
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
        for req in self.engine.in_flight():
            self._abort(req, "shutdown")
        self._tokenize_pool.shutdown()

    @property
    def num_running(self) -> int:
        return self.engine.num_running

    @property
    def num_waiting(self) -> int:
        return self.engine.num_waiting

    @property
    def num_in_flight(self) -> int:
        """Requests queued or running in the engine."""
        return len(self.engine.in_flight())

    # ---------------------------------------------------------------- what the service reads (the facade)

    def default_params(self, **overrides: Any) -> SamplingParams:
        """The checkpoint's default SamplingParams (``Engine.default_params``)."""
        return self.engine.default_params(**overrides)

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def max_num_seqs(self) -> int:
        """Running requests at most (the scheduler's limit, after the KV cache budget)."""
        return self.engine.scheduler.config.max_num_seqs

    @property
    def max_queue_len(self) -> int | None:
        return self.engine.scheduler.config.max_queue_len

    @property
    def model_config(self):
        return self.engine.model.config

    @property
    def dtype(self):
        return self.engine.model.dtype

    @property
    def eos_ids(self) -> frozenset[int]:
        return self.engine.eos_ids

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def runtime_info(self) -> dict[str, Any]:
        return self.engine.runtime_info()

    async def tokenize(self, prompt: Prompt) -> list[int]:
        """Validated token ids of a prompt, at most max_model_len (bounded work; on the tokenization pool)."""
        return await self.tokenizing(self.engine.admission.prompt_ids, prompt, self.engine.max_model_len)

    async def check_length(
        self, prompt: Prompt, max_new_tokens: int | None = None, *, fill_context: bool = False, at_least: bool = False
    ) -> int:
        """The token count of ``prompt``, refused with the engine's own context check (a ValueError naming both
        numbers) when it cannot fit the window with ``max_new_tokens``' canvases (``Admission.check_length``:
        None, the prompt alone must fit, as for ``tokenize``; ``fill_context``: one canvas, as ``Admission.mint``
        reserves). ``at_least``: the prompt counts fewer tokens than the request will (its remote images at their
        fewest), and the refusal says so. Bounded work, on the tokenization pool. The image stage calls it with
        stand-in images of the exact soft-token counts before decoding any (docs/images.md, "Admission")."""
        check = self.engine.admission.check_length
        return await self.tokenizing(check, prompt, max_new_tokens, fill_context, at_least)

    async def tokenizing(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` (tokenizing, rendering, compiling a grammar: a prompt's work) on the tokenization pool
        (``TokenizePool.run``); QueueFullError at once when ``tokenize_queue_len`` prompts already wait for it."""
        return await self._tokenize_pool.run(fn, *args)

    # ---------------------------------------------------------------- requests

    async def submit(self, sub: Submission, *, timeout_s: float | None = None) -> RequestStream:
        """Validate and admit a submission (``Admission.mint`` says what its fields mean); raises ValueError
        (bad input), DuplicateRequestError, QueueFullError, NotImplementedError (unsupported chat part) or
        EngineUnavailableError. ``timeout_s``: a request still queued after this long is dropped without model
        work. Its ``owner`` is who may abort it (see ``abort``)."""
        if sub.request_id is not None:
            check_request_id(sub.request_id)
        if not self.running:
            raise EngineUnavailableError(
                "the engine is not running"
                if self.fault is None
                else f"the engine stopped after an internal error ({type(self.fault).__name__})"
            )
        deadline = None if timeout_s is None else time.monotonic() + timeout_s

        # the request id is checked above, once: the rest of the admission mints it
        mint = functools.partial(self.engine.admission.mint, sub, deadline=deadline)
        structured = sub.params is not None and sub.params.response_format is not None
        if isinstance(sub.prompt, (list, tuple)) and not structured:
            req = mint()
        else:  # tokenization and grammar compilation (the admission) run on the tokenization pool, never on the loop
            req = await self.tokenizing(mint)
        stream = req.stream = RequestStream(req, self._abort)
        self.engine.add(req)
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
        req = self.engine.abort(request_id, owner)
        if req is not None:
            self._aborted(req, reason, notify)
            return ABORT_CANCELLED
        return ABORT_ALREADY_FINISHED if self.engine.recently_finished(request_id, owner) else None

    def cancel_all(self, reason: str) -> int:
        """Cancel every queued and running request; each stream ends with Finished("cancelled"). Returns how many."""
        reqs = self.engine.in_flight()
        for req in reqs:
            self._abort(req, reason, notify=True)
        return len(reqs)

    def _abort(self, req: Request, reason: str, notify: bool = False) -> None:
        """Cancel a request whoever owns it (client gone, stalled reader, shutdown)."""
        if self.engine.abort(req.request_id, req.owner) is req:
            self._aborted(req, reason, notify)

    def _aborted(self, req: Request, reason: str, notify: bool) -> None:
        self.observer.on_abort(reason)
        stream = req.stream
        if notify and stream is not None:
            stream._push(Finished.of(req, FINISH_CANCELLED, 0, 0, 0))

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
                log.exception("engine fault: %s", e)
                self.fault = e
                loop.call_soon_threadsafe(self._fail_all, e)
                return
            if batch:
                loop.call_soon_threadsafe(self._deliver, batch)

    def _step(self) -> list[_Event]:
        t0 = time.monotonic()
        out: StepOutput = self.engine.step()
        batch: list[_Event] = [("step", None, time.monotonic() - t0)]
        batch.extend(("started", r.stream, None) for r in out.admitted if r.stream is not None)
        for req, block in out.blocks:
            if req.stream is not None:
                self._own_events(batch, req, functools.partial(self._block_event, block=block))
        batch.extend(("failed", r.stream, r.error) for r in out.failed if r.stream is not None)
        for req in out.stepped:
            if req.stream is not None and req.drafts is not None:
                self._own_events(batch, req, self._draft_event)
        return batch

    def _own_events(self, batch: list[_Event], req: Request, make: Callable[[Request], _Event | None]) -> None:
        """Append ``make(req)``, one request's event, to ``batch``; an exception there ends that request alone (its
        stream fails with a RequestFailedError, the log has the type, the traceback at DEBUG), not the engine."""
        try:
            event = make(req)
        except Exception as e:
            log.error("request %s: building its events failed (%s); ending it alone", req.request_id, type(e).__name__)
            log.debug("request %s: building its events failed", req.request_id, exc_info=e)
            self.engine.abort(req.request_id, req.owner)
            failure = RequestFailedError(f"request {req.request_id}: failed during output (an internal error)")
            batch.append(("failed", req.stream, failure))
            return
        if event is not None:
            batch.append(event)

    @staticmethod
    def _block_event(req: Request, block: BlockOutput) -> _Event:
        """A committed block, with the request's result when it is the last."""
        return ("block", req.stream, (block, req.result() if block.finish_reason is not None else None))

    def _draft_event(self, req: Request) -> _Event | None:
        assert req.drafts is not None
        preview = Draft.of(req, req.drafts, self.engine.tokenizer)
        return None if preview is None else ("draft", req.stream, preview)

    # ---------------------------------------------------------------- back on the loop

    def _deliver(self, batch: list[_Event]) -> None:
        now = time.monotonic()
        for kind, stream, payload in batch:
            if stream is None:  # ("step", None, seconds)
                self.observer.on_step(payload)
            elif stream.done:
                continue  # aborted, cancelled or failed meanwhile
            elif kind == "started":
                self._on_started(stream)
            elif kind == "failed":
                self.observer.on_abort("request_error")
                stream._fail(payload)
            elif kind == "draft":
                if stream._push_draft(payload):
                    self.observer.on_draft_dropped()
            else:
                block, result = payload
                self._on_block(stream, block, result, now)

    def _on_started(self, stream: RequestStream) -> None:
        req = stream.request
        admitted = req.admitted_at if req.admitted_at is not None else time.monotonic()
        queue = admitted - req.arrival
        self.observer.on_started(queue)
        if self.engine.prefix_caching:
            self.observer.on_prefix_cache(req.prompt_len, req.cached_tokens)
        stream._push(Started(req.request_id, req.seed, req.prompt_len, req.params, queue))

    def _on_block(self, stream: RequestStream, block: BlockOutput, result, now: float) -> None:
        req = stream.request
        first = req.first_block_at is None and block.stats.denoising_steps > 0
        if first:
            req.first_block_at = now
        if block.stats.denoising_steps > 0 or block.text:  # (a request ended by its time: the text held back)
            stream._push(block)
            self.observer.on_block(block, first, now - req.arrival)
        if result is not None:
            fin = Finished.of(
                req, result.finish_reason, len(result.token_ids), len(result.blocks), result.denoising_steps
            )
            stream._push(fin)
            self.observer.on_finished(fin)
        elif not stream.reading and stream.buffered > 1 and now - stream.last_read > self.stall_timeout_s:
            self._abort(stream.request, "stalled")
            stream._fail(
                StreamStalledError(
                    f"request {stream.request_id}: the reader took nothing for {self.stall_timeout_s:g} s; aborted"
                )
            )

    def _fail_all(self, error: Exception) -> None:
        fault = EngineFaultError(f"engine failure: {fault_summary(error)}")
        for req in self.engine.in_flight():
            if req.stream is not None:
                req.stream._fail(fault)
        if self.on_fault is not None:
            self.on_fault(error)
