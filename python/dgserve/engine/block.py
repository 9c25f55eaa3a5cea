"""The tensors of one request's current block: ``BlockState`` (its index, steps and grammar are on the Request)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from dgserve import ops
from dgserve.sampling_params import to_signed64


@dataclass
class BlockState:
    """The tensors of one request's current block (its index, steps and grammar are on the ``Request``)."""

    canvas: torch.Tensor  # [C] int64: the decoder's next input
    argmax: torch.Tensor | None = None  # [C] int64: argmax canvas of the last step run
    self_cond: torch.Tensor | None = None  # [C, V] md: rnd(processed logits) of the last step
    history: deque = field(default_factory=deque)  # the last S argmax canvases

    @classmethod
    def start(
        cls, seed: int, block_index: int, canvas_length: int, vocab_size: int, device: torch.device
    ) -> BlockState:
        """A fresh block: the contract's noise canvas (step label 0), no self-conditioning."""
        canvas = ops.canvas_noise(
            torch.tensor([to_signed64(seed)], device=device),
            torch.tensor([block_index], device=device),
            torch.zeros(1, dtype=torch.int64, device=device),
            canvas_length,
            vocab_size,
        )[0]
        return cls(canvas)
