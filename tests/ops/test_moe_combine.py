"""moe_combine: native op bit-identical to reference.moe_combine (fp32 products and sums in slot order)."""

from __future__ import annotations

import pytest
import torch

from dgserve import ops
from dgserve.ops import reference

SHAPES = [(1, 1, 1), (1, 8, 64), (7, 2, 17), (33, 8, 96), (256, 3, 5), (5, 1, 2816)]


def _inputs(T, K, H, gen):
    # Wide dynamic range so the sum order matters in the last bits.
    y = torch.randn(T, K, H, generator=gen) * torch.logspace(-3, 3, K)[None, :, None]
    w = torch.rand(T, K, generator=gen)
    return y, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_weights", [True, False])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_bit_identical_to_reference(C, shape, with_weights, dtype):
    gen = torch.Generator().manual_seed(sum(shape))
    y, w = _inputs(*shape, gen)
    w = w if with_weights else None
    got = ops.moe_combine(y, w, dtype)
    want = reference.moe_combine(y, w, dtype)
    assert got.dtype == dtype and got.shape == (shape[0], shape[2])
    assert torch.equal(got, want)


def test_cpu_code_paths_agree(C, cpu_levels):
    """Each token runs in the CPU's widest build (cpu_vec.h), hidden dims in chunks of 256: every build gives the
    reference's bits, across a chunk boundary too."""
    y, w = _inputs(9, 3, 600, torch.Generator().manual_seed(5))
    want = reference.moe_combine(y, w, torch.float32)
    for level in cpu_levels:
        C._set_cpu_level(level)
        assert torch.equal(ops.moe_combine(y, w, torch.float32), want), level
        assert torch.equal(ops.moe_combine(y, None, torch.bfloat16), reference.moe_combine(y, None, torch.bfloat16))


def test_matches_unfused_weighting(C):
    # Weighting inside the combine (CPU path) equals weighting first and combining with weights=None
    # (the CUDA GEMM2 epilogue's split): the same fp32 product either way.
    y, w = _inputs(9, 8, 40, torch.Generator().manual_seed(0))
    assert torch.equal(ops.moe_combine(y, w, torch.bfloat16), ops.moe_combine(y * w[..., None], None, torch.bfloat16))


def test_no_tokens(C):
    out = ops.moe_combine(torch.empty(0, 8, 16), torch.empty(0, 8), torch.float32)
    assert out.shape == (0, 16)


def test_strided_inputs_are_made_contiguous(C):
    y, w = _inputs(6, 4, 32, torch.Generator().manual_seed(3))
    ys = y.transpose(0, 1).contiguous().transpose(0, 1)  # same values, non-contiguous
    assert torch.equal(ops.moe_combine(ys, w, torch.float32), reference.moe_combine(y, w, torch.float32))


def test_deterministic(C):
    y, w = _inputs(512, 8, 256, torch.Generator().manual_seed(1))
    first = ops.moe_combine(y, w, torch.bfloat16)
    for _ in range(10):
        assert torch.equal(ops.moe_combine(y, w, torch.bfloat16), first)


def test_validation_messages_name_the_argument(C):
    y, w = torch.zeros(2, 3, 4), torch.zeros(2, 3)
    with pytest.raises(ValueError, match="`y`"):
        C.moe_combine(y.double(), w, torch.empty(2, 4))
    with pytest.raises(ValueError, match="`weights`"):
        C.moe_combine(y, torch.zeros(2, 2), torch.empty(2, 4))
    with pytest.raises(ValueError, match="`out`"):
        C.moe_combine(y, w, torch.empty(2, 5))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES + [(4096, 8, 2816)], ids=lambda s: "x".join(map(str, s)))
def test_cuda_bit_identical(C, shape, dtype):
    if not (torch.cuda.is_available() and ops.native.cuda_built()):
        pytest.skip("needs a CUDA device and the CUDA build of dgserve._C")
    y, w = _inputs(*shape, torch.Generator().manual_seed(2))
    want = reference.moe_combine(y, w, dtype)
    for _ in range(10):  # determinism loop
        assert torch.equal(ops.moe_combine(y.cuda(), w.cuda(), dtype).cpu(), want)
        assert torch.equal(ops.moe_combine((y * w[..., None]).cuda(), None, dtype).cpu(), want)
