"""``softmax_rows``: the fp32 softmax of each row, for the self-conditioning signal (docs/kernels.md, "softmax_rows: the
self-conditioning softmax"); native core in ``csrc/ops/softmax_rows.h``.

- CPU, fp32/bf16 rows with a contiguous last dim: ``_C.softmax_rows``, one fixed sequence per row (the contract's
  exp, 16 interleaved partial sums), so a row's probabilities never depend on the rows around it or on where torch's
  vector tail would fall: a tile of canvases is one call. Within a few fp32 ulp of the reference, not bit-identical.
- Elsewhere (CUDA, other dtypes or layouts, autograd, no extension): the reference (torch's softmax).
"""

from __future__ import annotations

import math

import torch

from . import native, reference


def softmax_rows_native_ok(x: torch.Tensor) -> bool:
    """Whether ``softmax_rows`` may run ``_C.softmax_rows``: CPU fp32/bf16 x [..., V] (V ≥ 1) with a unit last stride,
    no autograd, extension built and not switched off."""
    return (
        native.has_native("softmax_rows")
        and x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and x.dim() >= 1
        and x.shape[-1] >= 1
        and x.stride(-1) == 1
        and not native.wants_grad(x)
    )


def softmax_rows(x: torch.Tensor) -> torch.Tensor:
    """fp32 softmax over the last dim; see ``reference.softmax_rows``.

    Parameters
    ----------
    x : [..., V] md (logits)

    Returns
    -------
    new tensor [..., V] fp32. CPU: one fixed sequence per row, within a few fp32 ulp of the reference.
    """
    if softmax_rows_native_ok(x):
        V = x.shape[-1]
        x2 = x if x.dim() == 2 else x.reshape(math.prod(x.shape[:-1]), V)
        out = torch.empty(x2.shape, dtype=torch.float32)
        native._C.softmax_rows(x2, out)
        return out.view(x.shape)
    return reference.softmax_rows(x)
