"""``gelu_tanh_mul``: the gating ``rnd(rnd(gelu_tanh(gate)) ⊙ up)`` of the gated MLP and the experts (docs/kernels.md,
"gelu_tanh_mul: the gating"); native core in ``csrc/ops/gelu_tanh_mul.h``.

- CPU, fp32/bf16: ``_C.gelu_tanh_mul``, one fixed scalar GELU-tanh formula, so an element's value never depends on
  where it sits in the tensor or on the batch (torch's vectorised GELU computes a loop's scalar tail differently).
  Within a few fp32 ulp of the reference, not bit-identical to it.
- Elsewhere (CUDA, other dtypes, autograd, no extension): the reference (torch's GELU).
"""

from __future__ import annotations

import math

import torch

from . import native, reference


def gelu_tanh_mul_native_ok(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether ``gelu_tanh_mul`` may run ``_C.gelu_tanh_mul``: CPU fp32/bf16 gate and up of one shape and dtype, no
    autograd, extension built and not switched off."""
    return (
        native.has_native("gelu_tanh_mul")
        and gate.device.type == "cpu"
        and up.device == gate.device
        and gate.dtype in (torch.float32, torch.bfloat16)
        and up.dtype == gate.dtype
        and gate.shape == up.shape
        and gate.dim() >= 1
        and not native.wants_grad(gate, up)
    )


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as [rows, cols] with a unit last stride (a view when possible: the halves of a fused gate/up output)."""
    t2 = t.reshape(math.prod(t.shape[:-1]), t.shape[-1]) if t.dim() != 2 else t
    return t2 if t2.shape[-1] <= 1 or t2.stride(-1) == 1 else t2.contiguous()


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """GELU-tanh of gate times up; see ``reference.gelu_tanh_mul``.

    Parameters
    ----------
    gate, up : [..., I] md (row-strided views allowed, e.g. the two halves of a fused gate/up GEMM output)

    Returns
    -------
    new tensor [..., I] md. CPU: one fixed scalar formula, within a few fp32 ulp of the reference.
    """
    if gelu_tanh_mul_native_ok(gate, up):
        g2, u2 = _rows(gate), _rows(up)
        out = torch.empty(g2.shape, dtype=gate.dtype, device=gate.device)
        native._C.gelu_tanh_mul(g2, u2, out)
        return out.view(gate.shape)
    return reference.gelu_tanh_mul(gate, up)
