"""rms_norm_add: a residual plus an RMSNorm, optionally times the layer scalar (docs/kernels.md, "rms_norm_add and
rms_norm_rope: norms fused with their neighbours"). The CPU kernel is bit-identical to reference.rms_norm_add
(rms_norm, add and multiply in torch) in fp32 and bf16 on odd shapes, on every CPU code path and thread count; other
inputs take the composition of the dispatchers."""

from __future__ import annotations

import pytest
import torch

from dgserve import ops
from dgserve.ops import native, reference

DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(1, 1), (3, 7), (17, 48), (33, 193), (5, 4097)]  # 4097: long enough for torch's cascade of sums


def _inputs(T, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed + 100 * T + D)
    r, x = torch.randn(T, D, generator=g).to(dtype), (torch.randn(T, D, generator=g) * 3).to(dtype)
    return r, x, 1 + 0.3 * torch.randn(D, generator=g)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_bit_identical_to_reference(C, shape, dtype):
    r, x, w = _inputs(*shape, dtype)
    scale = torch.tensor([0.8125]).to(dtype)
    for weight in (None, w, w.to(torch.bfloat16)):
        for s in (None, scale):
            got = ops.rms_norm_add(r, x, weight, 1e-6, s)
            assert got.dtype == dtype and got.shape == x.shape
            assert torch.equal(got, reference.rms_norm_add(r, x, weight, 1e-6, s)), (weight is None, s is None)


def test_leading_dims_and_the_residual_update_it_replaces(C):
    """[B, T, D] inputs keep their shape; the values are those of ``r + rms_norm(x)`` and ``(..) * scalar``."""
    r, x, w = _inputs(12, 40, torch.float32)
    r3, x3, s = r.view(3, 4, 40), x.view(3, 4, 40), torch.tensor([1.5])
    got = ops.rms_norm_add(r3, x3, w, 1e-5, s)
    assert got.shape == (3, 4, 40)
    assert torch.equal(got, (r3 + ops.rms_norm(x3, w, 1e-5)) * s)


def test_cpu_code_paths_and_threads_agree(C, cpu_levels):
    r, x, w = _inputs(300, 192, torch.bfloat16)  # large enough to run in parallel
    s = torch.tensor([0.75]).to(torch.bfloat16)
    before, results = torch.get_num_threads(), []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for level in cpu_levels:
                C._set_cpu_level(level)
                results.append(ops.rms_norm_add(r, x, w, 1e-6, s))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(got, results[0]) for got in results)
    assert torch.equal(results[0], reference.rms_norm_add(r, x, w, 1e-6, s))


def test_binding_rejects_bad_arguments(C):
    r, x, _ = _inputs(4, 8, torch.float32)
    with pytest.raises(ValueError, match="residual"):
        C.rms_norm_add(r[:3], x, None, 1e-6, None, torch.empty(4, 8), 8)
    with pytest.raises(ValueError, match="out"):
        C.rms_norm_add(r, x, None, 1e-6, None, torch.empty(4, 9), 8)
    with pytest.raises(ValueError, match="weight"):
        C.rms_norm_add(r, x, torch.ones(7), 1e-6, None, torch.empty(4, 8), 8)
    with pytest.raises(ValueError, match="sum_lanes"):
        C.rms_norm_add(r, x, None, 1e-6, None, torch.empty(4, 8), 5)


def test_other_inputs_use_the_dispatchers(C):
    r, x, w = _inputs(5, 24, torch.float32)
    wide = torch.zeros(5, 30)
    wide[:, :24] = x  # a strided x: the composition, same values
    assert torch.equal(ops.rms_norm_add(r, wide[:, :24], w, 1e-6), reference.rms_norm_add(r, x, w, 1e-6))
    r64, x64 = r.double(), x.double()
    assert torch.equal(ops.rms_norm_add(r64, x64, None, 1e-6), reference.rms_norm_add(r64, x64, None, 1e-6))
    s32 = torch.tensor([2.0])  # a scale of another dtype than x promotes as torch does: the composition
    xb, rb = x.to(torch.bfloat16), r.to(torch.bfloat16)
    assert torch.equal(ops.rms_norm_add(rb, xb, w, 1e-6, s32), reference.rms_norm_add(rb, xb, w, 1e-6, s32))
    with native.native_disabled():
        assert torch.equal(ops.rms_norm_add(r, x, w, 1e-6), reference.rms_norm_add(r, x, w, 1e-6))
