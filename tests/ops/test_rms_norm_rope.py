"""rms_norm_rope: the per-head RMSNorm of queries or keys, then RoPE (docs/kernels.md, "rms_norm_add and
rms_norm_rope: norms fused with their neighbours"). The CPU kernel is bit-identical to reference.rms_norm_rope
(rms_norm then rope in torch) in fp32 and bf16 on odd shapes and strided inputs, on every CPU code path and thread
count; other inputs take the composition of the dispatchers."""

from __future__ import annotations

import pytest
import torch

from dgserve import ops
from dgserve.ops import native, reference

DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(1, 1, 2), (3, 5, 14), (17, 4, 48), (33, 1, 96), (7, 2, 512)]


def _inputs(T, H, hd, dtype, seed=0):
    g = torch.Generator().manual_seed(seed + T * 100 + hd)
    x = (torch.randn(T, H, hd, generator=g) * 3).to(dtype)
    ang = torch.randn(T, hd, generator=g) * 10
    return x, 1 + 0.3 * torch.randn(hd, generator=g), ang.cos().to(dtype), ang.sin().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_bit_identical_to_reference(C, shape, dtype):
    x, w, cos, sin = _inputs(*shape, dtype)
    for weight in (None, w, w.to(torch.bfloat16)):
        got = ops.rms_norm_rope(x, weight, 1e-6, cos, sin)
        assert got.dtype == dtype and got.shape == x.shape
        assert torch.equal(got, reference.rms_norm_rope(x, weight, 1e-6, cos, sin))


def test_strided_rows_and_heads(C):
    """x as the projections hand it over: a view of a wider buffer (row and head strides of its own)."""
    x, w, cos, sin = _inputs(7, 3, 16, torch.float32)
    wide = torch.zeros(7, 4, 20)
    wide[:, :3, :16] = x
    got = ops.rms_norm_rope(wide[:, :3, :16], w, 1e-6, cos, sin)
    assert torch.equal(got, ops.rope(ops.rms_norm(x, w, 1e-6), cos, sin))


def test_cpu_code_paths_and_threads_agree(C, cpu_levels):
    x, w, cos, sin = _inputs(300, 4, 48, torch.bfloat16)  # large enough to run in parallel
    before, results = torch.get_num_threads(), []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for level in cpu_levels:
                C._set_cpu_level(level)
                results.append(ops.rms_norm_rope(x, w, 1e-6, cos, sin))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(got, results[0]) for got in results)
    assert torch.equal(results[0], reference.rms_norm_rope(x, w, 1e-6, cos, sin))


def test_binding_rejects_bad_arguments(C):
    x, w, cos, sin = _inputs(4, 2, 8, torch.float32)
    with pytest.raises(ValueError, match="even"):
        C.rms_norm_rope(torch.zeros(4, 2, 7), None, 1e-6, torch.zeros(4, 7), torch.zeros(4, 7), torch.zeros(4, 2, 7), 8)
    with pytest.raises(ValueError, match="weight"):
        C.rms_norm_rope(x, torch.ones(6), 1e-6, cos, sin, torch.empty(4, 2, 8), 8)
    with pytest.raises(ValueError, match="cos"):
        C.rms_norm_rope(x, w, 1e-6, cos[:3], sin, torch.empty(4, 2, 8), 8)
    with pytest.raises(ValueError, match="out"):
        C.rms_norm_rope(x, w, 1e-6, cos, sin, torch.empty(4, 2, 9), 8)


def test_other_inputs_use_the_dispatchers(C):
    x, w, cos, sin = _inputs(5, 2, 8, torch.float64)
    assert torch.equal(ops.rms_norm_rope(x, w, 1e-6, cos, sin), reference.rms_norm_rope(x, w, 1e-6, cos, sin))
    x32, w32, c32, s32 = _inputs(5, 2, 8, torch.float32)
    with native.native_disabled():
        assert torch.equal(
            ops.rms_norm_rope(x32, w32, 1e-6, c32, s32), reference.rms_norm_rope(x32, w32, 1e-6, c32, s32)
        )
