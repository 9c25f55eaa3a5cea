"""``softcap``: the final logit soft-capping ``x ← tanh(x / cap)·cap`` in place (docs/kernels.md, "softcap: the logit
soft-cap"); native core in ``csrc/ops/softcap.h``.

- CPU, fp32 contiguous: ``_C.softcap``, one fixed scalar tanh formula, so an element's value never depends on where
  it sits in the tensor or on the batch (torch's vectorised tanh computes a loop's scalar tail with other code), and
  the LM head's tile of canvases is capped in one call. Within 4 fp32 ulp of the reference, not bit-identical to it.
- Elsewhere (CUDA, other dtypes or layouts, autograd, no extension): the reference (torch's tanh), in place.
"""

from __future__ import annotations

import torch

from . import native, reference


def softcap_native_ok(x: torch.Tensor) -> bool:
    """Whether ``softcap`` may run ``_C.softcap``: a contiguous CPU fp32 tensor, no autograd, extension built and not
    switched off."""
    return (
        native.has_native("softcap")
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.is_contiguous()
        and not native.wants_grad(x)
    )


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``tanh(x / cap)·cap`` in place; see ``reference.softcap``.

    Parameters
    ----------
    x : [...] fp32 (the LM head's logits), rewritten in place
    cap : > 0

    Returns
    -------
    x. CPU: one fixed formula, within 4 fp32 ulp of the reference.
    """
    if softcap_native_ok(x):
        native._C.softcap(x, float(cap))
        return x
    return reference.softcap(x, cap)
