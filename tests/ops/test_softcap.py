"""softcap: the final logit soft-cap in place (docs/kernels.md, "softcap: the logit soft-cap"). The CPU kernel's one
fixed tanh formula is within 4 fp32 ulp of torch's tanh over the whole range (both branches, the switch between them,
saturation, signed zeros, infinities and NaN); an element's bits do not depend on its place, the tensor's size, the
thread count or the CPU code path."""

from __future__ import annotations

import pytest
import torch

from dgserve import ops
from dgserve.ops import native, reference

CAP = 30.0


def _values() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    edges = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 7.5, -7.5, 7.4999995, 7.5000005, 1e4, -1e4, 3e38])
    return torch.cat([torch.randn(50_000, generator=g) * 40, torch.linspace(-300, 300, 60_001), edges])


def test_within_4_ulp_of_torch_tanh(C):
    x = _values()
    got, want = ops.softcap(x.clone(), CAP), reference.softcap(x.clone(), CAP)
    rel = (got - want).abs() / want.abs().clamp_min(torch.finfo(torch.float32).tiny)
    assert rel.max().item() <= 4 * 2.0**-23
    assert torch.equal(torch.signbit(got), torch.signbit(want))  # -0 stays -0
    assert got.abs().max().item() <= CAP


def test_special_values(C):
    x = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0])
    got = ops.softcap(x, CAP)
    assert got[0].item() == CAP and got[1].item() == -CAP and got[2].isnan() and got[3].item() == 0.0


def test_in_place_and_position_independent(C):
    x = _values()
    whole = x.clone()
    assert ops.softcap(whole, CAP) is whole
    for start, n in ((0, 1), (3, 17), (1000, 4097), (7, 110_000)):
        part = x[start : start + n].clone()
        assert torch.equal(ops.softcap(part, CAP), whole[start : start + n]), (start, n)


def test_thread_count_and_code_paths_do_not_matter(C, cpu_levels):
    x = torch.randn(300_000, generator=torch.Generator().manual_seed(1)) * 50  # large enough to run in parallel
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for level in cpu_levels:
                C._set_cpu_level(level)
                results.append(ops.softcap(x.clone(), CAP))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(r, results[0]) for r in results)


def test_binding_rejects_bad_arguments(C):
    with pytest.raises(ValueError, match="float32"):
        C.softcap(torch.zeros(4, dtype=torch.float64), CAP)
    with pytest.raises(ValueError, match="contiguous"):
        C.softcap(torch.zeros(4, 4).t(), CAP)
    with pytest.raises(ValueError, match="cap"):
        C.softcap(torch.zeros(4), 0.0)


def test_other_inputs_use_the_reference(C):
    x = torch.randn(5, 7, dtype=torch.float64) * 40
    assert torch.equal(ops.softcap(x.clone(), CAP), reference.softcap(x.clone(), CAP))
    strided = torch.randn(6, 8).t()
    assert torch.equal(ops.softcap(strided.clone().t().t(), CAP), reference.softcap(strided.clone(), CAP))
    y = torch.randn(100) * 40
    with native.native_disabled():
        assert torch.equal(ops.softcap(y.clone(), CAP), reference.softcap(y.clone(), CAP))
