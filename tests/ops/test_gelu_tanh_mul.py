"""gelu_tanh_mul: the gating with one fixed scalar GELU-tanh formula (docs/kernels.md, "gelu_tanh_mul: the gating").
Within a few fp32 ulp of torch's GELU, and an element's bits depend on its value alone: not on its position, the
tensor's length, the thread count or the CPU code path."""

from __future__ import annotations

import pytest
import torch

from dgserve import ops
from dgserve.ops import reference


def test_close_to_torch_gelu(C):
    gate = torch.linspace(-12, 12, 200_001)
    up = torch.randn(gate.shape, generator=torch.Generator().manual_seed(0))
    got, want = ops.gelu_tanh_mul(gate, up), reference.gelu_tanh_mul(gate, up)
    # |gelu| <= |x|, and the formula's error is a few ulp of sigmoid(2u) in (0, 1): bound it by |gate · up|; torch's own
    # 0.5·x·(1 + tanh(u)) cancels for x < 0, so a relative bound against it would measure torch's error
    assert ((got - want).abs() <= 1e-6 * (gate * up).abs()).all()
    assert not torch.equal(got, torch.zeros_like(got))


def test_special_values_match_torch(C):
    g = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-30, -1e-30, 80.0, -80.0])
    got, want = ops.gelu_tanh_mul(g, torch.ones_like(g)), reference.gelu_tanh_mul(g, torch.ones_like(g))
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.allclose(got[~got.isnan()], want[~want.isnan()], rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_element_does_not_depend_on_its_position(C, dtype):
    g = torch.Generator().manual_seed(1)
    gate, up = (3 * torch.randn(67, 193, generator=g)).to(dtype), torch.randn(67, 193, generator=g).to(dtype)
    full = ops.gelu_tanh_mul(gate, up)
    assert torch.equal(ops.gelu_tanh_mul(gate[5:6], up[5:6]), full[5:6])
    assert torch.equal(ops.gelu_tanh_mul(gate[:, 7:20], up[:, 7:20]), full[:, 7:20])  # row-strided views
    flat = ops.gelu_tanh_mul(gate.flatten()[3:], up.flatten()[3:])  # every element at another vector lane
    assert torch.equal(flat, full.flatten()[3:])


def test_cpu_code_paths_and_threads_agree(C, cpu_levels):
    g = torch.Generator().manual_seed(2)
    gate, up = 4 * torch.randn(300, 257, generator=g), torch.randn(300, 257, generator=g)
    results = []
    for level in cpu_levels:
        C._set_cpu_level(level)
        results.append(ops.gelu_tanh_mul(gate, up))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        results.append(ops.gelu_tanh_mul(gate, up))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(r, results[0]) for r in results)


def test_bf16_rounds_the_activation_then_the_product(C):
    g = torch.Generator().manual_seed(3)
    gate, up = (3 * torch.randn(40, 64, generator=g)).bfloat16(), torch.randn(40, 64, generator=g).bfloat16()
    got = ops.gelu_tanh_mul(gate, up).float()
    want = reference.gelu_tanh_mul(gate, up).float()  # torch rounds at the same two points
    # one bf16 rounding apart, plus the fp32 formulas' difference where torch's GELU cancels (x < 0)
    assert ((got - want).abs() <= 2.0**-7 * want.abs() + 2e-6 * (gate.float() * up.float()).abs()).all()
