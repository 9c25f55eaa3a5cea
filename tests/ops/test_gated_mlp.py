"""gated_mlp on the CPU: built from linear and gelu_tanh_mul, within fp32 rounding of reference.gated_mlp (torch's
GEMMs and GELU), and a row's bits are the same alone and in any batch (docs/exactness.md, "Batch invariance")."""

from __future__ import annotations

import pytest
import torch

from dgserve import ops
from dgserve.ops import reference


def _mlp(T, H, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    gate = (torch.randn(D, H, generator=g) * H**-0.5).to(dtype)
    up = (torch.randn(D, H, generator=g) * H**-0.5).to(dtype)
    down = (torch.randn(H, D, generator=g) * D**-0.5).to(dtype)
    return x, gate, up, down


def _rel_l2(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64, 96), (17, 192, 384), (33, 40, 24)], ids=lambda s: "x".join(map(str, s)))
def test_close_to_reference(C, shape, dtype):
    args = _mlp(*shape, dtype)
    got, want = ops.gated_mlp(*args), reference.gated_mlp(*args)
    assert got.dtype == dtype and got.shape == want.shape
    assert _rel_l2(got, want) <= (1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_is_the_same_alone_and_in_any_batch(C, dtype):
    x, gate, up, down = _mlp(512, 192, 384, dtype, seed=1)
    full = ops.gated_mlp(x, gate, up, down)
    for rows in (1, 2, 17, 512):
        start = 512 - rows
        assert torch.equal(ops.gated_mlp(x[start:], gate, up, down), full[start:]), rows
