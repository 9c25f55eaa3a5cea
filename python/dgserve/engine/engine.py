"""The generation engine: requests in, committed blocks out (docs/generation.md, docs/architecture.md).

``Engine.step()`` is one iteration of continuous batching, planned by the ``Scheduler``: waiting requests are
admitted into free running slots, prompt prefill advances by fixed-size chunks (so one long prompt cannot stall
the others), every running canvas whose prompt is encoded advances one denoising step in one batched decoder
call, and finished blocks are committed (their tokens are encoded before the next block starts). ``generate``,
``generate_batch`` and ``stream`` are loops over it. A request's tokens never depend on what it is batched with:
the noise is keyed per request, the model does fixed-shape work per row, and prefill chunk boundaries depend on
the prompt alone (docs/exactness.md).

One request is one ``Request`` object (dgserve.engine.request), minted here once (id, seed, validated prompt ids),
queued and planned by the ``Scheduler``, given a cache slot and knob tensors by the ``ModelRunner``, and returned to the
caller in each ``StepOutput``: ``step`` is schedule → run → commit.

A request fails alone, by construction: ``step`` runs each request's own work (admission into a slot, its prompt
chunks, the start of a block, the commit of a block) through one guard, ``_alone``, so an exception there ends that
request with ``Request.error`` (reported in ``StepOutput.failed``): the exception itself when it is a ValueError
(the request's input caused it: INVALID_ARGUMENT / 400 naming the field), else a ``RequestFailedError`` (INTERNAL
for that request only). Its slot is freed and the others go on. A grammar that fails ends its request the same
way. Only the shared work (scheduling, slot bookkeeping, the batched denoising pass) can raise out of ``step``, as
a ``SharedWorkError`` naming the phase: that is an engine fault.

Time: a running request whose time is up (``Request.ends_at``: the engine's ``max_request_seconds`` from its
admission, or its deadline, whichever is sooner) is ended at the start of the next step with finish reason
"length", keeping the blocks it committed (docs/generation.md, "Limits").

Thread safety: one lock. ``add_request``/``add`` and ``abort`` may be called from any thread while one thread runs
``step``; an abort takes effect before the next step (the current one's result for that request is discarded,
and its slot is freed at the start of the next step, on the engine thread that owns the runner's tensors).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from dgserve.config import generation_eos_token_ids
from dgserve.engine.block import CanvasDraft
from dgserve.engine.cache_config import CacheConfig
from dgserve.engine.canvas_draft import DraftRules
from dgserve.engine.canvas_draft import canvas_draft as _canvas_draft
from dgserve.engine.image_batch import (
    default_image_token_cost,
    encode_planned,
    image_runs,
    image_spans,
    placeholder_id,
)
from dgserve.engine.model_runner import ModelRunner
from dgserve.engine.prefix_cache import PrefixCacheStats, prefix_hashes
from dgserve.engine.prefix_cache import cache_salt as _cache_salt
from dgserve.engine.prompt import ChatPrompt, ImagePrompt, Prompt, Submission, with_tools
from dgserve.engine.request import Request, RequestFailedError, RequestKey, SharedWorkError
from dgserve.engine.scheduler import Scheduler, SchedulerConfig
from dgserve.model import DiffusionGemma
from dgserve.outputs import (
    FINISH_CANCELLED,
    FINISH_ERROR,
    FINISH_LENGTH,
    BlockOutput,
    BlockStats,
    GenerationResult,
    OutputTracker,
)
from dgserve.sampling_params import SamplingParams
from dgserve.text.token_bounds import PromptTooLongError

if TYPE_CHECKING:  # imported lazily at run time (from_pretrained), only when a checkpoint has one
    from dgserve.model.runtime import RuntimePlan
    from dgserve.structured.constrained import StructuredRow
    from dgserve.structured.grammar import GrammarCompiler
    from dgserve.text.tokenizer import Tokenizer

MAX_REQUEST_ID_LENGTH = 256
REMEMBER_FINISHED = 10_000  # finished ids kept for Abort's "already finished" answer
log = logging.getLogger("dgserve.engine.engine")
_T = TypeVar("_T")


@dataclass(frozen=True)
class DraftOutput:
    """The current block's argmax canvas after its latest denoising step (a preview; may still change)."""

    index: int
    step: int
    token_ids: list[int]
    mean_entropy: float


@dataclass
class StepOutput:
    """What one ``Engine.step`` did: requests admitted into slots, blocks committed (and an empty "cancelled"
    block for each queued request whose deadline passed), the requests that took a denoising step (``stepped``), and
    those that failed alone (their ``error`` is set; they are finished and their slots freed)."""

    admitted: list[Request] = field(default_factory=list)
    blocks: list[tuple[Request, BlockOutput]] = field(default_factory=list)
    stepped: list[Request] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)


class Engine:
    """Runs DiffusionGemma generation for many concurrent requests on one device.

    defaults: the checkpoint's SamplingParams (``SamplingParams.from_generation_config``; None: the built-in
    ones), what ``default_params`` and a request without params start from. max_model_len: the context window
    (prompt + generated canvases), at most the model's max_position_embeddings (the default). scheduler_config:
    capacity and prefill chunking. eos_token_ids: the end-of-sequence ids (generation_config.json's); empty or
    None: config.json's. cache_config: the KV cache budget (``ModelRunner``), which may lower max_num_seqs to
    the slots that fit. max_request_steps: the most denoising steps one request may ask for (max_denoising_steps
    times its canvases), so that no request can hold a slot for hours; None: no limit. max_request_seconds: the
    wall-clock time a request may run from its admission into a slot (its deadline ends it sooner); then it ends
    with finish reason "length", keeping what it committed; None: no limit. prefix_caching: keep the
    KV of full prompt chunks in what the slots leave of the cache budget and reuse it for prompts that start with
    the same tokens (docs/prefix-caching.md); a request's tokens are the same either way.
    """

    def __init__(
        self,
        model: DiffusionGemma,
        tokenizer: Tokenizer | None = None,
        defaults: SamplingParams | None = None,
        scheduler_config: SchedulerConfig | None = None,
        max_model_len: int | None = None,
        native_ops: str = "auto",
        eos_token_ids: Sequence[int] | None = None,
        cache_config: CacheConfig | None = None,
        max_request_steps: int | None = None,
        prefix_caching: bool = True,
        max_request_seconds: float | None = None,
    ):
        from dgserve.ops.native_check import run_self_check

        self.model = model
        self.native_ops_mode = native_ops
        # the self-check of the native ops (dgserve.ops.native_check): on CUDA, or whenever asked for (strict/off);
        # strict raises NativeOpsError here, before the engine serves anything
        self.native_report = (
            run_self_check(model.device, native_ops) if native_ops != "auto" or model.device.type == "cuda" else None
        )
        self.runtime: RuntimePlan | None = None  # the RuntimePlan when built by from_pretrained
        self.tokenizer = tokenizer
        self.defaults = defaults if defaults is not None else SamplingParams()
        cfg = model.config
        eos = tuple(eos_token_ids or ()) or _as_tuple(cfg.eos_token_id)
        self.eos_ids = frozenset(int(e) for e in eos)
        self.max_request_steps = max_request_steps
        if max_request_seconds is not None and not max_request_seconds > 0:
            raise ValueError(f"max_request_seconds must be > 0 or None, got {max_request_seconds!r}")
        self.max_request_seconds = max_request_seconds
        self.max_model_len = _check_max_model_len(max_model_len, cfg.max_position_embeddings)
        sched = scheduler_config or SchedulerConfig()
        if sched.image_token_cost is None:  # the device's default (docs/images.md, "Bounded like text")
            sched = dataclasses.replace(sched, image_token_cost=default_image_token_cost(model))
        self.runner = ModelRunner(
            model, sched.max_num_seqs, self.max_model_len, sched.prefill_chunk, cache_config, prefix_caching
        )
        if self.runner.num_slots < sched.max_num_seqs:  # the cache budget caps the running requests
            sched = dataclasses.replace(sched, max_num_seqs=self.runner.num_slots)
        self.scheduler = Scheduler(sched, cached_prefix=self._match_prefix if prefix_caching else None)
        self._finished_ids: OrderedDict[RequestKey, None] = OrderedDict()  # recently finished keys
        self._ids = itertools.count()
        # the one lock: scheduler tables, request status, finished ids (reentrant: a request failing alone is ended
        # under it from work that may already hold it, the commit)
        self._lock = threading.RLock()
        self._grammars: GrammarCompiler | None = None  # built on the first structured request

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        device: torch.device | str = "cpu",
        dtype: torch.dtype | str | None = None,
        **kwargs: Any,
    ) -> Engine:
        """Model + tokenizer (when the directory has tokenizer.json) + generation_config.json's defaults and EOS
        ids (a default outside the knob's bounds: ConfigError naming the field and the file, before the model
        loads); kwargs go to ``Engine.__init__`` (scheduler_config, max_model_len, native_ops).

        dtype None or "auto": bfloat16 on CUDA, float32 on the CPU (``dgserve.model.runtime``). A dtype whose weights do
        not fit the GPU raises ConfigError before anything is loaded."""
        from dgserve.model.runtime import check_plan, plan_runtime
        from dgserve.text.tokenizer import Tokenizer

        defaults = SamplingParams.from_generation_config(path)
        eos = generation_eos_token_ids(path)
        plan = plan_runtime(path, str(device), dtype, kwargs.get("native_ops", "auto"))
        check_plan(plan)
        model = DiffusionGemma.from_pretrained(path, device=device, dtype=plan.torch_dtype)
        tok = Tokenizer.from_pretrained(path) if os.path.exists(os.path.join(path, "tokenizer.json")) else None
        engine = cls(model, tok, defaults, eos_token_ids=eos, **kwargs)
        engine.runtime = plan
        log.info(
            "serving %s on %s: dtype %s (%s), experts %s, native ops %s",
            path,
            plan.device,
            plan.dtype,
            plan.dtype_reason,
            plan.expert_format,
            engine.runtime_info()["native_ops"] or "none",
        )
        return engine

    def runtime_info(self) -> dict[str, Any]:
        """device, dtype, expert format, native-ops mode, the native ops active on the device (after the
        self-check) and those switched off with why: for the start-up log and GetModelInfo."""
        from dgserve import ops

        off = ops.switched_off()
        active = list(ops.active_native_ops(self.model.device))
        fmt = self.runtime.expert_format if self.runtime is not None else f"dense {str(self.model.dtype)[6:]}"
        return {
            "device": str(self.model.device),
            "dtype": str(self.model.dtype).removeprefix("torch."),
            "expert_format": fmt,
            "native_ops_mode": self.native_ops_mode,
            "native_ops": active,
            "native_ops_disabled": {op: why for op, why in off.items() if op in ops.NATIVE_OPS},
        }

    def default_params(self, **overrides: Any) -> SamplingParams:
        """The checkpoint's defaults (``self.defaults``) with ``overrides``, validated (ValueError names the field)."""
        return dataclasses.replace(self.defaults, **overrides)

    # ------------------------------------------------------------------ simple entry points

    def generate(self, prompt: Prompt, params: SamplingParams | None = None) -> GenerationResult:
        """Generate for one prompt (text, token ids or chat) to completion."""
        return self.generate_batch([prompt], [params])[0]

    def generate_batch(
        self, prompts: Sequence[Prompt], params_list: Sequence[SamplingParams | None] | None = None
    ) -> list[GenerationResult]:
        """Generate several requests batched through shared decoder calls; each result equals running it alone."""
        params_list = params_list if params_list is not None else [None] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"params_list has {len(params_list)} entries for {len(prompts)} prompts")
        reqs: list[Request] = []
        try:
            for p, sp in zip(prompts, params_list, strict=True):
                reqs.append(self.add(self.make_request(Submission(p, sp))))
        except Exception:
            for r in reqs:
                self.abort(r.request_id)
            raise
        while not all(r.finished for r in reqs):
            self.step()
        return [r.result() for r in reqs]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[BlockOutput]:
        """Yield each committed block of one request as soon as it is final; the last has finish_reason."""
        req = self.add(self.make_request(Submission(prompt, params)))
        try:
            while True:
                out = self.step()
                for r, block in out.blocks:
                    if r is req:
                        yield block
                        if block.finish_reason is not None:
                            return
                if req.error is not None:
                    raise req.error
        finally:
            self.abort(req.request_id)

    # ------------------------------------------------------------------ continuous batching core

    def make_request(self, sub: Submission, *, deadline: float | None = None) -> Request:
        """Validate a submission and mint its request, once: its id, its seed, its prompt ids (tokenized and
        checked against the vocabulary, the context window and the KV cache slot). Thread-safe; raises ValueError
        naming the bad field. A ``ChatPrompt`` with tools gets their output constraint (``with_tools``).
        ``deadline`` (time.monotonic() seconds): a request still waiting then is dropped before any model work (its
        last block: finish_reason "cancelled"); one running then is ended with finish_reason "length", as at the
        engine's ``max_request_seconds`` after its admission. Of the submission: ``owner`` may abort it
        (``abort``); ``drafts`` are the previews the caller wants (the async engine streams them);
        ``fill_context``: the caller set no max_new_tokens, and the request may use the room left in the context
        (``room_left``) instead of ``params.max_new_tokens``, as vLLM does for a request without max_tokens: a
        structured or tool-calling output is then ended by its grammar or EOS, not cut short; ``cache_salt``: the
        request reuses only prefix-cache blocks of requests with the same owner and salt
        (docs/prefix-caching.md); ValueError when empty or longer than 256 characters; ``initial_canvas`` and
        ``pinned``: the starting canvas and its pins (``canvas_draft``, docs/edit-in-place.md)."""
        prompt, request_id, owner = sub.prompt, sub.request_id, sub.owner
        salt = _cache_salt(owner, sub.cache_salt)
        params = with_tools(prompt, sub.params or self.default_params())
        if request_id is not None:
            check_request_id(request_id)
        fill_context = sub.fill_context
        if fill_context:  # at least one canvas must fit; the room is known once the prompt is tokenized
            params = dataclasses.replace(params, max_new_tokens=self.model.config.canvas_length)
        self.check_work(params)
        prompt_ids = self.request_prompt_ids(prompt, params.max_new_tokens)
        if fill_context:
            params = dataclasses.replace(params, max_new_tokens=self.room_left(len(prompt_ids), params))
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if params.seed is None:  # the seed in use, drawn once: the request's params carry it from here on
            params = dataclasses.replace(params, seed=secrets.randbits(64))
        self._check_stop_token_ids(params)
        keep = (isinstance(prompt, ChatPrompt) and prompt.keeps_markers) or not params.skip_special_tokens
        draft = self.canvas_draft(sub.initial_canvas, sub.pinned, params)
        tracker = OutputTracker(
            params.max_new_tokens,
            self.eos_ids,
            params.ignore_eos,
            params.stop,
            self.tokenizer,
            not keep,
            params.stop_token_ids,
            params.min_tokens,
            pin_end=draft.pin_end if draft is not None else 0,
        )
        grammar = self._structured_row(params)
        # prefix-cache keys, salted with the caller's identity and chosen salt: no block is shared across them
        images = image_spans(prompt_ids, prompt, self.model)
        spans = [(s, s + im.tokens, im.digest) for s, im in images]
        hashes = (
            prefix_hashes(prompt_ids, self.runner.prefill_chunk, salt, spans) if self.runner.prefix is not None else ()
        )
        return Request(
            rid,
            prompt_ids,
            params,
            tracker,
            deadline=deadline,
            time_limit=self.max_request_seconds,
            owner=owner,
            grammar=grammar,
            drafts=sub.drafts,
            prefix_hashes=hashes,
            images=images,
            draft=draft,
        )

    def add(self, req: Request) -> Request:
        """Queue a request made by ``make_request``. Raises ``DuplicateRequestError`` (a ValueError) for an id in
        flight and ``QueueFullError`` when running slots and queue are full."""
        with self._lock:
            self.scheduler.add(req)
        return req

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        deadline: float | None = None,
    ) -> str:
        """``make_request`` then ``add``; returns the request's id."""
        return self.add(self.make_request(Submission(prompt, params, request_id), deadline=deadline)).request_id

    def abort(self, request_id: str, owner: str | None = None) -> Request | None:
        """Drop a queued or running request of ``owner`` (its slot is freed before the next step); returns it, or
        None when no such request is in flight (or it belongs to another owner)."""
        with self._lock:
            req = self.scheduler.get((owner, request_id))
            if req is None:
                return None
            self.scheduler.abort(req.key)
            req.tracker.finish_reason = req.tracker.finish_reason or FINISH_CANCELLED
            self._remember_finished(req)
            return req

    def recently_finished(self, request_id: str, owner: str | None = None) -> bool:
        """True when ``owner``'s request ``request_id`` finished or was aborted recently."""
        with self._lock:
            return (owner, request_id) in self._finished_ids

    def _remember_finished(self, req: Request) -> None:
        self._finished_ids[req.key] = None
        self._finished_ids.move_to_end(req.key)
        while len(self._finished_ids) > REMEMBER_FINISHED:
            self._finished_ids.popitem(last=False)

    def in_flight(self) -> list[Request]:
        """The requests queued or running now."""
        with self._lock:
            return self.scheduler.requests()

    def has_unfinished(self) -> bool:
        return len(self.scheduler) > 0

    @property
    def prefix_caching(self) -> bool:
        """Whether prompts reuse the KV of cached prefixes (docs/prefix-caching.md)."""
        return self.runner.prefix is not None

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    def step(self) -> StepOutput:
        """One engine iteration, schedule → run → commit: end the requests whose time is up, admit into slots,
        encode the planned prompt chunks (their images first, in one vision tower call: ``encode_planned``), one
        denoising step for every running canvas whose prompt is encoded, commit finished blocks. Each request's own
        work runs through ``_alone`` (its failure ends that request); the shared work through ``_shared`` (its
        failure raises ``SharedWorkError``: an engine fault)."""
        out = StepOutput()
        with self._lock:
            plan = self._shared("scheduling", self.scheduler.schedule)
            for req in plan.expired:
                out.blocks.append((req, self._expire(req)))
            for req in plan.timed_out:
                out.blocks.append((req, self._time_out(req)))
        # aborted or timed out since the last step: their slots are free before admission
        self._shared("slot release", self.runner.release_finished)
        out.admitted = self._alone("admission", plan.admitted, self.runner.admit, out)
        # the images of every planned chunk in one tower call; its failure leaves each request to encode its own
        feats = encode_planned(self.model, plan.prefill)
        for (req, start, end), emb in zip(plan.prefill, feats, strict=True):
            work = functools.partial(self.runner.prefill, start=start, end=end, image_embeds=emb)
            self._alone("prefill", [req], work, out)
        self._alone("block start", [r for r in plan.decode if r.block is None], self.runner.start_block, out)
        with self._lock:  # a grammar that failed before the block's first step: that request ends here
            active = [r for r in plan.decode if not r.finished and not self._failed_alone(r, out)]
        if active:
            t0 = time.perf_counter()
            self._shared(f"the batched denoising pass over {len(active)} requests", lambda: self.runner.run(active))
            dt = time.perf_counter() - t0
            out.stepped = active
            with self._lock:
                for req in active:
                    req.denoise_seconds += dt
                done = [r for r in active if not r.finished and not self._failed_alone(r, out) and r.block_done]
                self._alone("commit", done, lambda r: out.blocks.append((r, self._commit(r))), out)
        self._shared("slot release", self.runner.release_finished)
        return out

    def _alone(
        self, phase: str, reqs: Sequence[Request], work: Callable[[Request], object], out: StepOutput
    ) -> list[Request]:
        """``work(req)`` for each request still in flight, each on its own: an exception ends that request alone
        (``_end_alone``) and the others go on. Returns the requests whose work succeeded."""
        ok = []
        for req in reqs:
            if req.finished:  # aborted meanwhile, or failed at an earlier phase of this step
                continue
            try:
                work(req)
            except Exception as e:  # noqa: BLE001 - whatever one request's work raises ends that request only
                self._end_alone(req, phase, e, out)
            else:
                ok.append(req)
        return ok

    def _end_alone(self, req: Request, phase: str, error: Exception, out: StepOutput) -> None:
        """End ``req`` after its own work raised ``error`` in ``phase``: with ``error`` itself when it is a
        ValueError (the request's input caused it; the message names the field: INVALID_ARGUMENT / 400), else with
        a ``RequestFailedError`` (INTERNAL for this request only). The log line names the request, the phase and the
        exception's type, never its message (which may quote the request's content); the traceback is at DEBUG."""
        kind = type(error).__name__
        if isinstance(error, ValueError):
            log.info("request %s: its input failed at %s (%s); ending it alone", req.request_id, phase, kind)
            failure: Exception = error
        else:
            log.error("request %s: %s failed (%s); ending it alone", req.request_id, phase, kind)
            failure = RequestFailedError(f"request {req.request_id}: failed during {phase} (an internal error)")
        log.debug("request %s: %s failed", req.request_id, phase, exc_info=error)
        with self._lock:
            self._fail(req, failure, out)

    @staticmethod
    def _shared(phase: str, work: Callable[[], _T]) -> _T:
        """``work()``, shared by every running request: an exception there belongs to no single request and is
        raised as a ``SharedWorkError`` naming ``phase`` and the cause's type (chained)."""
        try:
            return work()
        except Exception as e:
            raise SharedWorkError(
                f"engine fault in {phase}, work shared by every running request (no single request's): "
                f"{type(e).__name__}"
            ) from e

    def _match_prefix(self, req: Request) -> int:
        """The prompt tokens the prefix cache holds for ``req`` (``ModelRunner.match_prefix``), planned at its
        admission. A lookup that raises costs that request its reuse only (0: its whole prompt is encoded, with the
        same tokens as a hit gives), never the scheduling of the others."""
        try:
            return self.runner.match_prefix(req)
        except Exception as e:
            log.error(
                "request %s: prefix cache lookup failed (%s); encoding its whole prompt",
                req.request_id,
                type(e).__name__,
            )
            log.debug("request %s: prefix cache lookup failed", req.request_id, exc_info=e)
            req.prefix_hit = None
            return 0

    def _failed_alone(self, req: Request, out: StepOutput) -> bool:
        """End ``req`` when its own state failed (its grammar); True when it did. Under the lock."""
        grammar = req.grammar
        if grammar is None or grammar.error is None or req.finished:
            return False
        log.info("request %s ended by its grammar: %s", req.request_id, grammar.error)
        self._fail(req, grammar.error, out)
        return True

    def _fail(self, req: Request, error: Exception, out: StepOutput) -> None:
        """Finish ``req`` with ``error`` and report it in ``out.failed`` (its slot is freed by
        ``release_finished``). Under the lock."""
        req.error, req.block = error, None
        req.tracker.finish_reason = req.tracker.finish_reason or FINISH_ERROR
        self.scheduler.abort(req.key)
        self._remember_finished(req)
        out.failed.append(req)

    def draft(self, req: Request) -> DraftOutput | None:
        """The request's current block after its latest denoising step, or None between blocks. Call from the
        thread that runs ``step``."""
        b = req.block
        if b is None or b.argmax is None or req.block_done:
            return None
        return DraftOutput(req.block_index, req.steps_run, b.argmax.tolist(), req.mean_entropy)

    def _commit(self, req: Request) -> BlockOutput:
        b, steps = req.block, req.steps_run
        if b is None or b.argmax is None or steps == 0:
            raise RuntimeError(f"request {req.request_id!r}: commit before its block ran a step")
        canvas = b.argmax.tolist()  # the committed block is the ARGMAX canvas of the last step run
        toks, text = req.tracker.add_block(canvas)
        stats = BlockStats(
            steps, len(toks) / steps, req.mean_entropy, req.encode_seconds, req.denoise_seconds, b.pinned
        )
        block = BlockOutput(req.block_index, toks, text, stats, req.tracker.finish_reason)
        req.blocks.append(block)
        req.block, req.block_index, req.pending = None, req.block_index + 1, canvas
        if block.finish_reason is not None:
            self.scheduler.finish(req.key)
            self._remember_finished(req)
        return block

    def _expire(self, req: Request) -> BlockOutput:
        req.tracker.finish_reason = FINISH_CANCELLED
        self._remember_finished(req)
        return BlockOutput(0, [], "", BlockStats(0, 0.0, float("nan"), 0.0, 0.0), FINISH_CANCELLED)

    def _time_out(self, req: Request) -> BlockOutput:
        """End a running request whose time is up (the scheduler has marked it finished): the block being denoised
        is dropped, what was committed stays, and the last "block" carries no tokens, the text the output rules
        held back, and finish_reason "length" (a budget, time, cut the output). Under the lock."""
        req.block = None
        text = req.tracker.end(FINISH_LENGTH)
        self._remember_finished(req)
        log.info("request %s: its time is up after %d blocks; ending it (length)", req.request_id, len(req.blocks))
        return BlockOutput(req.block_index, [], text, BlockStats(0, 0.0, float("nan"), 0.0, 0.0), FINISH_LENGTH)

    # ------------------------------------------------------------------ validation

    def _grammar_compiler(self) -> GrammarCompiler:
        if self.tokenizer is None:
            raise ValueError("response_format: structured output needs a tokenizer, and this model has none")
        from dgserve.structured.grammar import GrammarCompiler

        with self._lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer.to_json(), self.model.config.vocab_size, self.eos_ids)
            return self._grammars

    def _structured_row(self, params: SamplingParams) -> StructuredRow | None:
        """The grammar state of a request with a response_format (compiled once per format, then cached);
        ValueError naming response_format when the model has no tokenizer or the format does not compile. An
        output that is whole or nothing (a JSON document, a choice, required tool calls) is steered to a complete
        end within its max_new_tokens (docs/structured-output.md §11.9)."""
        fmt = params.response_format
        if fmt is None:
            return None
        from dgserve.structured.constrained import StructuredRow, steering_horizon

        grammars = self._grammar_compiler()
        matcher, V = grammars.matcher(fmt), self.model.config.vocab_size
        if not fmt.whole_or_nothing:
            return StructuredRow(matcher, V, self.eos_ids)
        horizon = steering_horizon(self.model.config.canvas_length)
        return StructuredRow(matcher, V, self.eos_ids, params.max_new_tokens, grammars.closer, horizon)

    def prompt_ids(self, prompt: Prompt, max_tokens: int | None = None) -> list[int]:
        """Token ids of a prompt (text, ids or chat), validated against the vocabulary. Thread-safe.

        ``max_tokens``: a prompt with more tokens raises PromptTooLongError (a ValueError naming ``prompt``) with
        bounded work: text that cannot fit is rejected by its byte length or a bounded count, never tokenized
        whole (``Tokenizer.encode``)."""
        if isinstance(prompt, (str, ChatPrompt)):
            tok = self.tokenizer
            if tok is None:
                raise ValueError(
                    "prompt: text and chat prompts need a tokenizer, and this model has none; pass token ids"
                )
            if isinstance(prompt, str):
                ids = tok.encode(prompt, add_special_tokens=True, max_tokens=max_tokens)
            else:
                tools = prompt.tools.rendered() if prompt.tools is not None else None
                ids = tok.encode_chat(
                    list(prompt.messages),
                    prompt.add_generation_prompt,
                    prompt.enable_thinking,
                    max_tokens=max_tokens,
                    tools=tools,
                    continue_final_message=prompt.continue_final_message,
                    chat_template=prompt.chat_template,
                    image_runs=image_runs(self.model, prompt, self.runner.prefill_chunk),
                )
        elif isinstance(prompt, ImagePrompt):
            if prompt.images:
                # the model's checks; the caller placed the placeholders
                image_runs(self.model, prompt, self.runner.prefill_chunk)
            ids = list(prompt.ids)
            if max_tokens is not None and len(ids) > max_tokens:
                raise PromptTooLongError(len(ids), max_tokens, "given")
        else:
            ids = [int(t) for t in (prompt.tolist() if isinstance(prompt, torch.Tensor) else prompt)]
            if max_tokens is not None and len(ids) > max_tokens:
                raise PromptTooLongError(len(ids), max_tokens, "given")
        V = self.model.config.vocab_size
        if not ids:
            raise ValueError("prompt: must contain at least one token")
        image_id = placeholder_id(self.model, prompt, ids)
        bad = [t for t in ids if not 0 <= t < V and t != image_id]
        if bad:
            raise ValueError(f"prompt: token id {bad[0]} is outside the vocabulary [0, {V})")
        return ids

    def canvas_draft(
        self,
        initial_canvas: str | Sequence[int] | torch.Tensor | None,
        pinned: bool | Sequence[Sequence[int]] | None,
        params: SamplingParams,
    ) -> CanvasDraft | None:
        """A request's starting canvas and pins, validated against this model (``canvas_draft.canvas_draft``,
        docs/edit-in-place.md); None without a draft. ValueError naming the field."""
        return _canvas_draft(initial_canvas, pinned, params, self._draft_rules())

    def _draft_rules(self) -> DraftRules:
        c = self.model.config
        return DraftRules(c.canvas_length, c.vocab_size, self.eos_ids, self.tokenizer)

    def request_prompt_ids(self, prompt: Prompt, max_new_tokens: int) -> list[int]:
        """Token ids of a request's prompt, which must fit in the context window with the canvases generated
        after it; ValueError with both numbers (``check_context``) as soon as that is known, with bounded work."""
        room = self.max_model_len - self.canvases(max_new_tokens) * self.model.config.canvas_length
        try:
            ids = self.prompt_ids(prompt, max_tokens=max(room, 0))
        except PromptTooLongError as e:
            self.check_context(e.at_least, max_new_tokens, at_least=True)
            raise
        self.check_context(len(ids), max_new_tokens)
        return ids

    def room_left(self, prompt_tokens: int, params: SamplingParams) -> int:
        """The most tokens a request of ``prompt_tokens`` may generate: the whole canvases left in its context (the
        window, or the KV cache slot when that is smaller), and at most ``max_request_steps`` of work."""
        C: int = self.model.config.canvas_length
        canvases = (min(self.max_model_len, self.runner.slot_len) - prompt_tokens) // C
        if self.max_request_steps is not None:
            canvases = min(canvases, self.max_request_steps // params.max_denoising_steps)
        return int(max(1, canvases) * C)

    def canvases(self, max_new_tokens: int) -> int:
        """How many canvases (blocks) a request of ``max_new_tokens`` may generate: the ceiling of tokens / C."""
        return -(-max_new_tokens // self.model.config.canvas_length)

    def _check_stop_token_ids(self, params: SamplingParams) -> None:
        """ValueError naming ``stop_token_ids[i]`` for an id outside the vocabulary."""
        V = self.model.config.vocab_size
        for i, t in enumerate(params.stop_token_ids):
            if t >= V:
                raise ValueError(f"stop_token_ids[{i}]: token id {t} is outside the vocabulary [0, {V})")

    def check_work(self, params: SamplingParams) -> None:
        """ValueError naming the knobs when a request asks for more denoising steps than ``max_request_steps``."""
        limit = self.max_request_steps
        C = self.model.config.canvas_length
        canvases = self.canvases(params.max_new_tokens)
        work = params.max_denoising_steps * canvases
        if limit is not None and work > limit:
            raise ValueError(
                f"max_denoising_steps: {params.max_denoising_steps} steps x {canvases} canvases of {C} tokens "
                f"(max_new_tokens {params.max_new_tokens}) = {work} denoising steps, more than this server's limit "
                f"of {limit} per request (--max-request-steps); lower max_denoising_steps or max_new_tokens"
            )

    def check_context(self, prompt_tokens: int, max_new_tokens: int, at_least: bool = False) -> None:
        """ValueError (with both numbers) when the prompt plus the canvases generated do not fit."""
        C = self.model.config.canvas_length
        n_blocks = self.canvases(max_new_tokens)
        if prompt_tokens + n_blocks * C > self.max_model_len:
            raise ValueError(
                f"prompt: {'at least ' if at_least else ''}{prompt_tokens} tokens + {n_blocks} "
                f"canvases of {C} (max_new_tokens {max_new_tokens}) exceed the context window of "
                f"{self.max_model_len} positions"
            )
        self.runner.check_fits(prompt_tokens + n_blocks * C)

    def kv_cache_usage(self) -> float:
        """The fraction of the KV cache budget held, in [0, 1]: the running requests' positions and the prefix
        cache's blocks (``ModelRunner.kv_cache_usage``: a snapshot of host ints, safe to read from the metrics
        scrape while the engine thread steps)."""
        return self.runner.kv_cache_usage()

    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The prefix cache's bytes held, capacity and evictions (``ModelRunner.prefix_cache_stats``; None without
        prefix caching): safe to read from the metrics scrape."""
        return self.runner.prefix_cache_stats()


def check_request_id(value: str, field: str = "request_id") -> None:
    """ValueError naming ``field`` unless ``value`` is 1 to 256 printable characters. Ids end up in logs, metrics
    and error messages: no control characters (forged log lines), no megabyte ids. The message does not echo it."""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_REQUEST_ID_LENGTH:
        n = len(value) if isinstance(value, str) else type(value).__name__
        raise ValueError(f"{field}: must be 1 to {MAX_REQUEST_ID_LENGTH} printable characters, got {n}")
    if not value.isprintable():
        bad = next(c for c in value if not c.isprintable())
        raise ValueError(
            f"{field}: must be 1 to {MAX_REQUEST_ID_LENGTH} printable characters, got {bad!r} at "
            f"index {value.index(bad)}"
        )


def _check_max_model_len(value: int | None, limit: int) -> int:
    if value is None:
        return limit
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
        raise ValueError(
            f"max_model_len must be an integer in [1, {limit}] (the model's max_position_embeddings), got {value!r}"
        )
    return value


def _as_tuple(x: object) -> tuple[Any, ...]:
    if x is None:
        return ()
    return tuple(x) if isinstance(x, (list, tuple)) else (x,)
