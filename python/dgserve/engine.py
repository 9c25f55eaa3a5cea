"""The generation engine: requests in, committed blocks out (spec §4, DESIGN Contracts).

``Engine.step()`` is one iteration of continuous batching, planned by the ``Scheduler``: waiting requests are
admitted into free running slots, prompt prefill advances by fixed-size chunks (so one long prompt cannot stall
the others), every running canvas whose prompt is encoded advances one denoising step in one batched decoder
call, and finished blocks are committed (their tokens are encoded before the next block starts). ``generate``,
``generate_batch`` and ``stream`` are loops over it. A request's tokens never depend on what it is batched with:
the noise is keyed per request, the model does fixed-shape work per row, and prefill chunk boundaries depend on
the prompt alone (DESIGN Decisions 3).

Thread safety: ``add_request`` and ``abort`` may be called from any thread while one thread runs ``step``; an
abort takes effect before the next step (the current one's result for that request is discarded).
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from dgserve.config import ConfigError, GenerationDefaults
from dgserve.model import DiffusionGemma, KVCache, RowCache
from dgserve.outputs import FINISH_CANCELLED, BlockOutput, BlockStats, GenerationResult, OutputTracker
from dgserve.sampler import BlockState, Sampler
from dgserve.sampling_params import SamplingParams
from dgserve.scheduler import ScheduleOutput, Scheduler, SchedulerConfig
from dgserve.token_bounds import PromptTooLongError

if TYPE_CHECKING:  # imported lazily at run time (from_pretrained), only when a checkpoint has one
    from dgserve.runtime import RuntimePlan
    from dgserve.structured.constrained import StructuredRow
    from dgserve.structured.grammar import GrammarCompiler
    from dgserve.tokenizer import Tokenizer

MAX_REQUEST_ID_LENGTH = 256
log = logging.getLogger("dgserve.engine")


@dataclass(frozen=True)
class ChatPrompt:
    """Chat messages ({"role", "content"} dicts, see ``Tokenizer.apply_chat_template``) as a prompt."""

    messages: tuple[dict[str, Any], ...]
    add_generation_prompt: bool = True
    enable_thinking: bool = False


Prompt = str | Sequence[int] | torch.Tensor | ChatPrompt


@dataclass(frozen=True)
class DraftOutput:
    """The current block's argmax canvas after its latest denoising step (a preview; may still change)."""

    index: int
    step: int
    token_ids: list[int]
    mean_entropy: float


@dataclass
class _Request:
    """Engine-side state of one request."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    tracker: OutputTracker
    row: RowCache = field(default_factory=RowCache)
    pending: list[int] | None = None  # committed tokens to encode before the next block
    block_index: int = 0
    state: BlockState | None = None
    structured: StructuredRow | None = None  # grammar state when params.response_format is set
    encode_seconds: float = 0.0
    denoise_seconds: float = 0.0
    blocks: list[BlockOutput] = field(default_factory=list)

    def result(self) -> GenerationResult:
        t = self.tracker
        if t.finish_reason is None:
            raise RuntimeError(f"request {self.request_id!r} has not finished")
        return GenerationResult(
            list(t.token_ids), t.text, t.finish_reason, self.seed, len(self.prompt_ids), list(self.blocks)
        )


class Engine:
    """Runs DiffusionGemma generation for many concurrent requests on one device.

    max_model_len: the context window (prompt + generated canvases), at most the model's
    max_position_embeddings (the default). scheduler_config: capacity and prefill chunking.
    """

    def __init__(
        self,
        model: DiffusionGemma,
        tokenizer: Tokenizer | None = None,
        defaults: GenerationDefaults | None = None,
        scheduler_config: SchedulerConfig | None = None,
        max_model_len: int | None = None,
        native_ops: str = "auto",
    ):
        from dgserve.native_check import run_self_check

        self.model = model
        self.native_ops_mode = native_ops
        # the self-check of the native ops (dgserve.native_check): on CUDA, or whenever asked for (strict/off);
        # strict raises NativeOpsError here, before the engine serves anything
        self.native_report = (
            run_self_check(model.device, native_ops) if native_ops != "auto" or model.device.type == "cuda" else None
        )
        self.runtime: RuntimePlan | None = None  # the RuntimePlan when built by from_pretrained
        self.tokenizer = tokenizer
        self.defaults = defaults or GenerationDefaults()
        try:  # a checkpoint default outside the request limits fails here, at load, not on the first request
            self.default_params()
        except ValueError as e:
            raise ConfigError(f"generation_config: {e}") from None
        cfg = model.config
        eos = self.defaults.eos_token_ids or _as_tuple(cfg.eos_token_id)
        self.eos_ids = frozenset(int(e) for e in eos)
        self.max_model_len = _check_max_model_len(max_model_len, cfg.max_position_embeddings)
        self.sampler = Sampler(model.dtype)
        self.scheduler = Scheduler(scheduler_config)
        self.last_schedule = ScheduleOutput()  # the plan of the latest step (admitted ids, ...)
        self._requests: dict[str, _Request] = {}
        self._finished: dict[str, GenerationResult] = {}  # results not yet collected by their caller
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._grammars: GrammarCompiler | None = None  # built on the first structured request

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        device: torch.device | str = "cpu",
        dtype: torch.dtype | str | None = None,
        **kwargs: Any,
    ) -> Engine:
        """Model + tokenizer (when the directory has tokenizer.json) + generation_config defaults; kwargs go
        to ``Engine.__init__`` (scheduler_config, max_model_len, native_ops).

        dtype None or "auto": bfloat16 on CUDA, float32 on the CPU (``dgserve.runtime``). A dtype whose weights do
        not fit the GPU raises ConfigError before anything is loaded."""
        from dgserve.runtime import check_plan, plan_runtime
        from dgserve.tokenizer import Tokenizer

        plan = plan_runtime(path, str(device), dtype, kwargs.get("native_ops", "auto"))
        check_plan(plan)
        model = DiffusionGemma.from_pretrained(path, device=device, dtype=plan.torch_dtype)
        tok = Tokenizer.from_pretrained(path) if os.path.exists(os.path.join(path, "tokenizer.json")) else None
        engine = cls(model, tok, GenerationDefaults.from_pretrained(path), **kwargs)
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
        """SamplingParams from the checkpoint's generation_config.json, with overrides."""
        d = self.defaults
        kw: dict[str, Any] = dict(
            max_new_tokens=d.max_new_tokens,
            max_denoising_steps=d.max_denoising_steps,
            t_min=d.t_min,
            t_max=d.t_max,
            entropy_bound=d.entropy_bound,
            stability_threshold=d.stability_threshold,
            confidence_threshold=d.confidence_threshold,
        )
        kw.update(overrides)
        return SamplingParams(**kw)

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
        ids = []
        try:
            for p, sp in zip(prompts, params_list, strict=True):
                ids.append(self.add_request(p, sp))
        except Exception:
            for rid in ids:
                self.abort(rid)
            raise
        results: dict[str, GenerationResult] = {}
        while len(results) < len(ids):
            for rid, block in self.step():
                if block.finish_reason is not None and rid in ids:
                    results[rid] = self._finished.pop(rid)
        return [results[i] for i in ids]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[BlockOutput]:
        """Yield each committed block of one request as soon as it is final; the last has finish_reason."""
        rid = self.add_request(prompt, params)
        try:
            while True:
                for r, block in self.step():
                    if r == rid:
                        yield block
                        if block.finish_reason is not None:
                            self._finished.pop(rid, None)
                            return
        finally:
            self.abort(rid)

    # ------------------------------------------------------------------ continuous batching core

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        deadline: float | None = None,
    ) -> str:
        """Validate and queue a request; returns its id.

        Raises ValueError naming the bad field, ``DuplicateRequestError`` (a ValueError) for an id in flight, and
        ``QueueFullError`` when running slots and queue are full. ``deadline`` (time.monotonic() seconds): a
        request still waiting then is dropped before any model work (its last block: finish_reason "cancelled").
        """
        params = params or self.default_params()
        if request_id is not None:
            check_request_id(request_id)
        prompt_ids = self.request_prompt_ids(prompt, params.max_new_tokens)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        seed = params.seed if params.seed is not None else secrets.randbits(64)
        tracker = OutputTracker(params.max_new_tokens, self.eos_ids, params.ignore_eos, params.stop, self.tokenizer)
        req = _Request(rid, prompt_ids, params, seed, tracker, structured=self._structured_row(params))
        with self._lock:
            self.scheduler.add(rid, len(prompt_ids), deadline)
            self._requests[rid] = req
        return rid

    def abort(self, request_id: str) -> bool:
        """Drop a queued or running request (frees its slot and cache before the next step); True if it was."""
        with self._lock:
            self.scheduler.abort(request_id)
            return self._requests.pop(request_id, None) is not None

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def take_result(self, request_id: str) -> GenerationResult | None:
        """Collect (and forget) the result of a finished request; None if there is none."""
        with self._lock:
            return self._finished.pop(request_id, None)

    def request_seed(self, request_id: str) -> int | None:
        """The seed in use by a queued or running request (drawn at random when its params had none)."""
        req = self._requests.get(request_id)
        return None if req is None else req.seed

    def step(self) -> list[tuple[str, BlockOutput]]:
        """One engine iteration: admit, encode planned prompt chunks, one denoising step for every running
        canvas whose prompt is encoded, commit finished blocks. Returns the blocks committed in this iteration
        (and an empty "cancelled" block for each queued request whose deadline passed)."""
        with self._lock:
            plan = self.last_schedule = self.scheduler.schedule()
            events = [(rid, self._expire(rid)) for rid in plan.expired if rid in self._requests]
            prefill = [(self._requests[rid], s, e) for rid, s, e in plan.prefill]
            active = [self._requests[rid] for rid in plan.decode]
        for req, start, end in prefill:
            self._encode(req, req.prompt_ids[start:end])
        if not active:
            return events
        states = [r.state if r.state is not None else self._start_block(r) for r in active]
        t0 = time.perf_counter()
        tiles = self.model.denoise(
            KVCache([r.row for r in active]),
            torch.stack([s.canvas for s in states]),
            self_cond_logits=[s.self_cond for s in states],
            tiled=True,
        )
        for s in states:  # consumed: free the previous step's [C, V] inputs before the new ones are made
            s.self_cond = None
        for rows, logits in tiles:  # LM head + sampler a tile of canvases at a time
            self.sampler.step(states[rows], logits)
        del tiles
        dt = time.perf_counter() - t0
        with self._lock:
            for req, state in zip(active, states, strict=True):
                req.denoise_seconds += dt
                if state.done and self._requests.get(req.request_id) is req:
                    events.append((req.request_id, self._commit(req)))
        return events

    def draft(self, request_id: str) -> DraftOutput | None:
        """The request's current block after its latest denoising step, or None between blocks. Call from the
        thread that runs ``step``."""
        req = self._requests.get(request_id)
        s = None if req is None else req.state
        if s is None or s.argmax is None or s.done:
            return None
        return DraftOutput(s.block, s.steps_run, s.argmax.tolist(), s.mean_entropy)

    def _encode(self, req: _Request, ids: list[int]) -> None:
        t0 = time.perf_counter()
        self.model.encode_row(torch.tensor(ids, dtype=torch.int64, device=self.model.device), req.row)
        req.encode_seconds += time.perf_counter() - t0

    def _start_block(self, req: _Request) -> BlockState:
        if req.pending is not None:
            req.encode_seconds = 0.0
            self._encode(req, req.pending)
        req.denoise_seconds, req.pending = 0.0, None
        cfg = self.model.config
        req.state = BlockState.start(
            req.seed, req.block_index, req.params, cfg.canvas_length, cfg.vocab_size, self.model.device
        )
        if req.structured is not None:  # structured output: the grammar rides on the block (sampler hooks)
            req.state.structured = req.structured
            req.structured.start_block(req.state)
        return req.state

    def _commit(self, req: _Request) -> BlockOutput:
        s = req.state
        if s is None or s.argmax is None:
            raise RuntimeError(f"request {req.request_id!r}: commit before its block ran a step")
        canvas = s.argmax.tolist()  # the committed block is the ARGMAX canvas of the last step run
        toks, text = req.tracker.add_block(canvas)
        stats = BlockStats(
            s.steps_run, len(toks) / s.steps_run, s.mean_entropy, req.encode_seconds, req.denoise_seconds
        )
        block = BlockOutput(req.block_index, toks, text, stats, req.tracker.finish_reason)
        req.blocks.append(block)
        req.state, req.block_index, req.pending = None, req.block_index + 1, canvas
        if block.finish_reason is not None:
            del self._requests[req.request_id]
            self.scheduler.finish(req.request_id)
            self._finished[req.request_id] = req.result()
        return block

    def _expire(self, rid: str) -> BlockOutput:
        req = self._requests.pop(rid)
        req.tracker.finish_reason = FINISH_CANCELLED
        self._finished[rid] = req.result()
        return BlockOutput(0, [], "", BlockStats(0, 0.0, float("nan"), 0.0, 0.0), FINISH_CANCELLED)

    # ------------------------------------------------------------------ validation

    def compile_response_format(self, params: SamplingParams) -> None:
        """Compile params.response_format into the grammar cache (thread-safe; a no-op without one), so that
        ``add_request`` finds it there; ValueError naming response_format when it cannot be served."""
        if params.response_format is not None:
            self._grammar_compiler().grammar(params.response_format)

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
        ValueError naming response_format when the model has no tokenizer or the format does not compile."""
        if params.response_format is None:
            return None
        from dgserve.structured.constrained import StructuredRow

        grammars = self._grammar_compiler()
        return StructuredRow(grammars.matcher(params.response_format), self.model.config.vocab_size, self.eos_ids)

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
                ids = tok.encode_chat(
                    list(prompt.messages), prompt.add_generation_prompt, prompt.enable_thinking, max_tokens=max_tokens
                )
        else:
            ids = [int(t) for t in (prompt.tolist() if isinstance(prompt, torch.Tensor) else prompt)]
            if max_tokens is not None and len(ids) > max_tokens:
                raise PromptTooLongError(len(ids), max_tokens, "given")
        V = self.model.config.vocab_size
        if not ids:
            raise ValueError("prompt: must contain at least one token")
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise ValueError(f"prompt: token id {bad[0]} is outside the vocabulary [0, {V})")
        return ids

    def request_prompt_ids(self, prompt: Prompt, max_new_tokens: int) -> list[int]:
        """Token ids of a request's prompt, which must fit in the context window with the canvases generated
        after it; ValueError with both numbers (``check_context``) as soon as that is known, with bounded work."""
        C = self.model.config.canvas_length
        room = self.max_model_len - -(-max_new_tokens // C) * C
        try:
            ids = self.prompt_ids(prompt, max_tokens=max(room, 0))
        except PromptTooLongError as e:
            self.check_context(e.at_least, max_new_tokens, at_least=True)
            raise
        self.check_context(len(ids), max_new_tokens)
        return ids

    def check_context(self, prompt_tokens: int, max_new_tokens: int, at_least: bool = False) -> None:
        """ValueError (with both numbers) when the prompt plus the canvases generated do not fit."""
        C = self.model.config.canvas_length
        n_blocks = -(-max_new_tokens // C)
        if prompt_tokens + n_blocks * C > self.max_model_len:
            raise ValueError(
                f"prompt: {'at least ' if at_least else ''}{prompt_tokens} tokens + {n_blocks} "
                f"canvases of {C} (max_new_tokens {max_new_tokens}) exceed the context window of "
                f"{self.max_model_len} positions"
            )


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
