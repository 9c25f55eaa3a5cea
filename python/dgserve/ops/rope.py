"""``rope``: the rotate-half rotary embedding of queries and keys (docs/kernels.md, "rope: the rotary embedding");
native core in ``csrc/ops/rope.h``.

- CPU, fp32/bf16: ``_C.rope``, one pass per element instead of torch's five (negate, concatenate, two products, a
  sum), each product and the sum rounded to the dtype as torch rounds them: bit-identical to the reference.
- Elsewhere (CUDA, other dtypes or layouts, autograd, no extension): the reference.
"""

from __future__ import annotations

import torch

from . import native, reference


def rope_native_ok(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether ``rope`` may run ``_C.rope``: CPU fp32/bf16 x [T, heads, hd] (even hd, unit last stride) with
    contiguous cos, sin [T, hd] of its dtype, no autograd, extension built and not switched off."""
    return (
        native.has_native("rope")
        and x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and x.dim() == 3
        and x.shape[-1] % 2 == 0
        and x.stride(-1) == 1
        and all(t.dtype == x.dtype and t.device.type == "cpu" and t.is_contiguous() for t in (cos, sin))
        and cos.shape == sin.shape == (x.shape[0], x.shape[2])
        and not native.wants_grad(x, cos, sin)
    )


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE; see ``reference.rope``.

    Parameters
    ----------
    x : [T, heads, hd] md (queries or keys after their norm)
    cos, sin : [T, hd] md (``layers.rope_cos_sin``)

    Returns
    -------
    new tensor [T, heads, hd] md. CPU: bit-identical to the reference.
    """
    if rope_native_ok(x, cos, sin):
        out = torch.empty(x.shape, dtype=x.dtype)
        native._C.rope(x, cos, sin, out)
        return out
    return reference.rope(x, cos, sin)
