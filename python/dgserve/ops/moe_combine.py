"""``moe_combine``: the fp32 combine of the experts' outputs (docs/kernels.md, MoE dispatch); native core in
``csrc/ops/moe_combine.h``. Bit-identical everywhere (fp32 products and sums in slot order, one rounding).
"""

from __future__ import annotations

import torch

from . import native, reference


def moe_combine_native_ok(y: torch.Tensor, weights: torch.Tensor | None, dtype: torch.dtype) -> bool:
    """Whether ``moe_combine`` runs ``_C.moe_combine``: y [T, K >= 1, H] fp32 on a served device, weights None or
    [T, K] fp32 on its device, an fp32/bf16 output, no autograd."""
    ok = (
        native.has_native("moe_combine")
        and y.dim() == 3
        and y.dtype == torch.float32
        and y.shape[1] >= 1
        and dtype in (torch.float32, torch.bfloat16)
        and native.native_device(y.device)
        and not native.wants_grad(y, weights)
    )
    if ok and weights is not None:
        ok = weights.dtype == torch.float32 and weights.shape == y.shape[:2] and weights.device == y.device
    return ok


def moe_combine(y: torch.Tensor, weights: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``rnd(Σ_k y[:, k]·w[:, k])`` in slot order; see ``reference.moe_combine``.

    Parameters
    ----------
    y : [T, K, H] fp32 expert outputs by (token, slot)
    weights : [T, K] fp32, or None when y is already weighted
    dtype : the output dtype

    Returns
    -------
    new tensor [T, H] in dtype. Bit-identical on every path.
    """
    if not moe_combine_native_ok(y, weights, dtype):
        return reference.moe_combine(y, weights, dtype)
    out = torch.empty(y.shape[0], y.shape[2], dtype=dtype, device=y.device)
    native._C.moe_combine(y.contiguous(), None if weights is None else weights.contiguous(), out)
    return out
