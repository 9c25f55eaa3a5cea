"""The sampler's two hooks into structured output: ``step_bitmask`` before the diffusion step op, ``after_step``
after it (docs/structured-output.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from dgserve.engine.sampler import BlockState


def step_bitmask(states: list[BlockState], canvas_length: int, vocab_size: int) -> torch.Tensor | None:
    """The diffusion step's bitmask [B, C, ceil(V/32)] int32 for a batch, or None when no row is constrained
    (then the op runs exactly as without structured output). Unconstrained rows get all bits set, which gives
    bit-for-bit the unmasked results (tests/ops/test_diffusion_step_bitmask.py)."""
    rows = [i for i, s in enumerate(states) if s.structured is not None]
    if not rows:
        return None
    mask = torch.full((len(states), canvas_length, (vocab_size + 31) // 32), -1, dtype=torch.int32)
    for i in rows:
        row = states[i].structured
        assert row is not None
        mask[i] = row.bitmask(canvas_length)
    return mask


def after_step(states: list[BlockState], accepted: torch.Tensor, processed: torch.Tensor, steps: list[int]) -> None:
    """Grammar-verified acceptance for the constrained rows after ``Sampler`` updated them (accepted [B, C],
    processed [B, C, V], steps: each row's remaining-steps counter k of this step)."""
    for i, s in enumerate(states):
        if s.structured is not None:
            s.structured.after_step(s, accepted[i], processed[i], s.seed, steps[i])
