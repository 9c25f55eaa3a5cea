"""The denoising loop's per-step logic around ``ops.diffusion_step`` (spec §4.1-§4.4).

A ``BlockState`` is one request's current canvas. ``Sampler.step`` advances a batch of them by one
denoising step, given the decoder's logits for exactly those rows: temperature schedule, Gumbel-max
draw, entropy-bound acceptance, re-noise, self-conditioning input, and adaptive stopping. The noise
is keyed per request (seed, block, step, position), so a row's result never depends on the batch.
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


class Sampler:
    """Applies one denoising step to a batch of BlockStates (rows of the logits, in order)."""

    def __init__(self, model_dtype: torch.dtype):
        self.model_dtype = model_dtype

    def step(self, states: list[BlockState], logits: torch.Tensor) -> None:
        """logits [B, C, V] fp32 (softcapped decoder output) for ``states`` → updates each state in place."""
        dev = logits.device
        p = [s.params for s in states]
        k = torch.tensor([s.remaining for s in states], dtype=torch.int64, device=dev)
        temperature = ops.step_temperature(
            torch.tensor([x.t_min for x in p], dtype=torch.float64, device=dev),
            torch.tensor([x.t_max for x in p], dtype=torch.float64, device=dev),
            k,
            torch.tensor([x.max_denoising_steps for x in p], dtype=torch.int64, device=dev),
        )
        bitmask = structured.step_bitmask(states, logits.shape[1], logits.shape[2])  # None: no constrained row
        out = ops.diffusion_step(
            logits,
            temperature,
            torch.tensor([to_signed64(s.seed) for s in states], dtype=torch.int64, device=dev),
            torch.tensor([s.block for s in states], dtype=torch.int64, device=dev),
            k,
            torch.tensor([x.entropy_bound for x in p], dtype=torch.float32, device=dev),
            None if bitmask is None else bitmask.to(dev),
        )
        tau = torch.tensor([x.confidence_threshold for x in p], dtype=torch.float32, device=dev)
        confident = (out.mean_entropy < tau).tolist()
        mean_entropy = out.mean_entropy.tolist()
        for i, s in enumerate(states):
            self._update(s, out.canvas[i], out.argmax[i], out.processed[i], confident[i], mean_entropy[i])
        if bitmask is not None:  # grammar-verified acceptance of the constrained rows
            structured.after_step(states, out.accepted, out.processed, k.tolist())

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
