"""The denoising loop's per-step logic around ``ops.diffusion_step`` (spec §4.1-§4.4).

A ``BlockState`` is one request's current canvas. ``Sampler.step`` advances a batch of them by one
denoising step, given the decoder's logits for exactly those rows and their ``StepKnobs`` (device tensors the
model runner builds once per request, not per step): temperature schedule, Gumbel-max draw, entropy-bound
acceptance, re-noise, self-conditioning input, and adaptive stopping. The noise is keyed per request (seed,
block, step, position), so a row's result never depends on the batch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from dgserve import ops
from dgserve.sampling_params import SamplingParams
from dgserve.structured import hooks as structured

if TYPE_CHECKING:
    from dgserve.structured.constrained import StructuredRow


def to_signed64(seed: int) -> int:
    """A uint64 seed as the int64 with the same bits (torch has no uint64 arithmetic)."""
    return seed - (1 << 64) if seed >= (1 << 63) else seed


@dataclass
class BlockState:
    """Denoising state of one request's current block (canvas index ``block`` within the request)."""

    seed: int
    block: int
    params: SamplingParams
    canvas: torch.Tensor  # [C] int64: the decoder's next input
    remaining: int  # k, transformers' cur_step: N, N-1, ..., 1
    argmax: torch.Tensor | None = None  # [C] int64: argmax canvas of the last step run
    self_cond: torch.Tensor | None = None  # [C, V] md: rnd(processed logits) of the last step
    history: deque = field(default_factory=deque)  # the last S argmax canvases
    steps_run: int = 0
    mean_entropy: float = float("nan")
    done: bool = False
    structured: StructuredRow | None = None  # the request's grammar state (response_format), else None

    @classmethod
    def start(
        cls, seed: int, block: int, params: SamplingParams, canvas_length: int, vocab_size: int, device: torch.device
    ) -> BlockState:
        """A fresh block: contract noise canvas (step label 0), no self-conditioning."""
        canvas = ops.canvas_noise(
            torch.tensor([to_signed64(seed)], device=device),
            torch.tensor([block], device=device),
            torch.zeros(1, dtype=torch.int64, device=device),
            canvas_length,
            vocab_size,
        )[0]
        return cls(seed, block, params, canvas, params.max_denoising_steps)


@dataclass
class StepKnobs:
    """Per-row sampler inputs, [B] device tensors (rows of the runner's per-slot tables, see ModelRunner)."""

    seed: torch.Tensor  # int64: the uint64 seed's bits (to_signed64)
    block: torch.Tensor  # int64: canvas index within the request
    remaining: torch.Tensor  # int64: k, the remaining-steps counter of this step
    t_min: torch.Tensor  # float64
    t_max: torch.Tensor  # float64
    max_steps: torch.Tensor  # int64: N
    entropy_bound: torch.Tensor  # float32: β
    confidence: torch.Tensor  # float32: τ

    @classmethod
    def of(cls, states: list[BlockState], device: torch.device | str = "cpu") -> StepKnobs:
        """Knobs built from the states' Python values (tests and one-off callers; the runner keeps tables)."""
        p = [s.params for s in states]

        def t(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            t([to_signed64(s.seed) for s in states], torch.int64),
            t([s.block for s in states], torch.int64),
            t([s.remaining for s in states], torch.int64),
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
    """Applies one denoising step to a batch of BlockStates (rows of the logits, in order)."""

    def __init__(self, model_dtype: torch.dtype):
        self.model_dtype = model_dtype

    def step(self, states: list[BlockState], logits: torch.Tensor, knobs: StepKnobs) -> None:
        """logits [B, C, V] fp32 (softcapped decoder output) for ``states`` with their knobs → updates each state
        in place (the per-step logic; rows with a response_format go through dgserve.structured's hooks)."""
        temperature = ops.step_temperature(knobs.t_min, knobs.t_max, knobs.remaining, knobs.max_steps)
        bitmask = structured.step_bitmask(states, logits.shape[1], logits.shape[2])  # None: no constrained row
        out = ops.diffusion_step(
            logits,
            temperature,
            knobs.seed,
            knobs.block,
            knobs.remaining,
            knobs.entropy_bound,
            None if bitmask is None else bitmask.to(logits.device),
        )
        confident = (out.mean_entropy < knobs.confidence).tolist()
        mean_entropy = out.mean_entropy.tolist()
        for i, s in enumerate(states):
            self._update(s, out.canvas[i], out.argmax[i], out.processed[i], confident[i], mean_entropy[i])
        if bitmask is not None:  # grammar-verified acceptance of the constrained rows
            structured.after_step(states, out.accepted, out.processed, knobs.remaining.tolist())

    def _update(self, s: BlockState, canvas, argmax, processed, confident: bool, mean_entropy: float) -> None:
        S = s.params.stability_threshold
        # stable: the last S argmax canvases (before this one) all equal this one; never at a block's first step
        stable = S == 0 or (len(s.history) == S and all(torch.equal(h, argmax) for h in s.history))
        if S > 0:
            s.history.append(argmax)
            if len(s.history) > S:
                s.history.popleft()
        s.canvas, s.argmax = canvas, argmax
        s.self_cond = processed.to(self.model_dtype)
        s.steps_run += 1
        s.mean_entropy = mean_entropy
        s.remaining -= 1
        s.done = (stable and confident) or s.remaining == 0
