"""The tensors of one request's current block: ``BlockState`` (its index, steps and grammar are on the Request), and
the request's starting canvas with its pins (``InitialCanvas``, docs/edit-in-place.md), which each block starts from."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from dgserve import ops
from dgserve.ops.bits import as_int32, ban_ids, to_signed64

BLANK = -1  # a draft position without a token: it starts from the seeded noise


def canvases(max_new_tokens: int, canvas_length: int) -> int:
    """How many canvases (blocks) a request of ``max_new_tokens`` may generate: the ceiling of tokens / C."""
    return -(-max_new_tokens // canvas_length)


@dataclass(frozen=True)
class InitialCanvas:
    """A request's starting canvas (docs/edit-in-place.md): draft token ids laid over its canvases in order from the
    first (a ``BLANK`` starts from the seeded noise, as every position past the draft does), and the pinned
    ``[start, end)`` ranges of draft positions, which hold their draft token from the first step to the commit.
    Validated at admission (``initial_canvas.read_initial_canvas``): ids in the vocabulary or blank, ranges sorted,
    disjoint, non-empty, inside the draft and over no blank."""

    ids: tuple[int, ...]
    pinned: tuple[tuple[int, int], ...] = ()

    @property
    def pin_end(self) -> int:
        """The position after the last pinned one (0 without pins): the output holds at least this many tokens."""
        return self.pinned[-1][1] if self.pinned else 0

    def block(self, index: int, canvas_length: int) -> tuple[list[int], list[bool]] | None:
        """Block ``index``'s share: (draft ids, pinned flags) for its first positions (fewer than ``canvas_length``
        when the draft ends inside it), or None when the draft does not reach it."""
        lo = index * canvas_length
        if lo >= len(self.ids):
            return None
        ids = list(self.ids[lo : lo + canvas_length])
        pins = [False] * len(ids)
        for a, b in self.pinned:
            for p in range(max(a, lo), min(b, lo + len(ids))):
                pins[p - lo] = True
        return ids, pins


@dataclass
class BlockState:
    """The tensors of one request's current block (its index, steps and grammar are on the ``Request``)."""

    canvas: torch.Tensor  # [C] int64: the decoder's next input
    argmax: torch.Tensor | None = None  # [C] int64: argmax canvas of the last step run
    # [C, H] md: the self-conditioning signal made from the last step's processed logits (docs/memory.md,
    # "Self-conditioning state"); None at the block's first step
    self_cond: torch.Tensor | None = None
    history: deque = field(default_factory=deque)  # the last S argmax canvases
    # [C, ceil(V/32)] int32 host bitmask of the pins (docs/edit-in-place.md), the diffusion step's layout: a pinned
    # position allows its draft token only, an unpinned one before the last pin every token but EOS; None: no
    # position of this block is restricted
    pins: torch.Tensor | None = None
    pinned: int = 0  # pinned positions in this block

    @classmethod
    def start(
        cls,
        seed: int,
        block_index: int,
        canvas_length: int,
        vocab_size: int,
        device: torch.device,
        initial: InitialCanvas | None = None,
        eos_ids: frozenset[int] = frozenset(),
    ) -> BlockState:
        """A fresh block: the contract's noise canvas (step label 0) with the draft's share of this block laid over
        it (blank positions keep the noise), no self-conditioning. ``eos_ids``: the ids barred from the unpinned
        positions before the draft's last pin (empty with ignore_eos)."""
        canvas = ops.canvas_noise(
            torch.tensor([to_signed64(seed)], device=device),
            torch.tensor([block_index], device=device),
            torch.zeros(1, dtype=torch.int64, device=device),
            canvas_length,
            vocab_size,
        )[0]
        share = initial.block(block_index, canvas_length) if initial is not None else None
        if share is None:
            return cls(canvas)
        ids, pins = share
        laid = torch.tensor(ids, dtype=torch.int64, device=device)
        n = len(ids)
        canvas[:n] = torch.where(laid != BLANK, laid, canvas[:n])
        assert initial is not None
        gap = max(0, min(canvas_length, initial.pin_end - block_index * canvas_length))
        mask = pin_bitmask(ids, pins, gap, eos_ids, canvas_length, vocab_size)
        return cls(canvas, pins=mask, pinned=sum(pins))


def pin_bitmask(
    ids: list[int], pins: list[bool], gap: int, eos_ids: frozenset[int], canvas_length: int, vocab_size: int
) -> torch.Tensor | None:
    """[C, ceil(V/32)] int32 (bit v % 32 of word v // 32 set = token v allowed): position p < len(pins) with
    pins[p] allows ids[p] only; any other position below ``gap`` allows all but ``eos_ids``; the rest allow all.
    None when that restricts nothing."""
    if not any(pins) and not (gap and eos_ids):
        return None
    words = (vocab_size + 31) // 32
    mask = torch.full((canvas_length, words), -1, dtype=torch.int32)
    ban_ids(mask, gap, [v for v in eos_ids if 0 <= v < vocab_size])
    for p, (t, pinned) in enumerate(zip(ids, pins, strict=True)):
        if pinned:
            mask[p] = 0
            mask[p, t // 32] = as_int32(1 << (t % 32))
    return mask
