"""The denoising loop's per-step logic around ``ops.diffusion_step`` (docs/generation.md).

``Sampler.step`` advances a batch of requests' blocks by one denoising step, given the decoder's logits for exactly
those rows and their ``StepKnobs`` (the rows of the model runner's per-slot tables): temperature schedule,
Gumbel-max draw, entropy-bound acceptance, re-noise, adaptive stopping, and for a request with a grammar the
grammar-verified acceptance (docs/structured-output.md). It returns the tile's processed logits, from which the
model runner makes the next step's self-conditioning signal (docs/memory.md, "Self-conditioning state"). The
noise is keyed per request (seed, block, step, position: docs/seeded-noise.md), so a row's result never depends on
the batch.

The sampler reads a request's steps left (k of this step) and never changes it: the model runner decrements it
once after the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dgserve import ops
from dgserve.engine.request import Request
from dgserve.ops.bits import ban_ids, to_signed64


@dataclass
class StepKnobs:
    """Per-row sampler inputs, [B] device tensors (rows of the runner's per-slot tables, see ModelRunner)."""

    seed: torch.Tensor  # int64: the uint64 seed's bits (to_signed64)
    block_index: torch.Tensor  # int64: canvas index within the request
    steps_left: torch.Tensor  # int64: k of this step
    t_min: torch.Tensor  # float64
    t_max: torch.Tensor  # float64
    max_denoising_steps: torch.Tensor  # int64: N
    entropy_bound: torch.Tensor  # float32: β
    confidence: torch.Tensor  # float32: τ

    @classmethod
    def of(cls, reqs: list[Request], device: torch.device | str = "cpu") -> StepKnobs:
        """Knobs built from the requests' Python values (tests and one-off callers; the runner keeps tables)."""
        p = [r.params for r in reqs]

        def t(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            t([to_signed64(r.seed) for r in reqs], torch.int64),
            t([r.block_index for r in reqs], torch.int64),
            t([r.steps_left for r in reqs], torch.int64),
            t([x.t_min for x in p], torch.float64),
            t([x.t_max for x in p], torch.float64),
            t([x.max_denoising_steps for x in p], torch.int64),
            t([x.entropy_bound for x in p], torch.float32),
            t([x.confidence_threshold for x in p], torch.float32),
        )

    def rows(self, rows: slice | torch.Tensor) -> StepKnobs:
        """The knobs of some rows: a view for a slice, a gather for an index tensor."""
        return StepKnobs(*(getattr(self, f)[rows] for f in self.__dataclass_fields__))


class Sampler:
    """Applies one denoising step to a batch of requests' blocks (rows of the logits, in order)."""

    def __init__(self, model_dtype: torch.dtype):
        self.model_dtype = model_dtype

    def step(self, reqs: list[Request], logits: torch.Tensor, knobs: StepKnobs) -> torch.Tensor:
        """logits [B, C, V] fp32 (softcapped decoder output) for ``reqs`` (each with a started block) with their
        knobs → updates each request's block, ``mean_entropy`` and ``block_done`` in place, and returns the
        processed logits [B, C, V] fp32 (the self-conditioning input of a row whose block goes on)."""
        temperature = ops.step_temperature(knobs.t_min, knobs.t_max, knobs.steps_left, knobs.max_denoising_steps)
        bitmask = _bitmask(reqs, logits.shape[1], logits.shape[2])  # None: no constrained row
        out = ops.diffusion_step(
            logits,
            temperature,
            knobs.seed,
            knobs.block_index,
            knobs.steps_left,
            knobs.entropy_bound,
            None if bitmask is None else bitmask.to(logits.device),
        )
        confident = (out.mean_entropy < knobs.confidence).tolist()
        mean_entropy = out.mean_entropy.tolist()
        for i, r in enumerate(reqs):
            self._update(r, out.canvas[i], out.argmax[i], confident[i], mean_entropy[i])
            if r.grammar is not None:  # grammar-verified acceptance of a constrained row
                _verify(r, out.accepted[i], out.processed[i])
        return out.processed

    def _update(self, r: Request, canvas, argmax, confident: bool, mean_entropy: float) -> None:
        b = r.block
        assert b is not None, "a step for a request without a started block"
        S = r.params.stability_threshold
        # stable: the last S argmax canvases (before this one) all equal this one; never at a block's first step
        stable = S == 0 or (len(b.history) == S and all(torch.equal(h, argmax) for h in b.history))
        if S > 0:
            b.history.append(argmax)
            if len(b.history) > S:
                b.history.popleft()
        b.canvas, b.argmax = canvas, argmax
        r.mean_entropy = mean_entropy
        r.block_done = (stable and confident) or r.steps_left == 1  # k = 1: the block's last step


def _bitmask(reqs: list[Request], canvas_length: int, vocab_size: int) -> torch.Tensor | None:
    """The diffusion step's bitmask [B, C, ceil(V/32)] int32 for a batch, or None when no row is constrained
    (then the op runs exactly as without structured output). Unconstrained rows get all bits set, which gives
    bit-for-bit the unmasked results (tests/ops/test_diffusion_step_bitmask.py). A row is constrained by its grammar,
    by its block's pins (a grammar of one token each: docs/edit-in-place.md), or by ``min_tokens`` while its block
    holds positions within the first min_tokens tokens: there its EOS and stop token ids are masked
    (``ops.bits.ban_ids``, docs/generation.md, "Output rules": min_tokens; on top of the pins; a request with
    min_tokens has no grammar)."""
    rows = [
        i
        for i, r in enumerate(reqs)
        if r.grammar is not None or (r.block is not None and r.block.pins is not None) or r.tracker.banned_positions()
    ]
    if not rows:
        return None
    mask = torch.full((len(reqs), canvas_length, (vocab_size + 31) // 32), -1, dtype=torch.int32)
    for i in rows:
        grammar, block, tracker = reqs[i].grammar, reqs[i].block, reqs[i].tracker
        if grammar is not None:
            mask[i] = grammar.bitmask(canvas_length)
            continue
        if block is not None and block.pins is not None:
            mask[i] = block.pins
        if tracker.banned_positions():
            ban_ids(mask[i], tracker.banned_positions(), tracker.banned_ids)
    return mask


def _verify(r: Request, accepted: torch.Tensor, processed: torch.Tensor) -> None:
    """The grammar's walk over this step's proposals (accepted [C] bool, processed [C, V] fp32): it fixes the
    canvas in place and, when the block is complete, gives the committed block; a failed grammar ends the block
    (the engine then ends the request with the grammar's error)."""
    b, grammar = r.block, r.grammar
    assert b is not None and grammar is not None
    block = grammar.after_step(b.canvas, accepted, processed, r.seed, r.block_index, r.steps_left, r.block_done)
    if block is not None:
        b.argmax, b.canvas = block, block.clone()
        r.block_done = True
    if grammar.error is not None:
        r.block_done = True
