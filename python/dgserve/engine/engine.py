"""The generation engine: requests in, committed blocks out (docs/generation.md, docs/architecture.md).

``Engine.step()`` is one iteration of continuous batching, planned by the ``Scheduler``: waiting requests are
admitted into free running slots, prompt prefill advances by fixed-size chunks (so one long prompt cannot stall
the others), every running canvas whose prompt is encoded advances one denoising step in one batched decoder
call, and finished blocks are committed (their tokens are encoded before the next block starts). ``generate``,
``generate_batch`` and ``stream`` are loops over it. A request's tokens never depend on what it is batched with:
the noise is keyed per request, the model does fixed-shape work per row, and prefill chunk boundaries depend on
the prompt alone (docs/exactness.md).

One request is one ``Request`` object (dgserve.engine.request), checked and minted once by the ``Admission``
(dgserve.engine.admission; ``make_request`` and ``prompt_ids`` are the engine's entry points into it), queued and
planned by the ``Scheduler``, given a cache slot and knob tensors by the ``ModelRunner``, and returned to the caller
in each ``StepOutput``. The engine keeps add, abort, step (admit → prefix match → plan → run → commit) and commit.

A request fails alone, by construction (``isolation``): ``step`` runs each request's own work (admission, its
prompt chunks, a block's start, its commit) through ``_alone``, which ends only that request (``Request.error``,
reported in ``StepOutput.failed``) and frees its slot; only the shared work (scheduling, slot bookkeeping, the
batched denoising pass) can raise out of ``step``, as a ``SharedWorkError`` naming the phase: an engine fault.

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
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from dgserve.engine import request_checks as checks
from dgserve.engine.admission import Admission
from dgserve.engine.cache_config import CacheConfig
from dgserve.engine.cpu_threads import follow_torch_threads
from dgserve.engine.host_malloc import apply_host_malloc
from dgserve.engine.image_batch import chunk_images, default_image_token_cost, encode_planned
from dgserve.engine.isolation import alone, cached_prefix, grammar_failure, shared, together
from dgserve.engine.loading import eos_ids, load_checkpoint, runtime_info
from dgserve.engine.model_runner import ModelRunner
from dgserve.engine.prefix_cache import KV, PrefixCacheStats
from dgserve.engine.prompt import Prompt, Submission
from dgserve.engine.request import FinishedKeys, Request
from dgserve.engine.scheduler import Scheduler, SchedulerConfig
from dgserve.engine.step_output import StepOutput, cancelled_block, commit_block, timed_out_block
from dgserve.model import DiffusionGemma
from dgserve.outputs import FINISH_CANCELLED, FINISH_ERROR, BlockOutput, GenerationResult
from dgserve.sampling_params import SamplingParams

if TYPE_CHECKING:  # imported lazily at run time (from_pretrained), only when a checkpoint has one
    from dgserve.model.runtime import RuntimePlan
    from dgserve.structured.grammar import GrammarCompiler
    from dgserve.text.tokenizer import Tokenizer

log = logging.getLogger("dgserve.engine.engine")


class Engine:
    """Runs DiffusionGemma generation for many concurrent requests on one device.

    defaults: the checkpoint's SamplingParams (``SamplingParams.from_generation_config``; None: the built-in
    ones), what ``default_params`` and a request without params start from. max_model_len: the context window
    (prompt + generated canvases), at most the model's max_position_embeddings (the default; more only with
    allow_long_max_model_len, which logs a warning). scheduler_config:
    capacity and prefill chunking. eos_token_ids: the end-of-sequence ids (generation_config.json's); empty or
    None: config.json's. cache_config: the KV cache budget (``ModelRunner``), which may lower max_num_seqs to
    the slots that fit. max_request_steps: the most denoising steps one request may run (all its canvases
    together), so that no request can hold a slot for hours: it then ends with finish reason "length", keeping
    what it committed; one canvas's max_denoising_steps above it is refused; None: no limit. max_request_seconds: the
    wall-clock time a request may run from its admission into a slot (its deadline ends it sooner); then it ends
    with finish reason "length", keeping what it committed; None: no limit. prefix_caching: keep the
    KV of full prompt chunks in what the slots leave of the cache budget and reuse it for prompts that start with
    the same tokens (docs/prefix-caching.md); a request's tokens are the same either way. default_max_tokens:
    the output limit of a request that sends none (``from_pretrained``: else generation_config.json's
    max_new_tokens, or its max_length counting the prompt, ``default_max_length``); max_tokens_policy: "clamp" (a
    limit above the room left in the context is lowered to it) or "reject" (refused naming the field)
    (``request_checks.OutputLimits``, docs/generation.md "Limits").
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
        default_max_tokens: int | None = None,
        max_tokens_policy: str = "clamp",
        default_max_length: int | None = None,
        allow_long_max_model_len: bool = False,
    ):
        from dgserve.ops.native_check import run_self_check

        self.model = model
        self.native_ops_mode = native_ops
        if model.device.type == "cpu":  # a CPU step's large tensors stay in the heap between steps (host_malloc)
            apply_host_malloc()
        # the self-check of the native ops (dgserve.ops.native_check): on CUDA, or whenever asked for (strict/off);
        # strict raises NativeOpsError here, before the engine serves anything
        self.native_report = (
            run_self_check(model.device, native_ops) if native_ops != "auto" or model.device.type == "cuda" else None
        )
        self.runtime: RuntimePlan | None = None  # the RuntimePlan when built by from_pretrained
        self.tokenizer = tokenizer
        self.defaults = defaults if defaults is not None else SamplingParams()
        if default_max_tokens is not None:  # the limit of a request that sends none (validated as the knob)
            self.defaults = dataclasses.replace(self.defaults, max_new_tokens=default_max_tokens)
        output_limits = checks.OutputLimits(max_tokens_policy, default_max_tokens, default_max_length)
        cfg = model.config
        self.max_request_steps = max_request_steps
        checks.check_max_request_seconds(max_request_seconds)
        self.max_model_len = checks.check_max_model_len(
            max_model_len, cfg.max_position_embeddings, allow_long_max_model_len
        )
        sched = scheduler_config or SchedulerConfig()
        if sched.image_token_cost is None:  # the device's default (docs/images.md, "Bounded like text")
            sched = dataclasses.replace(sched, image_token_cost=default_image_token_cost(model))
        if sched.fair_step_canvases is None:  # callers share the compute where it grows with the canvases of a step
            sched = dataclasses.replace(sched, fair_step_canvases=0 if model.batch_rows else 1)
        self.runner = ModelRunner(
            model, sched.max_num_seqs, self.max_model_len, sched.prefill_chunk, cache_config, prefix_caching
        )
        runner = self.runner  # a request's positions: at most the window, as the KV budget allows (slot_len)
        limits = (cfg.canvas_length, cfg.vocab_size, self.max_model_len, runner.slot_len, max_request_steps)
        # every check a request meets before it is queued, and its minting (thread-safe: no lock needed)
        bounds = checks.RequestLimits(*limits, runner.prefill_chunk)
        eos = eos_ids(eos_token_ids, cfg.eos_token_id)
        prefixes = runner.prefix is not None
        self.admission = Admission(model, tokenizer, self.defaults, eos, bounds, prefixes, output_limits=output_limits)
        self.admission.time_limit = max_request_seconds
        if self.runner.num_slots < sched.max_num_seqs:  # the cache budget caps the running requests
            sched = dataclasses.replace(sched, max_num_seqs=self.runner.num_slots)
        self.scheduler = Scheduler(sched)
        self._finished = FinishedKeys()  # the keys of recently finished requests
        # the one lock: scheduler tables, request status, finished ids (reentrant: a request failing alone is ended
        # under it from work that may already hold it, the commit)
        self._lock = threading.RLock()

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        device: torch.device | str = "cpu",
        dtype: torch.dtype | str | None = None,
        hf_overrides: dict[str, Any] | str | None = None,
        **kwargs: Any,
    ) -> Engine:
        """Model + tokenizer (when the directory has tokenizer.json) + generation_config.json's defaults and EOS
        ids (``loading.load_checkpoint``: a bad default or a dtype that does not fit is a ConfigError before the
        weights load); kwargs go to ``Engine.__init__`` (scheduler_config, max_model_len, native_ops). dtype None or
        "auto": bfloat16 on CUDA, float32 on the CPU (``dgserve.model.runtime``). hf_overrides: a JSON object (or its
        text) deep-merged into config.json before it is parsed (vLLM's name; docs/generation.md, "Configuration")."""
        ckpt = load_checkpoint(path, device, dtype, kwargs.get("native_ops", "auto"), hf_overrides)
        if kwargs.get("default_max_tokens") is None:  # the operator's default, else the checkpoint's
            kwargs["default_max_tokens"], kwargs["default_max_length"] = ckpt.output_limits
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

    @property
    def eos_ids(self) -> frozenset[int]:
        """The ids that end an output: what each new request's output rules use (``Admission.eos_ids``; settable)."""
        return self.admission.eos_ids

    @eos_ids.setter
    def eos_ids(self, ids: frozenset[int]) -> None:
        self.admission.eos_ids = ids

    @property
    def max_request_seconds(self) -> float | None:
        """The seconds a request may run from its admission into a slot (``Admission.time_limit``; settable)."""
        return self.admission.time_limit

    @max_request_seconds.setter
    def max_request_seconds(self, seconds: float | None) -> None:
        self.admission.time_limit = seconds

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
        """Validate a submission and mint its request (``Admission.make_request``, which says what its fields and
        ``deadline`` mean): the engine's public entry point into its admission, for ``add``. Thread-safe; raises
        ValueError naming the bad field."""
        return self.admission.make_request(sub, deadline=deadline)

    def add(self, req: Request) -> Request:
        """Queue a request made by ``make_request`` (or ``Admission.mint``). Raises ``DuplicateRequestError`` (a
        ValueError) for an id in flight and ``QueueFullError`` when running slots and queue are full."""
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
            self._finished.add(req.key)
            return req

    def recently_finished(self, request_id: str, owner: str | None = None) -> bool:
        """True when ``owner``'s request ``request_id`` finished or was aborted recently."""
        with self._lock:
            return (owner, request_id) in self._finished

    def in_flight(self) -> list[Request]:
        """The requests queued or running now."""
        with self._lock:
            return self.scheduler.requests()

    def has_unfinished(self) -> bool:
        """Whether a step has work: requests queued or running, or slots still held by requests that finished or
        were aborted after the last step's slot release (an abort from another thread while a step runs), which the
        next step frees (``ModelRunner.release_finished``)."""
        return len(self.scheduler) > 0 or self.runner.holds_finished()

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
        """One engine iteration: the scheduler admits (ending the requests whose time is up), the prefix cache is
        matched for the admitted requests, the scheduler plans; then run: admit into slots, encode the planned
        prompt chunks (their images first, in one vision tower call: ``encode_planned``), one denoising step for
        every running canvas whose prompt is encoded; then commit finished blocks. Each request's own work runs
        through ``_alone`` (its failure ends that request); the shared work through ``shared`` (its failure raises
        ``SharedWorkError``: an engine fault)."""
        out = StepOutput()
        follow_torch_threads()  # the native ops on this thread use torch's thread count (engine/cpu_threads.py)
        with self._lock:
            plan = shared("scheduling", self.scheduler.admit)
            hits = self._match_prefixes(plan.admitted)
            shared("scheduling", lambda: self.scheduler.plan(plan))
            for req in plan.expired:  # its deadline passed while queued: an empty "cancelled" block
                out.blocks.append((req, cancelled_block(req)))
            for req in plan.timed_out:  # its time is up while running: "length", keeping what it committed
                out.blocks.append((req, timed_out_block(req)))
            for req in (*plan.expired, *plan.timed_out):
                self._finished.add(req.key)
        # parked for another caller's fair share (their KV set aside), then aborted or timed out since the last
        # step: their slots are free before admission
        self._alone("parking", plan.parked, self.runner.park, out)
        shared("slot release", self.runner.release_finished)
        out.admitted = self._alone("admission", plan.admitted, lambda r: self.runner.admit(r, hits.get(r)), out)
        self._alone("resumption", plan.resumed, self.runner.resume, out)
        # the images of every planned chunk in one tower call; its failure leaves each request to encode its own
        feats = encode_planned(self.model, plan.prefill)
        chunks = list(zip(plan.prefill, feats, strict=True))
        stacked = self._prefill_stacked([c for c, emb in chunks if emb is None], out)
        for (req, start, end), emb in chunks:
            if req not in stacked:
                work = functools.partial(self.runner.prefill, start=start, end=end, image_embeds=emb)
                self._alone("prefill", [req], work, out)
        starting = [r for r in plan.decode if r.block is None]
        pending = [r for r in starting if r.pending is not None and not r.finished]
        if len(pending) > 1 and self.runner.can_stack():  # their committed blocks in one stacked pass
            together("block start", pending, lambda: self.runner.encode_pending(pending))
        self._alone("block start", starting, self.runner.start_block, out)
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
                for req in [r for r in active if not r.finished and r.out_of_steps]:  # "length", keeping its blocks
                    out.blocks.append((req, timed_out_block(req, "its denoising steps reached --max-request-steps")))
                    self.scheduler.finish(req.key)
                    self._finished.add(req.key)
        shared("slot release", self.runner.release_finished)
        return out

    def _prefill_stacked(self, chunks: list[tuple[Request, int, int]], out: StepOutput) -> set[Request]:
        """The planned text-only prompt chunks (no image among their tokens) of requests in flight, encoded in one
        stacked pass when there are several and the runner can (``ModelRunner.prefill_stacked``), then each offered
        to the prefix cache alone; the requests so encoded. When the pass fails, none is (each is encoded alone)."""
        text = [(r, s, e) for r, s, e in chunks if not r.finished and not chunk_images(r, s, e)]
        if len(text) < 2 or not self.runner.can_stack():
            return set()
        if not together("prefill", [r for r, _, _ in text], lambda: self.runner.prefill_stacked(text)):
            return set()
        for req, start, end in text:
            self._alone("prefill", [req], functools.partial(self.runner.offer_prefix, start=start, end=end), out)
        return {r for r, _, _ in text}

    def _alone(
        self, phase: str, reqs: Sequence[Request], work: Callable[[Request], object], out: StepOutput
    ) -> list[Request]:
        """``work(req)`` for each request still in flight, each on its own (``isolation.alone``): an exception ends
        that request alone, reported in ``out.failed``. Returns the requests whose work succeeded."""
        return alone(phase, reqs, work, lambda req, failure: self._fail(req, failure, out))

    def _match_prefixes(self, admitted: list[Request]) -> dict[Request, list[KV]]:
        """The prefix cache's hit for each request admitted now (``ModelRunner.match_prefix``; ``admit`` copies it
        into the slot) and its ``cached_tokens``, where ``Scheduler.plan`` starts its prefill. A lookup that raises
        costs that request its reuse only (``isolation.cached_prefix``)."""
        if self.runner.prefix is None:
            return {}
        hits = {}
        for req in admitted:
            hit = hits[req] = cached_prefix(self.runner.match_prefix, req)
            req.cached_tokens = len(hit) * self.runner.prefill_chunk
        return hits

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
            self._finished.add(req.key)
            out.failed.append(req)

    def _commit(self, req: Request) -> BlockOutput:
        """Commit ``req``'s block (``step_output.commit_block``); its last one finishes it. Under the lock."""
        block = commit_block(req)
        if block.finish_reason is not None:
            self.scheduler.finish(req.key)
            self._finished.add(req.key)
        return block

    # ------------------------------------------------------------------ what the engine reports

    def prompt_ids(self, prompt: Prompt, max_tokens: int | None = None) -> list[int]:
        """Token ids of a prompt (text, ids or chat), validated against the vocabulary, with bounded work past
        ``max_tokens`` (``Admission.prompt_ids``): the engine's public entry point for tokenizing. Thread-safe."""
        return self.admission.prompt_ids(prompt, max_tokens)

    def _grammar_compiler(self) -> GrammarCompiler:
        """The engine's compiled-grammar cache (``GrammarRows.compiler``), built on the first structured request."""
        return self.admission.grammars.compiler()

    def kv_cache_usage(self) -> float:
        """The fraction of the KV cache budget held, in [0, 1]: the running requests' positions and the prefix
        cache's blocks (``ModelRunner.kv_cache_usage``: a snapshot of host ints, safe to read from the metrics
        scrape while the engine thread steps)."""
        return self.runner.kv_cache_usage()

    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The prefix cache's bytes held, capacity and evictions (``ModelRunner.prefix_cache_stats``; None without
        prefix caching): safe to read from the metrics scrape."""
        return self.runner.prefix_cache_stats()
