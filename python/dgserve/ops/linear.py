"""``linear``: the batch-invariant GEMM ``y = x·Wᵀ`` (docs/kernels.md, "linear: the batch-invariant GEMM"); native
core in ``csrc/ops/linear.h``.

- CPU, fp32/bf16: ``_C.linear``, bit-identical to ``reference.linear`` (fp32 accumulation in k order, a product and
  a sum per step, one rounding), so a row's result is the same alone and in any batch, with any thread count and
  on any CPU code path (docs/exactness.md, "Batch invariance"). Within fp32 rounding of ``F.linear``.
- CUDA: cuBLAS (``F.linear``): batch invariance on accelerators is measured, not promised, and cuBLAS is far
  faster. ``_C.linear`` also runs on CUDA tensors (tiles over T and N only, the same k order: the CPU's bits);
  the tests compare it to the reference.
- Anything else on the CPU (other dtypes, autograd, no extension): the reference, which is exact but slow.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import native, reference


def linear_native_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``linear`` may run ``_C.linear``: CPU, fp32/bf16 x [..., K] and weight [N, K] of x's dtype, no
    autograd, extension built and not switched off. (Cheap checks: the op runs for every projection of every layer.)"""
    return (
        x.is_cpu
        and weight.is_cpu
        and x.dtype in _DTYPES
        and weight.dtype == x.dtype
        and weight.dim() == 2
        and x.dim() >= 1
        and weight.shape[1] == x.shape[-1]
        and native.has_native("linear")
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    )


_DTYPES = (torch.float32, torch.bfloat16)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x·Wᵀ`` with a fixed reduction order per output element; see ``reference.linear``.

    Parameters
    ----------
    x : [..., K] md
    weight : [N, K] md, any strides (``E.t()`` computes x·E without a copy)

    Returns
    -------
    new tensor [..., N] md. CPU: bit-identical to the reference (batch-invariant). CUDA: ``F.linear``.
    """
    # a weight with its own F.linear (FP8 W8A8; docs/kernels.md, "FP8 checkpoints")
    if type(weight) is not torch.Tensor:
        return F.linear(x, weight)
    if linear_native_ok(x, weight):
        K, N = x.shape[-1], weight.shape[0]
        x2 = x if x.dim() == 2 else x.reshape(math.prod(x.shape[:-1]), K)
        if K > 1 and x2.stride(-1) != 1:
            x2 = x2.contiguous()
        out = x2.new_empty((x2.shape[0], N))
        native._C.linear(x2, weight, out)  # any strides: a transposed view (x·E for E [K, N]) is read in place
        return out if x.dim() == 2 else out.view(*x.shape[:-1], N)
    if not x.is_cpu:
        return F.linear(x, weight)
    return reference.linear(x, weight)
