"""decode_attention: the decoder's attention of several canvases in one call, each over its cached keys and then its
own canvas's (docs/kernels.md, "decode_attention: the decoder's attention"). The CPU kernel is within fp32 rounding of
reference.decode_attention (eager attention over the concatenation) on odd shapes, head groups and cache views; a
canvas's bits do not depend on the canvases beside it, the thread count or the CPU code path."""

from __future__ import annotations

import pytest
import torch

from dgserve import ops
from dgserve.ops import native, reference

DTYPES = [torch.float32, torch.bfloat16]
# (nh, nkv, hd, C, cached positions per canvas): GQA groups 1, 2 and 4; head dims and key counts off every vector
# width; canvases with nothing cached
CASES = [
    (4, 2, 48, 16, (32, 1, 16)),
    (4, 1, 96, 5, (0, 40, 7)),
    (3, 3, 7, 3, (3, 0, 20)),
    (8, 2, 33, 1, (1, 2, 65)),
]


def _inputs(nh, nkv, hd, C, cached, dtype, seed=0):
    """q [nh, B·C, hd] (a transposed view, as the projections hand it over), cached keys/values per canvas, and the
    canvases' own keys/values [nkv, B·C, hd] (transposed views too)."""
    g = torch.Generator().manual_seed(seed + nh * 1000 + hd)
    B = len(cached)
    q = torch.randn(B * C, nh, hd, generator=g).to(dtype).transpose(0, 1)
    keys = [(torch.randn(nkv, s, hd, generator=g) * 0.7).to(dtype) for s in cached]
    values = [torch.randn(nkv, s, hd, generator=g).to(dtype) for s in cached]
    ck = (torch.randn(B * C, nkv, hd, generator=g) * 0.7).to(dtype).transpose(0, 1)
    cv = torch.randn(B * C, nkv, hd, generator=g).to(dtype).transpose(0, 1)
    return q, keys, values, ck, cv


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:4])))
def test_within_rounding_of_the_reference(C, case, dtype):
    nh, nkv, hd, Cn, cached = case
    args = _inputs(nh, nkv, hd, Cn, cached, dtype)
    got = ops.decode_attention(*args, Cn)
    want = reference.decode_attention(*args, Cn)
    assert got.shape == want.shape == (len(cached) * Cn, nh * hd) and got.dtype == dtype
    # fp32: the sums differ only in order and exp's last ulp; bf16: at most one rounding of the output apart, plus the
    # probabilities' bf16 roundings
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_canvas_is_the_same_alone_and_beside_any_others(C, dtype):
    nh, nkv, hd, Cn = 4, 2, 48, 16
    q, keys, values, ck, cv = _inputs(nh, nkv, hd, Cn, (32, 1, 80, 0, 47), dtype, seed=3)
    full = ops.decode_attention(q, keys, values, ck, cv, Cn)
    for b0, b1 in ((0, 1), (1, 2), (2, 5), (0, 5), (3, 4)):
        rows = slice(b0 * Cn, b1 * Cn)
        part = ops.decode_attention(q[:, rows], keys[b0:b1], values[b0:b1], ck[:, rows], cv[:, rows], Cn)
        assert torch.equal(part, full[rows]), (b0, b1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_long_canvases_take_the_reference_and_keep_their_bits_in_any_batch(C, dtype):
    """A canvas that sees more than NATIVE_MAX_KEYS keys is computed by the reference (torch's GEMMs are faster
    there), bit for bit, and the others by the kernel: each canvas by its own key count, so its bits are the same
    alone and beside long or short neighbours."""
    from dgserve.ops.decode_attention import NATIVE_MAX_KEYS

    nh, nkv, hd, Cn = 4, 2, 24, 4
    cached = (NATIVE_MAX_KEYS + 7, 10, NATIVE_MAX_KEYS - Cn, 3 * NATIVE_MAX_KEYS)
    q, keys, values, ck, cv = _inputs(nh, nkv, hd, Cn, cached, dtype, seed=5)
    full = ops.decode_attention(q, keys, values, ck, cv, Cn)
    for b in range(len(cached)):
        rows = slice(b * Cn, (b + 1) * Cn)
        alone = ops.decode_attention(q[:, rows], keys[b : b + 1], values[b : b + 1], ck[:, rows], cv[:, rows], Cn)
        assert torch.equal(alone, full[rows]), b
        ref = reference.decode_attention(q[:, rows], keys[b : b + 1], values[b : b + 1], ck[:, rows], cv[:, rows], Cn)
        if cached[b] + Cn > NATIVE_MAX_KEYS:
            assert torch.equal(alone, ref), b
    buf_k = torch.zeros(2, nkv, 4 * NATIVE_MAX_KEYS, hd, dtype=dtype)
    buf_v = torch.zeros_like(buf_k)
    spans = [(0, 0, cached[0]), (1, 5, cached[1])]
    buf_k[0, :, : cached[0]], buf_v[0, :, : cached[0]] = keys[0], values[0]
    buf_k[1, :, 5 : 5 + cached[1]], buf_v[1, :, 5 : 5 + cached[1]] = keys[1], values[1]
    rows = slice(0, 2 * Cn)
    got = ops.decode_attention(q[:, rows], buf_k, buf_v, ck[:, rows], cv[:, rows], Cn, spans)
    assert torch.equal(got, full[rows])


def test_cache_views_are_read_in_place(C):
    """Cached keys and values as the cache hands them over: slices of a [slots, nkv, cap, hd] buffer (a slot's head
    stride is cap·hd, not P·hd)."""
    nh, nkv, hd, Cn = 4, 2, 24, 4
    buf_k, buf_v = torch.randn(3, nkv, 50, hd), torch.randn(3, nkv, 50, hd)
    spans = [(0, 3, 19), (2, 0, 50), (1, 40, 41)]
    keys = [buf_k[s, :, a:b] for s, a, b in spans]
    values = [buf_v[s, :, a:b] for s, a, b in spans]
    q, _, _, ck, cv = _inputs(nh, nkv, hd, Cn, (0, 0, 0), torch.float32)
    got = ops.decode_attention(q, keys, values, ck, cv, Cn)
    dense = ops.decode_attention(
        q, [k.contiguous() for k in keys], [v.contiguous() for v in values], ck.contiguous(), cv.contiguous(), Cn
    )
    assert torch.equal(got, dense)
    torch.testing.assert_close(got, reference.decode_attention(q, keys, values, ck, cv, Cn), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_spans_of_the_cache_buffers_equal_their_views(C, dtype):
    """The cached keys given as the cache's buffers and each canvas's (slot, start, count) (the stacked decoder's
    form) give the bits of the same positions given as views; the reference takes both forms too."""
    nh, nkv, hd, Cn = 4, 2, 24, 4
    buf_k, buf_v = torch.randn(3, nkv, 50, hd).to(dtype), torch.randn(3, nkv, 50, hd).to(dtype)
    spans = [(0, 3, 16), (2, 0, 50), (1, 40, 0), (0, 49, 1)]
    views_k = [buf_k[s, :, a : a + n] for s, a, n in spans]
    views_v = [buf_v[s, :, a : a + n] for s, a, n in spans]
    q, _, _, ck, cv = _inputs(nh, nkv, hd, Cn, (0, 0, 0, 0), dtype)
    got = ops.decode_attention(q, buf_k, buf_v, ck, cv, Cn, spans)
    assert torch.equal(got, ops.decode_attention(q, views_k, views_v, ck, cv, Cn))
    want = reference.decode_attention(q, views_k, views_v, ck, cv, Cn)
    assert torch.equal(reference.decode_attention(q, buf_k, buf_v, ck, cv, Cn, spans), want)
    with pytest.raises(ValueError, match="outside the cache"):
        ops.decode_attention(q, buf_k, buf_v, ck, cv, Cn, [(0, 3, 16), (3, 0, 1), (1, 0, 0), (0, 0, 0)])


def test_thread_count_does_not_matter(C):
    args = _inputs(8, 2, 64, 16, (64, 200, 130, 31), torch.float32)  # large enough to run in parallel
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.decode_attention(*args, 16)
        torch.set_num_threads(2)
        two = ops.decode_attention(*args, 16)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_cpu_code_paths_agree(C, cpu_levels):
    args = _inputs(4, 2, 40, 5, (9, 33), torch.float32)
    results = []
    for level in cpu_levels:
        C._set_cpu_level(level)
        results.append(ops.decode_attention(*args, 5))
    assert all(torch.equal(r, results[0]) for r in results)


def test_extreme_scores_stay_finite(C):
    """Scores far apart (the softmax's exp of a very negative argument flushes to 0) and all equal."""
    q = torch.zeros(2, 3, 8)
    q[:, 0] = 50.0
    keys, values = [torch.randn(1, 6, 8) * 10], [torch.randn(1, 6, 8)]
    ck, cv = torch.randn(1, 3, 8) * 10, torch.randn(1, 3, 8)
    got = ops.decode_attention(q, keys, values, ck, cv, 3)
    assert torch.isfinite(got).all()
    # all-zero queries: uniform weights, the mean of every value the canvas sees
    mean = torch.cat([values[0][0], cv[0]]).mean(0)
    torch.testing.assert_close(got[1:].view(2, 2, 8)[:, 0], mean.expand(2, 8), rtol=1e-6, atol=1e-6)


def test_binding_rejects_bad_arguments(C):
    q, keys, values, ck, cv = _inputs(4, 2, 8, 2, (3, 5), torch.float32)
    out = torch.empty(4, 32)
    with pytest.raises(ValueError, match="rows"):
        C.decode_attention(q, keys, values, ck, cv, 3, out)  # 4 rows are not 2 canvases of 3
    with pytest.raises(ValueError, match="value tensors"):
        C.decode_attention(q, keys, values[:1], ck, cv, 2, out)
    with pytest.raises(ValueError, match="keys"):
        C.decode_attention(q, [keys[0].to(torch.bfloat16), keys[1]], values, ck, cv, 2, out)
    with pytest.raises(ValueError, match="cached keys"):
        C.decode_attention(q, [keys[0][:1], keys[1]], [values[0][:1], values[1]], ck, cv, 2, out)
    with pytest.raises(ValueError, match="canvas keys"):
        C.decode_attention(q, keys, values, ck[:, :3], cv, 2, out)
    with pytest.raises(ValueError, match="heads"):
        k3 = [torch.randn(2, 3, 8)] * 2
        C.decode_attention(q[:3], k3, k3, torch.randn(2, 4, 8), torch.randn(2, 4, 8), 2, torch.empty(4, 24))
    with pytest.raises(ValueError, match="out"):
        C.decode_attention(q, keys, values, ck, cv, 2, torch.empty(4, 31))


def test_other_dtypes_autograd_and_no_native_use_the_reference(C):
    args64 = _inputs(2, 1, 8, 3, (4, 6), torch.float64)
    assert torch.equal(ops.decode_attention(*args64, 3), reference.decode_attention(*args64, 3))
    qg = torch.randn(2, 6, 8, requires_grad=True)
    kf = [torch.randn(1, 4, 8)] * 2
    ops.decode_attention(qg, kf, kf, torch.randn(1, 6, 8), torch.randn(1, 6, 8), 3).sum().backward()
    assert qg.grad is not None
    args = _inputs(2, 1, 8, 3, (4, 6), torch.float32)
    with native.native_disabled():
        assert torch.equal(ops.decode_attention(*args, 3), reference.decode_attention(*args, 3))
    with pytest.raises(ValueError, match="canvases"):
        ops.decode_attention(*args, 4)
