"""linear: the batch-invariant GEMM (docs/kernels.md, "linear: the batch-invariant GEMM"). The CPU kernel is
bit-identical to reference.linear on odd shapes, a row's bits do not depend on the rows around it, the thread count
or the CPU code path, and the result is within fp32 rounding of F.linear. The CUDA kernel (cuda-marked) gives the
reference's bits too."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dgserve import ops
from dgserve.ops import reference

DTYPES = [torch.float32, torch.bfloat16]
# (T, N, K): T = 1, 3, 17, 256; N and K not multiples of any vector width, and the shipped model's shapes
SHAPES = [(1, 5, 3), (3, 17, 33), (17, 49, 65), (256, 67, 193), (3, 1, 1), (17, 384, 192), (1, 2048, 192)]


def _xw(T, N, K, dtype, seed=0):
    g = torch.Generator().manual_seed(seed + 1000 * T + N + K)
    return torch.randn(T, K, generator=g).to(dtype), (torch.randn(N, K, generator=g) * K**-0.5).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_bit_identical_to_reference(C, shape, dtype):
    x, w = _xw(*shape, dtype)
    got = ops.linear(x, w)
    assert got.dtype == dtype and got.shape == (shape[0], shape[1])
    assert torch.equal(got, reference.linear(x, w))


@pytest.mark.parametrize("dtype", DTYPES)
def test_within_rounding_of_f_linear(C, dtype):
    # Both sums are within gamma_K * sum|x_k w_k| of the exact dot product (gamma_K ~ K * 2^-24), so they differ by
    # at most twice that, plus one rounding of each to the model dtype.
    x, w = _xw(64, 129, 385, dtype)
    got = ops.linear(x, w).float()
    want = F.linear(x.float(), w.float())
    bound = 2 * 385 * 2.0**-24 * (x.float().abs() @ w.float().abs().T)
    if dtype == torch.bfloat16:
        bound = bound + 2.0**-8 * want.abs()
    assert ((got - want).abs() <= bound).all()
    assert not torch.equal(got, torch.zeros_like(got))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_is_the_same_alone_and_in_any_batch(C, dtype):
    x, w = _xw(512, 97, 192, dtype)
    full = ops.linear(x, w)
    for rows in (1, 2, 17, 512):
        for start in (0, 5, 512 - rows):
            part = ops.linear(x[start : start + rows], w)
            assert torch.equal(part, full[start : start + rows]), (rows, start)


@pytest.mark.parametrize("dtype", DTYPES)
def test_thread_count_does_not_matter(C, dtype):
    x, w = _xw(512, 384, 192, dtype)  # large enough to run in parallel
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.linear(x, w)
        torch.set_num_threads(2)
        two = ops.linear(x, w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_cpu_code_paths_agree(C, cpu_levels):
    x, w = _xw(33, 101, 77, torch.float32)
    results = []
    for level in cpu_levels:
        C._set_cpu_level(level)
        results.append(ops.linear(x, w))
    assert all(torch.equal(r, results[0]) for r in results)
    assert torch.equal(results[0], reference.linear(x, w))


def test_leading_dims_strided_rows_and_empty_shapes(C):
    x, w = _xw(12, 9, 20, torch.float32)
    wide = torch.randn(12, 31)
    wide[:, 3:23] = x  # a row-strided view
    assert torch.equal(ops.linear(wide[:, 3:23], w), reference.linear(x, w))
    x2, w2 = _xw(40, 9, 37, torch.float32)  # full panels of 16 rows: packed by the 16 x 16 register transpose
    wide2 = torch.randn(40, 50)
    wide2[:, 5:42] = x2
    assert torch.equal(ops.linear(wide2[:, 5:42], w2), reference.linear(x2, w2))
    assert torch.equal(ops.linear(x.view(3, 4, 20), w), reference.linear(x, w).view(3, 4, 9))
    assert ops.linear(torch.empty(0, 20), w).shape == (0, 9)
    assert torch.equal(ops.linear(torch.randn(4, 0), torch.randn(6, 0)), torch.zeros(4, 6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape",
    [(1, 5, 3), (17, 49, 65), (33, 192, 2048), (67, 37, 75), (80, 48, 32), (67, 2049, 1025)],
    ids=lambda s: "x".join(map(str, s)),
)
def test_strided_weights_are_read_in_place(C, shape, dtype):
    """A weight of any strides gives the reference's bits: the transpose of a contiguous [K, N] (x·E for an
    embedding E, the self-conditioning GEMM), a column-strided view, and both at once; a row keeps its bits in any
    batch. From 4 panels of 16 rows (67 and 80 rows) the CPU lays an n-contiguous weight out [N, K] first (its
    16 x 16 blocks and its edges) when it fits 8 MiB (2049 x 1025 does not), else it reads it in place: both give the
    reference's bits."""
    T, N, K = shape
    x, w = _xw(T, N, K, dtype)
    want = reference.linear(x, w)
    transposed = w.t().contiguous().t()  # strides (1, N)
    assert transposed.stride() == (1, N)
    wide = torch.zeros(N, 2 * K, dtype=dtype)
    wide[:, ::2] = w  # strides (2K, 2)
    padded = torch.zeros(K + 3, N, dtype=dtype)
    padded[:K] = w.t()  # strides (1, N) over a taller buffer, offset 0
    for weight in (transposed, wide[:, ::2], padded[:K].t()):
        assert torch.equal(ops.linear(x, weight), want), weight.stride()
    assert torch.equal(ops.linear(x[: (T + 1) // 2], transposed), want[: (T + 1) // 2])


def test_binding_rejects_bad_arguments(C):
    x, w = _xw(4, 6, 8, torch.float32)
    out = torch.empty(4, 6)
    with pytest.raises(ValueError, match="weight"):
        C.linear(x, w.to(torch.bfloat16), out)
    with pytest.raises(ValueError, match="weight"):
        C.linear(x, torch.randn(6, 7), out)
    with pytest.raises(ValueError, match="out"):
        C.linear(x, w, torch.empty(4, 5))


def test_other_dtypes_and_autograd_use_the_reference(C):
    x, w = _xw(5, 7, 9, torch.float64)
    assert torch.equal(ops.linear(x, w), reference.linear(x, w))
    xg = torch.randn(3, 9, requires_grad=True)
    ops.linear(xg, torch.randn(7, 9)).sum().backward()
    assert xg.grad is not None


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES + [(512, 384, 192), (130, 2048, 192)], ids=lambda s: "x".join(map(str, s)))
def test_cuda_kernel_gives_the_reference_bits(C, shape, dtype):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    x, w = _xw(*shape, dtype)
    out = torch.empty(shape[0], shape[1], dtype=dtype, device="cuda")
    C.linear(x.cuda(), w.cuda(), out)
    assert torch.equal(out.cpu(), reference.linear(x, w))
    C.linear(x.cuda(), w.t().contiguous().cuda().t(), out)  # a transposed weight, read in place
    assert torch.equal(out.cpu(), reference.linear(x, w))
