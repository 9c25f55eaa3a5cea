"""``rms_norm_rope``: the per-head RMSNorm of queries or keys, then RoPE (docs/kernels.md, "rms_norm_add and
rms_norm_rope: norms fused with their neighbours"); native core in ``csrc/ops/rms_norm_rope.h``.

- CPU, fp32/bf16: ``_C.rms_norm_rope``, one pass per head instead of a norm and a rotation, each step rounded as
  torch rounds it (the norm's sum in torch's order): bit-identical to the reference.
- Elsewhere (CUDA, other dtypes or layouts, autograd, no extension): ``rms_norm`` then ``rope`` (their own
  dispatchers).
"""

from __future__ import annotations

import torch

from . import native
from .rms_norm import rms_norm, rms_norm_native_ok
from .rope import rope, rope_native_ok

_MAX_HEAD_DIM = 1024  # csrc/ops/rms_norm_rope.h kRmsNormRopeMaxHeadDim


def rms_norm_rope_native_ok(x: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether ``rms_norm_rope`` may run ``_C.rms_norm_rope``: ``rope`` and ``rms_norm`` would both run natively
    (CPU fp32/bf16 x [T, heads, hd], even hd up to 1024, unit last stride) and the weight is None or fp32/bf16 [hd]."""
    return (
        native.has_native("rms_norm_rope")
        and rope_native_ok(x, cos, sin)
        and 2 <= x.shape[-1] <= _MAX_HEAD_DIM
        and rms_norm_native_ok(x, weight)
    )


def rms_norm_rope(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """RoPE of the normed heads; see ``reference.rms_norm_rope``.

    Parameters
    ----------
    x : [T, heads, hd] md (a projection's output viewed by head; any row and head strides)
    weight : [hd] (q_norm / k_norm) or None
    eps : added to the mean square
    cos, sin : [T, hd] md (``layers.rope_cos_sin``)

    Returns
    -------
    new tensor [T, heads, hd] md. CPU: bit-identical to the reference.
    """
    if rms_norm_rope_native_ok(x, weight, cos, sin):
        lanes = native.sum_lanes()
        if lanes is not None:
            out = torch.empty(x.shape, dtype=x.dtype)
            w = native.fp32_weight(weight)  # exact, as weight.float()
            native._C.rms_norm_rope(x, w, float(eps), cos, sin, out, lanes)
            return out
    return rope(rms_norm(x, weight, eps), cos, sin)
