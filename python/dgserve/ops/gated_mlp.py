"""``gated_mlp``: the dense MLP ``(gelu_tanh(x·Wgᵀ) ⊙ (x·Wuᵀ))·Wdᵀ`` (docs/generation.md) from the batch-invariant
pieces: ``linear`` for the three GEMMs and ``gelu_tanh_mul`` for the gating (docs/kernels.md, "linear: the
batch-invariant GEMM").

On the CPU every piece computes a row from that row alone, in a fixed order, so a row's result is bit-identical alone
and in any batch (docs/exactness.md, "Batch invariance"); it is within fp32 rounding of ``reference.gated_mlp``
(torch's GEMMs and GELU), not bit-identical to it. On CUDA the pieces are cuBLAS and torch's GELU: the reference's
own calls.
"""

from __future__ import annotations

import torch

from .gelu_tanh_mul import gelu_tanh_mul
from .linear import linear


def gated_mlp(x: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor, down_w: torch.Tensor) -> torch.Tensor:
    """Gated MLP of x; see ``reference.gated_mlp``.

    Parameters
    ----------
    x : [T, H] md
    gate_w, up_w : [D, H] md
    down_w : [H, D] md

    Returns
    -------
    new tensor [T, H] md.
    """
    return linear(gelu_tanh_mul(linear(x, gate_w), linear(x, up_w)), down_w)
