"""rope: the rotate-half rotary embedding (docs/kernels.md, "rope: the rotary embedding"). The CPU kernel is
bit-identical to reference.rope (torch's elementwise ops) in fp32 and bf16 on odd shapes and strided inputs, on every
CPU code path and thread count; other inputs take the reference."""

from __future__ import annotations

import pytest
import torch

from dgserve import ops
from dgserve.ops import native, reference

DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(1, 1, 2), (3, 5, 14), (17, 4, 48), (33, 1, 96), (256, 2, 64)]


def _inputs(T, H, hd, dtype, seed=0):
    g = torch.Generator().manual_seed(seed + T * 100 + hd)
    x = (torch.randn(T, H, hd, generator=g) * 3).to(dtype)
    ang = torch.randn(T, hd, generator=g) * 10
    return x, ang.cos().to(dtype), ang.sin().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_bit_identical_to_reference(C, shape, dtype):
    x, cos, sin = _inputs(*shape, dtype)
    got = ops.rope(x, cos, sin)
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got, reference.rope(x, cos, sin))


def test_strided_rows_and_heads(C):
    """x as the projections hand it over: a view of a wider buffer (row and head strides of its own)."""
    x, cos, sin = _inputs(7, 3, 16, torch.float32)
    wide = torch.zeros(7, 4, 20)
    wide[:, :3, :16] = x
    view = wide[:, :3, :16]
    assert torch.equal(ops.rope(view, cos, sin), reference.rope(x, cos, sin))


def test_code_paths_and_threads_agree(C, cpu_levels):
    x, cos, sin = _inputs(300, 4, 48, torch.bfloat16)  # large enough to run in parallel
    before, results = torch.get_num_threads(), []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for level in cpu_levels:
                C._set_cpu_level(level)
                results.append(ops.rope(x, cos, sin))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(r, results[0]) for r in results)


def test_binding_rejects_bad_arguments(C):
    x, cos, sin = _inputs(4, 2, 8, torch.float32)
    with pytest.raises(ValueError, match="even"):
        C.rope(torch.zeros(4, 2, 7), torch.zeros(4, 7), torch.zeros(4, 7), torch.zeros(4, 2, 7))
    with pytest.raises(ValueError, match="cos"):
        C.rope(x, cos[:3], sin, torch.empty(4, 2, 8))
    with pytest.raises(ValueError, match="sin"):
        C.rope(x, cos, sin.to(torch.bfloat16), torch.empty(4, 2, 8))
    with pytest.raises(ValueError, match="out"):
        C.rope(x, cos, sin, torch.empty(4, 2, 9))


def test_other_inputs_use_the_reference(C):
    x, cos, sin = _inputs(5, 2, 8, torch.float64)
    assert torch.equal(ops.rope(x, cos, sin), reference.rope(x, cos, sin))
    x32, c32, s32 = _inputs(5, 2, 8, torch.float32)
    wide = torch.zeros(5, 12)
    wide[:, :8] = c32
    assert torch.equal(ops.rope(x32, wide[:, :8], s32), reference.rope(x32, c32, s32))  # strided cos: reference
    with native.native_disabled():
        assert torch.equal(ops.rope(x32, c32, s32), reference.rope(x32, c32, s32))
