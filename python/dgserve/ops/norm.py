"""``rms_norm``: the native kernel when it reproduces the reference bit for bit, else ``reference.rms_norm``."""

from __future__ import annotations

import torch

from . import native, reference

# torch splits a single-output CPU reduction across threads (a different sum order) from this many elements.
_TORCH_TWO_PASS_NUMEL = 32768


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., D] with optional scale weight [D]; see reference.rms_norm."""
    if _rms_norm_native_ok(x, weight):
        lanes = native._sum_lanes() if x.device.type == "cpu" else 8  # the lanes only order the CPU sum
        if lanes is not None:
            D = x.shape[-1]
            x2 = x.reshape(-1, D)  # [rows, D]
            out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
            w = None if weight is None else weight.to(torch.float32).contiguous()  # exact, as weight.float()
            native._C.rms_norm(x2, w, float(eps), out, lanes)
            return out.view(x.shape)
    return reference.rms_norm(x, weight, eps)


def _rms_norm_native_ok(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    if not (
        native.has_native("rms_norm") and native._native_device(x.device) and x.dtype in (torch.float32, torch.bfloat16)
    ):
        return False
    if x.dim() == 0 or x.shape[-1] == 0 or x.numel() == 0 or x.stride(-1) != 1 or native._wants_grad(x, weight):
        return False  # a strided last dim changes torch's sum order; autograd needs the reference
    if weight is not None and (
        weight.device != x.device
        or weight.shape != (x.shape[-1],)
        or weight.dtype not in (torch.float32, torch.bfloat16)
    ):
        return False
    one_row = x.numel() == x.shape[-1]
    return not (one_row and x.numel() >= _TORCH_TWO_PASS_NUMEL and torch.get_num_threads() > 1)
