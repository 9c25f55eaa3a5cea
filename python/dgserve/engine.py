"""The generation engine: requests in, committed blocks out (spec §4, DESIGN Contracts).

``Engine.step()`` is one iteration of continuous batching: requests that need it are encoded (prompt
prefill, or the block they just committed), then every active canvas advances one denoising step in
one batched decoder call, and finished blocks are committed. ``generate``, ``generate_batch`` and
``stream`` are loops over it. A request's tokens never depend on what it is batched with: the noise
is keyed per request and the model does fixed-shape work per row (DESIGN Decisions 3).
"""
from __future__ import annotations

import itertools
import os
import secrets
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from dgserve.config import GenerationDefaults
from dgserve.model import DiffusionGemma, KVCache, RowCache
from dgserve.outputs import BlockOutput, BlockStats, GenerationResult, OutputTracker
from dgserve.sampler import BlockState, Sampler
from dgserve.sampling_params import SamplingParams

Prompt = str | Sequence[int] | torch.Tensor


@dataclass
class _Request:
    """Engine-side state of one request."""
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    tracker: OutputTracker
    row: RowCache = field(default_factory=RowCache)
    pending: list[int] | None = None        # tokens to encode before the next block
    block_index: int = 0
    state: BlockState | None = None
    encode_seconds: float = 0.0
    denoise_seconds: float = 0.0
    blocks: list[BlockOutput] = field(default_factory=list)

    def result(self) -> GenerationResult:
        t = self.tracker
        return GenerationResult(list(t.token_ids), t.text, t.finish_reason, self.seed, len(self.prompt_ids),
                                list(self.blocks))


class Engine:
    """Runs DiffusionGemma generation for many concurrent requests on one device."""

    def __init__(self, model: DiffusionGemma, tokenizer=None, defaults: GenerationDefaults | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.defaults = defaults or GenerationDefaults()
        cfg = model.config
        eos = self.defaults.eos_token_ids or _as_tuple(cfg.eos_token_id)
        self.eos_ids = frozenset(int(e) for e in eos)
        self.sampler = Sampler(model.dtype)
        self._requests: dict[str, _Request] = {}
        self._finished: dict[str, GenerationResult] = {}   # results not yet collected by their caller
        self._ids = itertools.count()

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, device: torch.device | str = "cpu",
                        dtype: torch.dtype = torch.float32) -> "Engine":
        """Model + tokenizer (when the directory has tokenizer.json) + generation_config defaults."""
        from dgserve.tokenizer import Tokenizer

        model = DiffusionGemma.from_pretrained(path, device=device, dtype=dtype)
        tok = Tokenizer.from_pretrained(path) if os.path.exists(os.path.join(path, "tokenizer.json")) else None
        return cls(model, tok, GenerationDefaults.from_pretrained(path))

    def default_params(self, **overrides) -> SamplingParams:
        """SamplingParams from the checkpoint's generation_config.json, with overrides."""
        d = self.defaults
        kw = dict(max_new_tokens=d.max_new_tokens, max_denoising_steps=d.max_denoising_steps, t_min=d.t_min,
                  t_max=d.t_max, entropy_bound=d.entropy_bound, stability_threshold=d.stability_threshold,
                  confidence_threshold=d.confidence_threshold)
        kw.update(overrides)
        return SamplingParams(**kw)

    # ------------------------------------------------------------------ simple entry points

    def generate(self, prompt: Prompt, params: SamplingParams | None = None) -> GenerationResult:
        """Generate for one prompt (text or token ids) to completion."""
        return self.generate_batch([prompt], [params])[0]

    def generate_batch(self, prompts: Sequence[Prompt],
                       params_list: Sequence[SamplingParams | None] | None = None) -> list[GenerationResult]:
        """Generate several requests batched through shared decoder calls; each result equals running it alone."""
        params_list = params_list if params_list is not None else [None] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"params_list has {len(params_list)} entries for {len(prompts)} prompts")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        results: dict[str, GenerationResult] = {}
        while self.has_unfinished():
            for rid, block in self.step():
                if block.finish_reason is not None:
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

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Validate and queue a request; returns its id. Raises ValueError naming the bad field."""
        params = params or self.default_params()
        prompt_ids = self._prompt_ids(prompt)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._requests:
            raise ValueError(f"request_id: {rid!r} is already running")
        cfg = self.model.config
        n_blocks = -(-params.max_new_tokens // cfg.canvas_length)
        if len(prompt_ids) + n_blocks * cfg.canvas_length > cfg.max_position_embeddings:
            raise ValueError(f"prompt: {len(prompt_ids)} tokens + {n_blocks} canvases of {cfg.canvas_length} exceed "
                             f"the context window of {cfg.max_position_embeddings} positions")
        seed = params.seed if params.seed is not None else secrets.randbits(64)
        tracker = OutputTracker(params.max_new_tokens, self.eos_ids, params.ignore_eos, params.stop, self.tokenizer)
        self._requests[rid] = _Request(rid, prompt_ids, params, seed, tracker, pending=list(prompt_ids))
        return rid

    def abort(self, request_id: str) -> bool:
        """Drop a request (frees its cache); True if it was running."""
        return self._requests.pop(request_id, None) is not None

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def step(self) -> list[tuple[str, BlockOutput]]:
        """One engine iteration: encode what is pending, one denoising step for every active canvas,
        commit finished blocks. Returns the blocks committed in this iteration."""
        active = list(self._requests.values())
        for req in active:
            if req.state is None:
                self._start_block(req)
        t0 = time.perf_counter()
        states = [r.state for r in active]
        logits = self.model.denoise(KVCache([r.row for r in active]), torch.stack([s.canvas for s in states]),
                                    self_cond_logits=[s.self_cond for s in states])
        self.sampler.step(states, logits)
        dt = time.perf_counter() - t0
        events = []
        for req in active:
            req.denoise_seconds += dt
            if req.state.done:
                events.append((req.request_id, self._commit(req)))
        return events

    def _start_block(self, req: _Request) -> None:
        t0 = time.perf_counter()
        self.model.encode_row(torch.tensor(req.pending, dtype=torch.int64, device=self.model.device), req.row)
        req.encode_seconds, req.denoise_seconds, req.pending = time.perf_counter() - t0, 0.0, None
        cfg = self.model.config
        req.state = BlockState.start(req.seed, req.block_index, req.params, cfg.canvas_length, cfg.vocab_size,
                                     self.model.device)

    def _commit(self, req: _Request) -> BlockOutput:
        s = req.state
        canvas = s.argmax.tolist()   # the committed block is the ARGMAX canvas of the last step run
        toks, text = req.tracker.add_block(canvas)
        stats = BlockStats(s.steps_run, len(toks) / s.steps_run, s.mean_entropy, req.encode_seconds,
                           req.denoise_seconds)
        block = BlockOutput(req.block_index, toks, text, stats, req.tracker.finish_reason)
        req.blocks.append(block)
        req.state, req.block_index, req.pending = None, req.block_index + 1, canvas
        if block.finish_reason is not None:
            del self._requests[req.request_id]
            self._finished[req.request_id] = req.result()
        return block

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: text prompts need a tokenizer, and this model has none; pass token ids")
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            ids = [int(t) for t in (prompt.tolist() if isinstance(prompt, torch.Tensor) else prompt)]
        V = self.model.config.vocab_size
        if not ids:
            raise ValueError("prompt: must contain at least one token")
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise ValueError(f"prompt: token id {bad[0]} is outside the vocabulary [0, {V})")
        return ids


def _as_tuple(x) -> tuple:
    if x is None:
        return ()
    return tuple(x) if isinstance(x, (list, tuple)) else (x,)
