"""moe_align: native op bit-identical to reference.moe_align (integer only, stable order within an expert)."""

from __future__ import annotations

import pytest
import torch

from dgserve import ops
from dgserve.ops import reference


def _ids(kind: str, T: int, E: int, K: int, gen: torch.Generator) -> torch.Tensor:
    """Routing patterns: uniform top-k, all tokens on the same K experts, half the experts never used."""
    if kind == "uniform":
        return torch.rand(T, E, generator=gen).topk(K, dim=-1).indices
    if kind == "one_group":
        return torch.arange(K).repeat(T, 1)
    if kind == "half_unused":
        return torch.rand(T, (E + 1) // 2, generator=gen).topk(K, dim=-1).indices * 2 % E
    raise ValueError(kind)


CASES = [
    (T, E, K, kind)
    for T in (1, 7, 256)
    for (E, K) in ((5, 1), (13, 8), (128, 8), (3, 3))
    for kind in ("uniform", "one_group", "half_unused")
    if K <= (E + 1) // 2 or kind != "half_unused"
]


def _check_properties(out: reference.MoeAlignOut, ids: torch.Tensor, E: int, bs: int) -> None:
    flat = ids.reshape(-1)
    P = flat.numel()
    counts, offsets, pairs, blocks = (t.long() for t in out)
    assert torch.equal(counts, torch.bincount(flat, minlength=E))
    assert offsets[0] == 0 and torch.all(offsets % bs == 0)
    assert torch.all(offsets[1:] - offsets[:-1] >= counts)
    seen = torch.zeros(P, dtype=torch.long)
    for e in range(E):
        seg = pairs[offsets[e] : offsets[e + 1]]
        real = seg[: counts[e]]
        assert torch.all(flat[real] == e) and torch.all(real[1:] > real[:-1])  # stable
        assert torch.all(seg[counts[e] :] == P)  # padding = sentinel
        seen[real] += 1
        assert torch.all(blocks[offsets[e] // bs : offsets[e + 1] // bs] == e)
    assert torch.all(seen == 1) and torch.all(pairs[offsets[E] :] == P)
    assert torch.all(blocks[offsets[E] // bs :] == -1)


@pytest.mark.parametrize("block_size", [1, 4, 8, 16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_bit_identical_to_reference(C, case, block_size):
    T, E, K, kind = case
    ids = _ids(kind, T, E, K, torch.Generator().manual_seed(T + E + K))
    got = ops.moe_align(ids, E, block_size)
    want = reference.moe_align(ids, E, block_size)
    for name, g, w in zip(reference.MoeAlignOut._fields, got, want, strict=True):
        assert g.dtype == torch.int32 and torch.equal(g, w), name
    _check_properties(got, ids, E, block_size)


def test_docstring_example(C):
    # vLLM's moe_align_block_size example, with an unused expert 0 added.
    ids = torch.tensor([[2, 3, 4], [1, 2, 4], [1, 3, 4], [1, 2, 3]])
    out = ops.moe_align(ids, 5, 4)
    assert out.offsets.tolist() == [0, 0, 4, 8, 12, 16]
    assert out.sorted_pairs[:16].tolist() == [3, 6, 9, 12, 0, 4, 10, 12, 1, 7, 11, 12, 2, 5, 8, 12]
    assert out.block_expert.tolist() == [1, 2, 3, 4, -1, -1]


def test_no_pairs(C):
    ids = torch.empty(0, 8, dtype=torch.int64)
    out = ops.moe_align(ids, 6, 4)
    want = reference.moe_align(ids, 6, 4)
    assert all(torch.equal(g, w) for g, w in zip(out, want, strict=True))
    assert out.offsets.tolist() == [0] * 7 and torch.all(out.block_expert == -1)


def test_deterministic(C):
    ids = _ids("uniform", 4096, 128, 8, torch.Generator().manual_seed(0))
    first = ops.moe_align(ids, 128, 16)
    for _ in range(10):
        assert all(torch.equal(a, b) for a, b in zip(ops.moe_align(ids, 128, 16), first, strict=True))


def test_validation(C):
    ids = torch.tensor([[0, 5]])
    cap = 2 + 4 * 3
    bufs = [
        torch.empty(4, dtype=torch.int32),
        torch.empty(5, dtype=torch.int32),
        torch.empty(cap, dtype=torch.int32),
        torch.empty(cap // 4, dtype=torch.int32),
    ]
    with pytest.raises(ValueError, match=r"ids\[1\] = 5"):
        C.moe_align(ids, 4, 4, *bufs)
    with pytest.raises(ValueError, match="`sorted_pairs`"):
        C.moe_align(ids.clamp(max=3), 4, 4, bufs[0], bufs[1], torch.empty(3, dtype=torch.int32), bufs[3])
    with pytest.raises(ValueError, match="`ids`"):
        C.moe_align(ids.int(), 4, 4, *bufs)


@pytest.mark.cuda
@pytest.mark.parametrize("block_size", [1, 8, 16])
@pytest.mark.parametrize(
    "case",
    [
        (1, 5, 1, "uniform"),
        (7, 13, 8, "one_group"),
        (256, 128, 8, "uniform"),
        (4096, 128, 8, "half_unused"),
        (3000, 256, 8, "uniform"),
    ],
    ids=lambda c: "-".join(map(str, c)),
)
def test_cuda_bit_identical(C, case, block_size):
    if not (torch.cuda.is_available() and ops.native.cuda_built()):
        pytest.skip("needs a CUDA device and the CUDA build of dgserve._C")
    T, E, K, kind = case
    ids = _ids(kind, T, E, K, torch.Generator().manual_seed(T))
    want = reference.moe_align(ids, E, block_size)
    for _ in range(10):  # determinism loop
        got = ops.moe_align(ids.cuda(), E, block_size)
        for name, g, w in zip(reference.MoeAlignOut._fields, got, want, strict=True):
            assert torch.equal(g.cpu(), w), name
