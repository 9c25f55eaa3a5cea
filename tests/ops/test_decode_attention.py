"""decode_attention: the decoder's attention of several canvases in one call (docs/kernels.md, "decode_attention: the
decoder's attention"). The CPU kernel is within fp32 rounding of reference.decode_attention (eager attention) on odd
shapes, head groups and cache views; a canvas's bits do not depend on the canvases beside it, the thread count or the
CPU code path."""

from __future__ import annotations

import pytest
import torch

from dgserve import ops
from dgserve.ops import native, reference

DTYPES = [torch.float32, torch.bfloat16]
# (nh, nkv, hd, C, key counts per canvas): GQA groups 1, 2 and 4; head dims and key counts off every vector width
CASES = [
    (4, 2, 48, 16, (32, 17, 1 + 16)),
    (4, 1, 96, 5, (5, 40, 7)),
    (3, 3, 7, 3, (3, 1, 20)),
    (8, 2, 33, 1, (1, 2, 65)),
]


def _inputs(nh, nkv, hd, C, lengths, dtype, seed=0):
    g = torch.Generator().manual_seed(seed + nh * 1000 + hd)
    B = len(lengths)
    q = torch.randn(B * C, nh, hd, generator=g).to(dtype).transpose(0, 1)  # [nh, B·C, hd], a transposed view
    keys = [(torch.randn(nkv, s, hd, generator=g) * 0.7).to(dtype) for s in lengths]
    values = [torch.randn(nkv, s, hd, generator=g).to(dtype) for s in lengths]
    return q, keys, values


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:4])))
def test_within_rounding_of_the_reference(C, case, dtype):
    nh, nkv, hd, Cn, lengths = case
    q, keys, values = _inputs(nh, nkv, hd, Cn, lengths, dtype)
    got = ops.decode_attention(q, keys, values, Cn)
    want = reference.decode_attention(q, keys, values, Cn)
    assert got.shape == want.shape == (len(lengths) * Cn, nh * hd) and got.dtype == dtype
    # fp32: the sums differ only in order and exp's last ulp; bf16: at most one rounding of the output apart, plus the
    # probabilities' bf16 roundings
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_canvas_is_the_same_alone_and_beside_any_others(C, dtype):
    nh, nkv, hd, Cn = 4, 2, 48, 16
    lengths = (32, 17, 80, 16, 47)
    q, keys, values = _inputs(nh, nkv, hd, Cn, lengths, dtype, seed=3)
    full = ops.decode_attention(q, keys, values, Cn)
    for b0, b1 in ((0, 1), (1, 2), (2, 5), (0, 5), (3, 4)):
        part = ops.decode_attention(q[:, b0 * Cn : b1 * Cn], keys[b0:b1], values[b0:b1], Cn)
        assert torch.equal(part, full[b0 * Cn : b1 * Cn]), (b0, b1)


def test_cache_views_are_read_in_place(C):
    """Keys and values as the cache hands them over: slices of a [slots, nkv, cap, hd] buffer (a slot's head stride is
    cap·hd, not S·hd)."""
    nh, nkv, hd, Cn = 4, 2, 24, 4
    buf_k, buf_v = torch.randn(3, nkv, 50, hd), torch.randn(3, nkv, 50, hd)
    spans = [(0, 3, 19), (2, 0, 50), (1, 40, 41)]
    keys = [buf_k[s, :, a:b] for s, a, b in spans]
    values = [buf_v[s, :, a:b] for s, a, b in spans]
    q = torch.randn(nh, 3 * Cn, hd)
    got = ops.decode_attention(q, keys, values, Cn)
    assert torch.equal(
        got, ops.decode_attention(q, [k.contiguous() for k in keys], [v.contiguous() for v in values], Cn)
    )
    torch.testing.assert_close(got, reference.decode_attention(q, keys, values, Cn), rtol=1e-5, atol=1e-5)


def test_thread_count_does_not_matter(C):
    q, keys, values = _inputs(8, 2, 64, 16, (64, 200, 130, 31), torch.float32)  # large enough to run in parallel
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.decode_attention(q, keys, values, 16)
        torch.set_num_threads(2)
        two = ops.decode_attention(q, keys, values, 16)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_cpu_code_paths_agree(C, cpu_levels):
    q, keys, values = _inputs(4, 2, 40, 5, (9, 33), torch.float32)
    results = []
    for level in cpu_levels:
        C._set_cpu_level(level)
        results.append(ops.decode_attention(q, keys, values, 5))
    assert all(torch.equal(r, results[0]) for r in results)


def test_extreme_scores_stay_finite(C):
    """Scores far apart (the softmax's exp of a very negative argument flushes to 0) and all equal."""
    q = torch.zeros(2, 3, 8)
    q[:, 0] = 50.0
    keys = [torch.randn(1, 9, 8) * 10]
    values = [torch.randn(1, 9, 8)]
    got = ops.decode_attention(q, keys, values, 3)
    assert torch.isfinite(got).all()
    # all-zero queries: uniform weights, the mean of the values
    torch.testing.assert_close(got[1:].view(2, 2, 8)[:, 0], values[0][0].mean(0).expand(2, 8), rtol=1e-6, atol=1e-6)


def test_binding_rejects_bad_arguments(C):
    q, keys, values = _inputs(4, 2, 8, 2, (3, 5), torch.float32)
    out = torch.empty(4, 32)
    with pytest.raises(ValueError, match="rows"):
        C.decode_attention(q, keys, values, 3, out)  # 4 rows are not 2 canvases of 3
    with pytest.raises(ValueError, match="value tensors"):
        C.decode_attention(q, keys, values[:1], 2, out)
    with pytest.raises(ValueError, match="keys"):
        C.decode_attention(q, [keys[0].to(torch.bfloat16), keys[1]], values, 2, out)
    with pytest.raises(ValueError, match="S >= 1"):
        C.decode_attention(q, [keys[0][:, :0], keys[1]], [values[0][:, :0], values[1]], 2, out)
    with pytest.raises(ValueError, match="heads"):
        C.decode_attention(q[:3], [torch.randn(2, 3, 8)] * 2, [torch.randn(2, 3, 8)] * 2, 2, torch.empty(4, 24))
    with pytest.raises(ValueError, match="out"):
        C.decode_attention(q, keys, values, 2, torch.empty(4, 31))


def test_other_dtypes_autograd_and_no_native_use_the_reference(C):
    q, keys, values = _inputs(2, 1, 8, 3, (4, 6), torch.float64)
    assert torch.equal(ops.decode_attention(q, keys, values, 3), reference.decode_attention(q, keys, values, 3))
    qg = torch.randn(2, 6, 8, requires_grad=True)
    kf, vf = [torch.randn(1, 4, 8)] * 2, [torch.randn(1, 4, 8)] * 2
    ops.decode_attention(qg, kf, vf, 3).sum().backward()
    assert qg.grad is not None
    q32, k32, v32 = _inputs(2, 1, 8, 3, (4, 6), torch.float32)
    with native.native_disabled():
        assert torch.equal(ops.decode_attention(q32, k32, v32, 3), reference.decode_attention(q32, k32, v32, 3))
    with pytest.raises(ValueError, match="canvases"):
        ops.decode_attention(q32, k32, v32, 4)
