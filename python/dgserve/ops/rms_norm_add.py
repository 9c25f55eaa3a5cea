"""``rms_norm_add``: a residual plus an RMSNorm, optionally times the layer scalar (docs/kernels.md, "rms_norm_add
and rms_norm_rope: norms fused with their neighbours"); native core in ``csrc/ops/rms_norm_add.h``.

- CPU, fp32/bf16, contiguous rows: ``_C.rms_norm_add``, one pass instead of a norm, an add and a multiply, each
  rounded as torch rounds them (the norm's sum in torch's order): bit-identical to the reference.
- Elsewhere (CUDA, other dtypes or layouts, autograd, no extension): ``rms_norm`` (its own dispatcher), then torch's
  add and multiply.
"""

from __future__ import annotations

import torch

from . import native
from .rms_norm import rms_norm, rms_norm_native_ok


def rms_norm_add_native_ok(
    residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, scale: torch.Tensor | None
) -> bool:
    """Whether ``rms_norm_add`` may run ``_C.rms_norm_add``: ``rms_norm`` would run natively on the CPU, residual
    and x contiguous of one shape and dtype, scale None or a one-element tensor of that dtype on the CPU."""
    return (
        native.has_native("rms_norm_add")
        and x.device.type == "cpu"
        and residual.shape == x.shape
        and residual.dtype == x.dtype
        and residual.device == x.device
        and x.is_contiguous()
        and residual.is_contiguous()
        and (scale is None or (scale.numel() == 1 and scale.dtype == x.dtype and scale.device == x.device))
        and not native.wants_grad(residual, scale)
        and rms_norm_native_ok(x, weight)
    )


def rms_norm_add(
    residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, eps: float, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """``residual + rms_norm(x; weight)``, then ``· scale``; see ``reference.rms_norm_add``.

    Parameters
    ----------
    residual, x : [..., D] md
    weight : [D] (fp32 or bf16) or None, as ``rms_norm``
    eps : added to the mean square
    scale : None or a one-element md tensor (the layer scalar)

    Returns
    -------
    new tensor [..., D] md. CPU: bit-identical to the reference.
    """
    if rms_norm_add_native_ok(residual, x, weight, scale):
        lanes = native.sum_lanes()
        if lanes is not None:
            D = x.shape[-1]
            out = torch.empty(x.shape, dtype=x.dtype)
            w = native.fp32_weight(weight)  # exact, as weight.float()
            s = None if scale is None else float(scale.reshape(()))  # exact: an md value widened
            # 2-D tensors as they are: no views (an op each that a profiled step counts)
            rows = (residual, x, out) if x.dim() == 2 else (residual.view(-1, D), x.view(-1, D), out.view(-1, D))
            native._C.rms_norm_add(rows[0], rows[1], w, float(eps), s, rows[2], lanes)
            return out
    y = residual + rms_norm(x, weight, eps)
    return y if scale is None else y * scale
