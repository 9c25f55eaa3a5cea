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

A request fails alone, by construction (``isolation``): ``step`` runs each request's own work (admission, its
prompt chunks, a block's start, its commit) through ``_alone``, which ends only that request (``Request.error``,
reported in ``StepOutput.failed``) and frees its slot; only the shared work (scheduling, slot bookkeeping, the
batched denoising pass) can raise out of ``step``, as a ``SharedWorkError`` naming the phase: an engine fault.
Requests are checked before they are minted (``request_checks``: a ValueError naming the field).

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
from typing import TYPE_CHECKING, Any

import torch

from dgserve.engine import request_checks as checks
from dgserve.engine.block import CanvasDraft
from dgserve.engine.cache_config import CacheConfig
from dgserve.engine.canvas_draft import DraftRules
from dgserve.engine.canvas_draft import canvas_draft as _canvas_draft
from dgserve.engine.grammar_rows import GrammarRows
from dgserve.engine.image_batch import default_image_token_cost, encode_planned, image_spans
from dgserve.engine.isolation import alone, cached_prefix, grammar_failure, shared
from dgserve.engine.loading import load_checkpoint, runtime_info
from dgserve.engine.model_runner import ModelRunner
from dgserve.engine.prefix_cache import PrefixCacheStats, prefix_hashes
from dgserve.engine.prefix_cache import cache_salt as _cache_salt
from dgserve.engine.prompt import Prompt, Submission, with_tools
from dgserve.engine.request import Request, RequestKey
from dgserve.engine.scheduler import Scheduler, SchedulerConfig
from dgserve.engine.step_output import (
    DraftOutput,
    StepOutput,
    cancelled_block,
    commit_block,
    draft,
    output_rules,
    timed_out_block,
)
from dgserve.model import DiffusionGemma
from dgserve.outputs import FINISH_CANCELLED, FINISH_ERROR, BlockOutput, GenerationResult
from dgserve.sampling_params import SamplingParams
from dgserve.text.token_bounds import PromptTooLongError

if TYPE_CHECKING:  # imported lazily at run time (from_pretrained), only when a checkpoint has one
    from dgserve.model.runtime import RuntimePlan
    from dgserve.structured.grammar import GrammarCompiler
    from dgserve.text.tokenizer import Tokenizer

REMEMBER_FINISHED = 10_000  # finished ids kept for Abort's "already finished" answer
log = logging.getLogger("dgserve.engine.engine")


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
        checks.check_max_request_seconds(max_request_seconds)
        self.max_request_seconds = max_request_seconds
        self.max_model_len = checks.check_max_model_len(max_model_len, cfg.max_position_embeddings)
        sched = scheduler_config or SchedulerConfig()
        if sched.image_token_cost is None:  # the device's default (docs/images.md, "Bounded like text")
            sched = dataclasses.replace(sched, image_token_cost=default_image_token_cost(model))
        if sched.fair_step_canvases is None:  # callers share the compute where it grows with the canvases of a step
            sched = dataclasses.replace(sched, fair_step_canvases=0 if model.batch_rows else 1)
        self.runner = ModelRunner(
            model, sched.max_num_seqs, self.max_model_len, sched.prefill_chunk, cache_config, prefix_caching
        )
        slot_len = self.runner.slot_len  # a request's positions: at most the window, as the KV budget allows
        self.limits = checks.RequestLimits(
            cfg.canvas_length, cfg.vocab_size, self.max_model_len, slot_len, max_request_steps
        )
        if self.runner.num_slots < sched.max_num_seqs:  # the cache budget caps the running requests
            sched = dataclasses.replace(sched, max_num_seqs=self.runner.num_slots)
        # the prefix cache's hit for a request at its admission; a lookup that raises costs that request its reuse only
        self.scheduler = Scheduler(sched, cached_prefix=self._cached_prefix if prefix_caching else None)
        self._finished_ids: OrderedDict[RequestKey, None] = OrderedDict()  # recently finished keys
        self._ids = itertools.count()
        # the one lock: scheduler tables, request status, finished ids (reentrant: a request failing alone is ended
        # under it from work that may already hold it, the commit)
        self._lock = threading.RLock()
        self._draft_rules = DraftRules(cfg.canvas_length, cfg.vocab_size, self.eos_ids, tokenizer)
        self._grammars = GrammarRows(tokenizer, cfg.vocab_size, cfg.canvas_length, self.eos_ids)

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        device: torch.device | str = "cpu",
        dtype: torch.dtype | str | None = None,
        **kwargs: Any,
    ) -> Engine:
        """Model + tokenizer (when the directory has tokenizer.json) + generation_config.json's defaults and EOS
        ids (``loading.load_checkpoint``: a bad default or a dtype that does not fit is a ConfigError before the
        weights load); kwargs go to ``Engine.__init__`` (scheduler_config, max_model_len, native_ops). dtype None or
        "auto": bfloat16 on CUDA, float32 on the CPU (``dgserve.model.runtime``)."""
        ckpt = load_checkpoint(path, device, dtype, kwargs.get("native_ops", "auto"))
        engine = cls(ckpt.model, ckpt.tokenizer, ckpt.defaults, eos_token_ids=ckpt.eos_token_ids, **kwargs)
        engine.runtime = plan = ckpt.plan
        native = engine.runtime_info()["native_ops"] or "none"
        what = (plan.device, plan.dtype, plan.dtype_reason, plan.expert_format, native)
        log.info("serving %s on %s: dtype %s (%s), experts %s, native ops %s", path, *what)
        return engine

    def runtime_info(self) -> dict[str, Any]:
        """device, dtype, expert format, native-ops mode, the native ops active on the device (after the
        self-check) and those switched off with why (``loading.runtime_info``): for the start-up log and
        GetModelInfo."""
        return runtime_info(self.model, self.runtime, self.native_ops_mode)

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
            checks.check_request_id(request_id)
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
        checks.check_stop_token_ids(params, self.model.config.vocab_size)
        draft = self.canvas_draft(sub.initial_canvas, sub.pinned, params)
        tracker = output_rules(params, prompt, draft, self.eos_ids, self.tokenizer)
        grammar = self._grammars.row(params)
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
            caller=sub.caller if sub.caller is not None else owner,
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
        work runs through ``_alone`` (its failure ends that request); the shared work through ``shared`` (its
        failure raises ``SharedWorkError``: an engine fault)."""
        out = StepOutput()
        with self._lock:
            plan = shared("scheduling", self.scheduler.schedule)
            for req in plan.expired:  # its deadline passed while queued: an empty "cancelled" block
                out.blocks.append((req, cancelled_block(req)))
            for req in plan.timed_out:  # its time is up while running: "length", keeping what it committed
                out.blocks.append((req, timed_out_block(req)))
            for req in (*plan.expired, *plan.timed_out):
                self._remember_finished(req)
        # parked for another caller's fair share (their KV set aside), then aborted or timed out since the last
        # step: their slots are free before admission
        self._alone("parking", plan.parked, self.runner.park, out)
        shared("slot release", self.runner.release_finished)
        out.admitted = self._alone("admission", plan.admitted, self.runner.admit, out)
        self._alone("resumption", plan.resumed, self.runner.resume, out)
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
            shared(f"the batched denoising pass over {len(active)} requests", lambda: self.runner.run(active))
            dt = time.perf_counter() - t0
            out.stepped = active
            with self._lock:
                for req in active:
                    req.denoise_seconds += dt
                done = [r for r in active if not r.finished and not self._failed_alone(r, out) and r.block_done]
                self._alone("commit", done, lambda r: out.blocks.append((r, self._commit(r))), out)
        shared("slot release", self.runner.release_finished)
        return out

    def _alone(
        self, phase: str, reqs: Sequence[Request], work: Callable[[Request], object], out: StepOutput
    ) -> list[Request]:
        """``work(req)`` for each request still in flight, each on its own (``isolation.alone``): an exception ends
        that request alone, reported in ``out.failed``. Returns the requests whose work succeeded."""
        return alone(phase, reqs, work, lambda req, failure: self._fail(req, failure, out))

    def _cached_prefix(self, req: Request) -> int:
        """``isolation.cached_prefix`` over the runner's lookup: its exception costs ``req`` its reuse only."""
        return cached_prefix(self.runner.match_prefix, req)

    def _failed_alone(self, req: Request, out: StepOutput) -> bool:
        """End ``req`` when its own state failed (its grammar: ``isolation.grammar_failure``); True when it did."""
        error = grammar_failure(req)
        if error is not None:
            self._fail(req, error, out)
        return error is not None

    def _fail(self, req: Request, error: Exception, out: StepOutput) -> None:
        """Finish ``req`` with ``error`` and report it in ``out.failed`` (its slot is freed by
        ``release_finished``). Takes the (reentrant) lock."""
        with self._lock:
            req.error, req.block = error, None
            req.tracker.finish_reason = req.tracker.finish_reason or FINISH_ERROR
            self.scheduler.abort(req.key)
            self._remember_finished(req)
            out.failed.append(req)

    def draft(self, req: Request) -> DraftOutput | None:
        """The request's current block after its latest denoising step, or None between blocks
        (``step_output.draft``). Call from the thread that runs ``step``."""
        return draft(req)

    def _commit(self, req: Request) -> BlockOutput:
        """Commit ``req``'s block (``step_output.commit_block``); its last one finishes it. Under the lock."""
        block = commit_block(req)
        if block.finish_reason is not None:
            self.scheduler.finish(req.key)
            self._remember_finished(req)
        return block

    # ------------------------------------------------------------------ validation

    def _grammar_compiler(self) -> GrammarCompiler:
        """The engine's compiled-grammar cache (``GrammarRows.compiler``), built on the first structured request."""
        return self._grammars.compiler()

    def prompt_ids(self, prompt: Prompt, max_tokens: int | None = None) -> list[int]:
        """Token ids of a prompt (text, ids or chat), validated against the vocabulary, with bounded work past
        ``max_tokens`` (``request_checks.prompt_ids``). Thread-safe."""
        return checks.prompt_ids(prompt, self.model, self.tokenizer, self.runner.prefill_chunk, max_tokens)

    def canvas_draft(
        self,
        initial_canvas: str | Sequence[int] | torch.Tensor | None,
        pinned: bool | Sequence[Sequence[int]] | None,
        params: SamplingParams,
    ) -> CanvasDraft | None:
        """A request's starting canvas and pins, validated against this model (``canvas_draft.canvas_draft``,
        docs/edit-in-place.md); None without a draft. ValueError naming the field."""
        return _canvas_draft(initial_canvas, pinned, params, self._draft_rules)

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
        """The most tokens a request of ``prompt_tokens`` may generate (``request_checks.room_left``)."""
        return checks.room_left(self.limits, prompt_tokens, params)

    def canvases(self, max_new_tokens: int) -> int:
        """How many canvases (blocks) a request of ``max_new_tokens`` may generate: the ceiling of tokens / C."""
        return checks.canvases(self.limits, max_new_tokens)

    def check_work(self, params: SamplingParams) -> None:
        """ValueError naming the knobs when a request asks for more denoising steps than ``max_request_steps``."""
        checks.check_work(self.limits, params)

    def check_context(self, prompt_tokens: int, max_new_tokens: int, at_least: bool = False) -> None:
        """ValueError (with both numbers) when the prompt plus the canvases generated do not fit the context
        window or a KV cache slot."""
        self.runner.check_fits(checks.check_context(self.limits, prompt_tokens, max_new_tokens, at_least))

    def kv_cache_usage(self) -> float:
        """The fraction of the KV cache budget held, in [0, 1]: the running requests' positions and the prefix
        cache's blocks (``ModelRunner.kv_cache_usage``: a snapshot of host ints, safe to read from the metrics
        scrape while the engine thread steps)."""
        return self.runner.kv_cache_usage()

    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The prefix cache's bytes held, capacity and evictions (``ModelRunner.prefix_cache_stats``; None without
        prefix caching): safe to read from the metrics scrape."""
        return self.runner.prefix_cache_stats()


def _as_tuple(x: object) -> tuple[Any, ...]:
    if x is None:
        return ()
    return tuple(x) if isinstance(x, (list, tuple)) else (x,)
