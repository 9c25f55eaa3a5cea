"""Bit patterns held in signed integers: the seed's uint64 bits as an int64, and the int32 words of a token bitmask.

torch has no uint64 or uint32 arithmetic, so the noise ops take a seed as the int64 with the same bits, and the
diffusion step's token masks ([..., ceil(V/32)] int32: bit v % 32 of word v // 32 set = token v allowed) hold each
uint32 word as the int32 with the same bits. Pure Python (no torch at run time): the engine's block and sampler and
the constrained step all use these, and nothing here imports them.

Public contract:
    s = to_signed64(seed)             # a uint64 seed as the int64 with the same bits
    w = as_int32(u)                   # a uint32 bit pattern as the int32 with the same bits
    ban_ids(mask, positions, ids)     # clear the bits of ``ids`` at the first ``positions`` rows of mask, in place
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def to_signed64(seed: int) -> int:
    """A uint64 seed as the int64 with the same bits (torch has no uint64 arithmetic): how the noise ops take it."""
    return seed - (1 << 64) if seed >= (1 << 63) else seed


def as_int32(u: int) -> int:
    """A uint32 bit pattern as the int32 with the same bits."""
    return u - (1 << 32) if u >= 1 << 31 else u


def ban_ids(mask: torch.Tensor, positions: int, ids: Iterable[int]) -> None:
    """Clear the bits of ``ids`` at the first ``positions`` positions of one row's mask [C, ceil(V/32)] int32, in
    place: the sampler cannot draw those tokens there."""
    for t in ids:
        mask[:positions, t // 32] &= as_int32(0xFFFFFFFF ^ (1 << (t % 32)))
