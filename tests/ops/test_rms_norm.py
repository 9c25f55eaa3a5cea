"""rms_norm: the native CPU op is bit-identical to reference.rms_norm (torch's sum order reproduced)."""

from __future__ import annotations

import pytest
import torch

from dgserve import ops
from dgserve.ops import reference

DIMS = [1, 2, 7, 8, 15, 16, 17, 33, 64, 111, 256, 989, 2816, 4097]


def _weights(D: int, gen: torch.Generator):
    w = 1 + 0.3 * torch.randn(D, generator=gen)
    return [None, w, w.to(torch.bfloat16)]


def test_sum_order_is_calibrated(C):
    assert ops.native.sum_lanes() in (8, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", DIMS)
def test_bit_identical_to_reference(C, D, dtype):
    gen = torch.Generator().manual_seed(D)
    x = (torch.randn(5, D, generator=gen) * 3).to(dtype)
    for w in _weights(D, gen):
        for eps in (1e-6, 1e-5):
            got = ops.rms_norm(x, w, eps)
            want = reference.rms_norm(x, w, eps)
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(got, want), f"D={D} {dtype} weight={None if w is None else w.dtype} eps={eps}"


def test_direct_call_is_bit_identical(C):
    # Bypass the dispatcher: the binding itself, with the calibrated sum width.
    x = torch.randn(9, 300) * 5
    out = torch.empty_like(x)
    C.rms_norm(x, None, 1e-6, out, ops.native.sum_lanes())
    assert torch.equal(out, reference.rms_norm(x, None, 1e-6))


def test_shapes_and_strides(C):
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(4, 6, 80, generator=gen)
    w = torch.randn(64, generator=gen)
    for x in (base[..., :64], base[:, ::2, 8:72], base[..., :64].transpose(0, 1), base[0, 0, :64]):
        assert x.stride(-1) == 1
        assert torch.equal(ops.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))
    x = base[..., ::2]  # a strided last dim: the dispatcher uses the reference
    assert torch.equal(ops.rms_norm(x, None, 1e-6), reference.rms_norm(x, None, 1e-6))


def test_large_rows_and_thread_counts(C):
    x = torch.randn(64, 2816) * 2
    w = torch.randn(2816)
    want = reference.rms_norm(x, w, 1e-6)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            assert torch.equal(ops.rms_norm(x, w, 1e-6), want)
    finally:
        torch.set_num_threads(threads)


def test_deterministic(C):
    x = torch.randn(33, 1000).to(torch.bfloat16)
    first = ops.rms_norm(x, None, 1e-6)
    for _ in range(10):
        assert torch.equal(ops.rms_norm(x, None, 1e-6), first)


def test_autograd_uses_reference(C):
    x = torch.randn(3, 16, requires_grad=True)
    y = ops.rms_norm(x, None, 1e-6)
    y.sum().backward()
    assert x.grad is not None


def test_validation_messages_name_the_argument(C):
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="`x`"):
        C.rms_norm(x.half(), None, 1e-6, torch.empty(2, 8, dtype=torch.half), 8)
    with pytest.raises(ValueError, match="`weight`"):
        C.rms_norm(x, torch.ones(7), 1e-6, torch.empty_like(x), 8)
    with pytest.raises(ValueError, match="`out`"):
        C.rms_norm(x, None, 1e-6, torch.empty(2, 9), 8)
    with pytest.raises(ValueError, match="sum_lanes"):
        C.rms_norm(x, None, 1e-6, torch.empty_like(x), 4)


@pytest.mark.parametrize("D", [48, 192, 4097])  # 4097: long enough for torch's cascade of partial sums
def test_cpu_code_paths_agree(C, cpu_levels, D):
    """Every row runs in the CPU's widest build (cpu_vec.h); each build gives the reference's bits."""
    gen = torch.Generator().manual_seed(D)
    x, w = torch.randn(37, D, generator=gen) * 3, 1 + 0.3 * torch.randn(D, generator=gen)
    for level in cpu_levels:
        C._set_cpu_level(level)
        for weight in (None, w):
            assert torch.equal(ops.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6)), level
