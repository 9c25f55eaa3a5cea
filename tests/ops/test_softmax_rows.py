"""softmax_rows: the self-conditioning softmax (docs/kernels.md, "softmax_rows: the self-conditioning softmax"). The
CPU kernel is within 1e-6 (relative, per probability) of torch's softmax in fp32 and bf16 on odd widths, with extreme
and special values; a row's bits do not depend on the rows around it, the thread count or the CPU code path."""

from __future__ import annotations

import pytest
import torch

from dgserve import ops
from dgserve.ops import native, reference

DTYPES = [torch.float32, torch.bfloat16]


def _x(rows, V, dtype, seed=0, scale=6.0):
    return (torch.randn(rows, V, generator=torch.Generator().manual_seed(seed + V)) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("V", [1, 15, 16, 17, 300, 2048, 4099])
def test_within_1e_6_of_torch(C, V, dtype):
    x = _x(9, V, dtype)
    got, want = ops.softmax_rows(x), reference.softmax_rows(x)
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert ((got - want).abs() / want.clamp_min(1e-30)).max().item() <= 1e-6
    torch.testing.assert_close(got.sum(-1), torch.ones(9), rtol=0, atol=2e-6)


def test_extremes_and_special_values(C):
    x = torch.tensor(
        [
            [0.0, -1e4, 1e4, 3.0],  # far apart: the small ones flush to exactly 0, the largest is 1
            [-float("inf"), 0.0, -float("inf"), 1.0],  # -inf is probability 0
            [float("nan"), 0.0, 1.0, 2.0],  # NaN spreads, as torch's
            [5.0, 5.0, 5.0, 5.0],  # uniform
        ]
    )
    got, want = ops.softmax_rows(x), reference.softmax_rows(x)
    assert torch.equal(got[0], torch.tensor([0.0, 0.0, 1.0, 0.0]))
    assert got[1, 0] == 0 and got[1, 2] == 0
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=0)
    assert got[2].isnan().all() and want[2].isnan().all()
    assert torch.equal(got[3], torch.full((4,), 0.25))


def test_a_row_is_the_same_alone_in_any_batch_thread_count_and_code_path(C, cpu_levels):
    x = _x(300, 2048, torch.float32, seed=4)  # large enough to run in parallel
    before, results = torch.get_num_threads(), []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for level in cpu_levels:
                C._set_cpu_level(level)
                results.append(ops.softmax_rows(x))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(r, results[0]) for r in results)
    for start, n in ((0, 1), (5, 16), (17, 100)):
        assert torch.equal(ops.softmax_rows(x[start : start + n]), results[0][start : start + n])


def test_leading_dims_and_strided_rows(C):
    x = _x(12, 40, torch.float32)
    assert torch.equal(ops.softmax_rows(x.view(3, 4, 40)), ops.softmax_rows(x).view(3, 4, 40))
    wide = torch.zeros(12, 50)
    wide[:, 5:45] = x
    assert torch.equal(ops.softmax_rows(wide[:, 5:45]), ops.softmax_rows(x))


def test_binding_rejects_bad_arguments(C):
    x = _x(3, 8, torch.float32)
    with pytest.raises(ValueError, match="out"):
        C.softmax_rows(x, torch.empty(3, 9))
    with pytest.raises(ValueError, match="out"):
        C.softmax_rows(x, torch.empty(3, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="x"):
        C.softmax_rows(x.to(torch.float64), torch.empty(3, 8))


def test_other_inputs_use_the_reference(C):
    x = _x(3, 8, torch.float64)
    assert torch.equal(ops.softmax_rows(x), reference.softmax_rows(x))
    y = _x(3, 8, torch.float32)
    assert torch.equal(ops.softmax_rows(y.t().contiguous().t()), reference.softmax_rows(y))  # strided last dim
    with native.native_disabled():
        assert torch.equal(ops.softmax_rows(y), reference.softmax_rows(y))
