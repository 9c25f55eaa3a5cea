"""moe_experts: the CPU dispatch (native align, the batch-invariant linear and gelu_tanh_mul, native combine) is
within fp32 rounding of reference.moe_experts and gives a token the same bits alone and in any batch; the native
grouped-GEMM loop (the CUDA kernels' contract) is within tolerance."""

from __future__ import annotations

import pytest
import torch

from dgserve import ops
from dgserve.ops import reference

# (tokens, hidden, inter, experts, top_k, routing)
CASES = [
    (1, 64, 32, 4, 2, "uniform"),
    (7, 48, 16, 5, 1, "uniform"),
    (7, 40, 24, 6, 3, "one_group"),
    (33, 64, 32, 13, 5, "half_unused"),
    (256, 96, 24, 13, 8, "uniform"),
    (5, 32, 8, 3, 3, "uniform"),
    (17, 72, 40, 128, 8, "uniform"),
]


def _problem(T, H, I, E, K, routing, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed + T * 31 + E)
    x = torch.randn(T, H, generator=gen).to(dtype)
    gate_up = (torch.randn(E, 2 * I, H, generator=gen) * H**-0.5).to(dtype)
    down = (torch.randn(E, H, I, generator=gen) * I**-0.5).to(dtype)
    w, ids = torch.rand(T, E, generator=gen).softmax(-1).topk(K, dim=-1)
    if routing == "one_group":
        ids = torch.arange(K).repeat(T, 1)  # all tokens to the same K experts
    elif routing == "half_unused":  # odd experts receive no tokens
        ids = torch.rand(T, (E + 1) // 2, generator=gen).topk(K, dim=-1).indices * 2
    return x, gate_up, down, w.contiguous(), ids.contiguous()


def _native_loop(C, x, gate_up, down, w, ids, block_size):
    """The grouped GEMMs through _C.moe_experts (the CPU mirror of the CUDA kernels) + combine."""
    T, K = ids.shape
    E, H, I = gate_up.shape[0], x.shape[1], gate_up.shape[1] // 2
    align = ops.moe_align(ids, E, block_size)
    act = torch.zeros(align.sorted_pairs.numel(), I, dtype=x.dtype)
    y = torch.full((T * K, H), float("nan"))
    C.moe_experts(x, gate_up, down, w, align.counts, align.offsets, align.sorted_pairs, act, y)
    return y, ops.moe_combine(y.view(T, K, H), None, x.dtype)


def _rel_l2(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_cpu_dispatch_close_to_reference(C, case, dtype):
    # Only the GEMMs' fp32 summation order and the GELU formula differ from the reference (torch's): fp32 rel L2
    # ~1e-7 per dot product; bf16: an intermediate bf16 rounding may flip (2^-8 relative).
    x, gate_up, down, w, ids = _problem(*case, dtype)
    got = ops.moe_experts(x, gate_up, down, w, ids)
    want = reference.moe_experts(x, gate_up, down, w, ids)
    assert got.dtype == dtype and _rel_l2(got, want) <= (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_dispatch_is_batch_invariant(C, dtype):
    # Each expert's row count depends on the whole batch; a token's output must not (docs/exactness.md,
    # "Batch invariance").
    x, gate_up, down, w, ids = _problem(256, 96, 24, 13, 8, "uniform", dtype)
    full = ops.moe_experts(x, gate_up, down, w, ids)
    for lo, hi in ((0, 1), (3, 5), (17, 34), (100, 256)):
        part = ops.moe_experts(x[lo:hi], gate_up, down, w[lo:hi], ids[lo:hi])
        assert torch.equal(part, full[lo:hi]), (lo, hi)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_native_loop_close_to_reference(C, case, dtype):
    # The loop rounds where the reference's torch ops round (GEMM outputs, GELU, the product, in md); only the
    # fp32 accumulation order of the dot products differs. fp32: ~1e-7 relative per dot product → rel L2 1e-5.
    # bf16: an order change can flip an intermediate bf16 rounding (2^-8 relative) → rel L2 1e-2.
    x, gate_up, down, w, ids = _problem(*case, dtype)
    y, out = _native_loop(C, x, gate_up, down, w, ids, 1)
    assert not torch.isnan(y).any()  # every pair's row written exactly once
    want = reference.moe_experts(x, gate_up, down, w, ids)
    assert _rel_l2(out, want) <= (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("block_size", [4, 8, 16])
def test_padding_does_not_change_values(C, block_size):
    # The CUDA path aligns with block 8: segment placement and padding must not change any value.
    x, gate_up, down, w, ids = _problem(33, 64, 32, 13, 5, "half_unused", torch.bfloat16)
    y1, out1 = _native_loop(C, x, gate_up, down, w, ids, 1)
    yb, outb = _native_loop(C, x, gate_up, down, w, ids, block_size)
    assert torch.equal(y1, yb) and torch.equal(out1, outb)


def test_no_tokens(C):
    x, gate_up, down, w, ids = _problem(3, 32, 8, 4, 2, "uniform", torch.float32)
    out = ops.moe_experts(x[:0], gate_up, down, w[:0], ids[:0])
    assert out.shape == (0, 32)


def test_deterministic(C):
    x, gate_up, down, w, ids = _problem(256, 64, 32, 16, 8, "uniform", torch.bfloat16)
    first = ops.moe_experts(x, gate_up, down, w, ids)
    for _ in range(10):
        assert torch.equal(ops.moe_experts(x, gate_up, down, w, ids), first)


def test_validation_messages_name_the_argument(C):
    x, gate_up, down, w, ids = _problem(3, 32, 8, 4, 2, "uniform", torch.float32)
    align = ops.moe_align(ids, 4, 1)
    act, y = torch.empty(6, 8), torch.empty(6, 32)
    args = [x, gate_up, down, w, align.counts, align.offsets, align.sorted_pairs, act, y]
    for i, name, bad in [
        (1, "gate_up", gate_up.bfloat16()),
        (2, "down", down[:, :, :4].contiguous()),
        (7, "act", torch.empty(5, 8)),
        (8, "y", torch.empty(6, 31)),
    ]:
        with pytest.raises(ValueError, match=f"`{name}`"):
            C.moe_experts(*args[:i], bad, *args[i + 1 :])
    bad_pairs = align.sorted_pairs.clone()
    bad_pairs[0] = 99
    with pytest.raises(ValueError, match="sorted_pairs"):
        C.moe_experts(*args[:6], bad_pairs, *args[7:])


def _cuda():
    if not (torch.cuda.is_available() and ops.native.cuda_built()):
        pytest.skip("needs a CUDA device and the CUDA build of dgserve._C")


@pytest.mark.cuda
@pytest.mark.parametrize(
    "case",
    [c for c in CASES if c[1] % 8 == 0 and c[2] % 8 == 0]
    + [(256, 2816, 704, 128, 8, "uniform"), (1024, 256, 64, 128, 8, "one_group")],
    ids=lambda c: "-".join(map(str, c)),
)
def test_cuda_bf16_close_to_reference(C, case):
    _cuda()
    x, gate_up, down, w, ids = _problem(*case, torch.bfloat16)
    want = reference.moe_experts(x, gate_up, down, w, ids)
    _, mirror = _native_loop(C, x, gate_up, down, w, ids, 8)
    dev = [t.cuda() for t in (x, gate_up, down, w, ids)]
    got = ops.moe_experts(*dev)
    # Same rounding points as the reference; tensor-core fp32 accumulation order differs (bf16: see above).
    assert _rel_l2(got.cpu(), want) <= 1e-2 and _rel_l2(got.cpu(), mirror) <= 1e-2
    for _ in range(10):  # determinism loop: bit-identical runs
        assert torch.equal(ops.moe_experts(*dev), got)


@pytest.mark.cuda
def test_cuda_fp32_uses_reference_path(C):
    _cuda()
    x, gate_up, down, w, ids = _problem(7, 48, 16, 5, 2, "uniform", torch.float32)
    got = ops.moe_experts(*[t.cuda() for t in (x, gate_up, down, w, ids)])
    assert _rel_l2(got.cpu(), reference.moe_experts(x, gate_up, down, w, ids)) <= 1e-5
