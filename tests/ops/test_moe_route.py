"""moe_route: on CPU the native op is bit-identical to reference.moe_route (fp32 and bf16), ties included."""

from __future__ import annotations

import pytest
import torch

from dgserve import ops
from dgserve.ops import reference
from dgserve.ops.moe_route import topk_replay_exact

# (tokens, hidden, experts, top_k): 1 and 7 tokens, E not a power of two, k = 1 and 8, k = E, the partial_sort
# branch of torch's topk (k·64 <= E) and the nth_element one.
SHAPES = [
    (1, 64, 4, 2),
    (7, 48, 5, 1),
    (7, 40, 6, 3),
    (33, 64, 128, 8),
    (256, 96, 13, 8),
    (5, 32, 7, 7),
    (3, 24, 129, 8),
    (9, 16, 200, 1),
    (2, 16, 1000, 8),
]


def _router(T, H, E, dtype, gen, device="cpu"):
    r = (torch.randn(T, H, generator=gen) * 2).to(dtype)
    scale = (torch.rand(H, generator=gen) + 0.5).to(dtype)
    proj = (torch.randn(E, H, generator=gen) * 0.3).to(dtype)
    pes = (torch.rand(E, generator=gen) + 0.5).to(dtype)
    return [t.to(device) for t in (r, scale, proj, pes)]


def _topk_formula(probs, scale, k):
    """The reference's route after the softmax: torch.topk, renormalise, × per-expert scale."""
    v, i = torch.topk(probs, k, dim=-1)
    return v / v.sum(dim=-1, keepdim=True) * scale[i], i


def test_topk_replay_is_calibrated(C):
    # The dispatcher checks this once per process; on this build it must hold, or CPU routing is not native.
    assert topk_replay_exact()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_bit_identical_to_reference(C, shape, dtype):
    T, H, E, K = shape
    gen = torch.Generator().manual_seed(T * 1000 + E)
    args = _router(T, H, E, dtype, gen)
    w, ids = ops.moe_route(*args, K, 1e-6)
    w_ref, ids_ref = reference.moe_route(*args, K, 1e-6)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and w.shape == (T, K)
    assert torch.equal(ids, ids_ref) and torch.equal(w, w_ref)


@pytest.mark.parametrize("E,K", [(4, 2), (5, 1), (6, 3), (7, 7), (128, 8), (128, 1), (300, 4)])
def test_ties_follow_torch_topk(C, E, K):
    # bf16 logits collide often; softmax of small integers ties everywhere. torch's CPU topk is not
    # lowest-index-first at ties: the native op replays its selection exactly.
    gen = torch.Generator().manual_seed(E + K)
    probs = torch.softmax(torch.randint(0, 3, (50, E), generator=gen).float(), dim=-1)
    scale = torch.rand(E, generator=gen) + 0.5
    w = torch.empty(50, K)
    ids = torch.empty(50, K, dtype=torch.int64)
    C.moe_route(probs, scale, K, False, w, ids, ops.native.sum_lanes())
    w_ref, ids_ref = _topk_formula(probs, scale, K)
    assert torch.equal(ids, ids_ref) and torch.equal(w, w_ref)


def test_bf16_model_with_ties(C):
    gen = torch.Generator().manual_seed(11)
    r, scale, proj, pes = _router(64, 32, 128, torch.bfloat16, gen)
    proj = (proj * 4).round() / 4  # coarse logits: many exact ties among 128 experts
    w, ids = ops.moe_route(r, scale, proj, pes, 8, 1e-6)
    w_ref, ids_ref = reference.moe_route(r, scale, proj, pes, 8, 1e-6)
    assert torch.equal(ids, ids_ref) and torch.equal(w, w_ref)


def test_leading_dims_and_empty(C):
    gen = torch.Generator().manual_seed(5)
    r, scale, proj, pes = _router(6, 32, 9, torch.float32, gen)
    w, ids = ops.moe_route(r.view(2, 3, 32), scale, proj, pes, 3, 1e-6)
    w_ref, ids_ref = reference.moe_route(r.view(2, 3, 32), scale, proj, pes, 3, 1e-6)
    assert w.shape == (2, 3, 3) and torch.equal(w, w_ref) and torch.equal(ids, ids_ref)
    w, ids = ops.moe_route(r[:0], scale, proj, pes, 3, 1e-6)
    assert w.shape == (0, 3) and ids.shape == (0, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_from_logits_mode_matches_within_fp32(C, dtype):
    # The CPU mirror of the CUDA kernel's formula: softmax with libm expf and a sequential sum instead of
    # torch's Sleef exp and lane-tree sum, so weights differ by a few fp32 ulp (rtol 1e-6); distinct logits
    # (a scaled permutation, exact in bf16) make the selection unambiguous, so ids are equal.
    gen = torch.Generator().manual_seed(2)
    T, E, K = 40, 96, 8
    logits = torch.stack([torch.randperm(E, generator=gen) for _ in range(T)]).float().mul(0.0625).to(dtype)
    scale = torch.rand(E, generator=gen) + 0.5
    w = torch.empty(T, K)
    ids = torch.empty(T, K, dtype=torch.int64)
    C.moe_route(logits, scale, K, True, w, ids, ops.native.sum_lanes())
    w_ref, ids_ref = _topk_formula(torch.softmax(logits, -1, dtype=torch.float32), scale, K)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=1e-6, atol=1e-7)


def test_deterministic(C):
    gen = torch.Generator().manual_seed(9)
    args = _router(257, 64, 128, torch.bfloat16, gen)
    first = ops.moe_route(*args, 8, 1e-6)
    for _ in range(10):
        again = ops.moe_route(*args, 8, 1e-6)
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])


def test_native_disabled_uses_reference(C, monkeypatch):
    calls = []
    monkeypatch.setattr(ops.native._C, "moe_route", lambda *a: calls.append(a), raising=False)
    gen = torch.Generator().manual_seed(1)
    args = _router(3, 16, 4, torch.float32, gen)
    with ops.native_disabled():
        ops.moe_route(*args, 2, 1e-6)
    assert calls == []


def test_validation_messages_name_the_argument(C):
    probs = torch.rand(3, 6)
    w, ids, scale = torch.empty(3, 2), torch.empty(3, 2, dtype=torch.int64), torch.ones(6)
    with pytest.raises(ValueError, match="`scores`"):
        C.moe_route(probs.half(), scale, 2, False, w, ids, 8)
    with pytest.raises(ValueError, match="`per_expert_scale`"):
        C.moe_route(probs, torch.ones(5), 2, False, w, ids, 8)
    with pytest.raises(ValueError, match="`top_k`"):
        C.moe_route(probs, scale, 7, False, w, ids, 8)
    with pytest.raises(ValueError, match="`ids`"):
        C.moe_route(probs, scale, 2, False, w, torch.empty(3, 2, dtype=torch.int32), 8)
    with pytest.raises(ValueError, match="float32"):
        C.moe_route(probs.bfloat16(), scale, 2, False, w, ids, 8)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "shape", [(1, 64, 4, 2), (7, 48, 5, 1), (33, 64, 128, 8), (300, 96, 13, 8)], ids=lambda s: "x".join(map(str, s))
)
def test_cuda_close_to_reference(C, shape, dtype):
    if not (torch.cuda.is_available() and ops.native.cuda_built()):
        pytest.skip("needs a CUDA device and the CUDA build of dgserve._C")
    T, H, E, K = shape
    gen = torch.Generator().manual_seed(T + E)
    args = _router(T, H, E, dtype, gen)
    w_ref, ids_ref = reference.moe_route(*args, K, 1e-6)
    w, ids = ops.moe_route(*[a.cuda() for a in args], K, 1e-6)
    # Same logits up to the GPU GEMM's order; softmax/exp and tie rules differ (lowest index on CUDA), so
    # compare the weights per selected expert where both picked it, and the id sets.
    same = (ids.cpu() == ids_ref).float().mean().item()
    assert same >= (0.97 if dtype == torch.bfloat16 else 0.995), same
    torch.testing.assert_close(
        w.cpu().sum(-1), w_ref.sum(-1), rtol=2e-2 if dtype == torch.bfloat16 else 1e-4, atol=1e-3
    )
    for _ in range(10):  # determinism
        w2, ids2 = ops.moe_route(*[a.cuda() for a in args], K, 1e-6)
        assert torch.equal(w2, w) and torch.equal(ids2, ids)
