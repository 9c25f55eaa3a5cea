"""``rms_norm``: RMSNorm over the last dim (docs/generation.md); native core in ``csrc/ops/rms_norm.h``.

CPU, fp32/bf16, last dim contiguous: bit-identical to the reference (torch's CPU sum order is reproduced with
``native.sum_lanes()``, verified once per process, else the reference is used). CUDA: one fused kernel per row (a
block-wide tree sum: within an ulp or so of the reference, not bit-identical; the start-up self-check holds it to
its tolerance) instead of torch's five kernels.
"""

from __future__ import annotations

import torch

from . import native, reference

# torch splits a single-output CPU reduction across threads (a different sum order) from this many elements.
_TORCH_TWO_PASS_NUMEL = 32768


def rms_norm_native_ok(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    """Whether ``rms_norm`` may run ``_C.rms_norm`` (on the CPU also ``native.sum_lanes()`` must be known): fp32/bf16
    x with a contiguous last dim on a served device, without autograd; weight None or [D] fp32/bf16 on x's device;
    not a single row long enough for torch to split its sum across threads."""
    if not (
        native.has_native("rms_norm") and native.native_device(x.device) and x.dtype in (torch.float32, torch.bfloat16)
    ):
        return False
    if x.dim() == 0 or x.shape[-1] == 0 or x.numel() == 0 or x.stride(-1) != 1 or native.wants_grad(x, weight):
        return False  # a strided last dim changes torch's sum order; autograd needs the reference
    if weight is not None and (
        weight.device != x.device
        or weight.shape != (x.shape[-1],)
        or weight.dtype not in (torch.float32, torch.bfloat16)
    ):
        return False
    one_row = x.numel() == x.shape[-1]
    return not (one_row and x.numel() >= _TORCH_TWO_PASS_NUMEL and torch.get_num_threads() > 1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim; see ``reference.rms_norm``.

    Parameters
    ----------
    x : [..., D] fp32 or bf16 (other dtypes: the reference)
    weight : [D] scale (the multiplier is ``w``, not ``1 + w``), or None for the scale-free variant
    eps : added to the mean square

    Returns
    -------
    new tensor [..., D] in x's dtype.
    """
    if rms_norm_native_ok(x, weight):
        lanes = native.sum_lanes() if x.device.type == "cpu" else 8  # the lanes only order the CPU sum
        if lanes is not None:
            D = x.shape[-1]
            two_d = x.dim() == 2  # as it is: no reshape and view (an op each that a profiled step counts)
            x2 = x if two_d else x.reshape(-1, D)  # [rows, D]
            out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
            w = native.fp32_weight(weight)  # exact, as weight.float()
            native._C.rms_norm(x2, w, float(eps), out, lanes)
            return out if two_d else out.view(x.shape)
    return reference.rms_norm(x, weight, eps)
