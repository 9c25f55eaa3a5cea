"""diffusion_step: the native fused sampler step against reference.diffusion_step (docs/generation.md, "The generation
algorithm", docs/seeded-noise.md, "Canvas noise"-docs/seeded-noise.md, "Gumbel noise").

What is exact and what has a tolerance, and why:
  processed, argmax, renoise tokens     bit-exact (IEEE division; integer Philox)
  sampled tokens                        exact except at near-ties of the Gumbel race: the native noise uses
                                        dg_logf, the reference torch.log (they differ by <= 2 ulp of
                                        max(|g|, 1), docs/seeded-noise.md, "dg_logf"); the native sample is exactly
                                        argmax(processed + ops.gumbel_noise) (the native noise)
  entropy                               the native value is the entropy accumulated in double and rounded
                                        once (<= 1 ulp from float64); the reference's fp32 formula is off by up
                                        to ~1e-5 at these scales, so native vs reference uses atol 3e-5
  accepted, mean_entropy                bit-exact given the native entropies (stable sort, fp64 prefix sums,
                                        torch's mean order); vs the reference's acceptance, equal wherever the
                                        entropy order and the bound test are not within 1e-5 of flipping
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dgserve import ops
from dgserve.ops import reference

ENTROPY_ATOL_VS_REFERENCE = 3e-5  # the reference's own fp32 error (measured up to 2.7e-5 at |y| ~ 1000)


def make_case(B: int, C_len: int, V: int, dtype=torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    scale = 0.5 + 6 * torch.rand(B, C_len, 1, generator=gen)  # per-position sharpness: distinct entropies
    logits = (torch.randn(B, C_len, V, generator=gen) * scale).to(dtype)
    temperature = 0.4 + 0.4 * torch.rand(B, generator=gen)
    seeds = torch.randint(-(2**63), 2**63 - 1, (B,), generator=gen, dtype=torch.int64)
    blocks = torch.randint(0, 6, (B,), generator=gen, dtype=torch.int64)
    steps = torch.randint(1, 49, (B,), generator=gen, dtype=torch.int64)
    bound = torch.rand(B, generator=gen) * 0.5 * C_len * max(1.0, float(np.log(V)))
    return logits, temperature, seeds, blocks, steps, bound


def native_sample(out, seeds, blocks, steps):
    B, C_len, V = out.processed.shape
    return torch.argmax(out.processed + ops.gumbel_noise(seeds, blocks, steps, C_len, V), dim=-1)


def entropy_f64(processed: torch.Tensor) -> torch.Tensor:
    y = processed.double()
    lp = y - y.logsumexp(-1, keepdim=True)
    return -(lp.exp() * lp).sum(-1)


def assert_tokens_differ_only_at_near_ties(native_tok, case, processed):
    logits, _, seeds, blocks, steps, _ = case
    B, C_len, V = processed.shape
    ref_g = reference.gumbel_noise(seeds, blocks, steps, C_len, V)
    nat_g = ops.gumbel_noise(seeds, blocks, steps, C_len, V)
    ref_tok = torch.argmax(processed + ref_g, dim=-1)
    diff = (native_tok != ref_tok).nonzero().tolist()
    for b, c in diff:
        z = (processed[b, c] + ref_g[b, c]).double()
        top2 = torch.topk(z, 2).values
        dg = (nat_g[b, c] - ref_g[b, c]).abs().max().item()
        margin = 2 * dg + 2 * np.spacing(np.float32(abs(top2[0].item())))
        assert (top2[0] - top2[1]).item() <= margin, f"token differs at ({b}, {c}) without a near-tie"
    return len(diff)


def robust_rows(ref_entropy, native_entropy, bound):
    """Rows whose acceptance cannot flip between the two entropy vectors (same order, no near-boundary)."""
    rows = []
    for b in range(ref_entropy.shape[0]):
        o_ref = torch.sort(ref_entropy[b], stable=True).indices
        o_nat = torch.sort(native_entropy[b], stable=True).indices
        s = ref_entropy[b][o_ref].double()
        slack = (s.cumsum(0) - s - float(bound[b])).abs()
        if torch.equal(o_ref, o_nat) and bool((slack > 1e-5 * max(1.0, abs(float(bound[b])))).all()):
            rows.append(b)
    return rows


SHAPES = [(1, 1, 1), (2, 5, 7), (3, 16, 1000), (4, 5, 1000), (1, 16, 7), (4, 1, 7), (2, 16, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B, C_len, V", SHAPES)
def test_matches_reference(C, B, C_len, V, dtype):
    case = make_case(B, C_len, V, dtype, seed=B * 100 + C_len * 10 + V)
    out = ops.diffusion_step(*case)
    ref = reference.diffusion_step(*case)
    seeds, blocks, steps, bound = case[2], case[3], case[4], case[5]

    assert torch.equal(out.processed, ref.processed)
    assert torch.equal(out.argmax, ref.argmax)
    # entropy: close to float64 (<= 1 ulp), and to the reference within the reference's own error
    h64 = entropy_f64(out.processed)
    assert ((out.entropy.double() - h64).abs() <= 1.2e-7 * h64.abs() + 1e-7).all()
    assert torch.allclose(out.entropy, ref.entropy, rtol=0, atol=ENTROPY_ATOL_VS_REFERENCE)
    # acceptance and mean: exact given the native entropies
    assert torch.equal(out.accepted, reference.entropy_bound_accept(out.entropy, bound))
    assert torch.equal(out.mean_entropy, out.entropy.mean(-1))
    rows = robust_rows(ref.entropy, out.entropy, bound)
    assert len(rows) >= (B + 1) // 2
    for b in rows:
        assert torch.equal(out.accepted[b], ref.accepted[b])
    # canvas: the native sample where accepted, contract noise elsewhere
    sample = native_sample(out, seeds, blocks, steps)
    noise = reference.canvas_noise(seeds, blocks, steps, C_len, V)
    assert torch.equal(out.canvas, torch.where(out.accepted, sample, noise))
    assert_tokens_differ_only_at_near_ties(sample, case, out.processed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_or_nothing_accepted(C, dtype):
    case = list(make_case(3, 16, 1000, dtype, seed=5))
    seeds, blocks, steps = case[2], case[3], case[4]
    case[5] = torch.full((3,), 1e30)
    out = ops.diffusion_step(*case)
    assert out.accepted.all()
    assert torch.equal(out.canvas, native_sample(out, seeds, blocks, steps))
    case[5] = torch.full((3,), -1.0)
    out = ops.diffusion_step(*case)
    assert not out.accepted.any()
    assert torch.equal(out.canvas, reference.canvas_noise(seeds, blocks, steps, 16, 1000))


def test_ties_take_the_lowest_index(C):
    gen = torch.Generator().manual_seed(11)
    logits = torch.randint(-2, 3, (2, 8, 97), generator=gen).to(torch.bfloat16)  # many exact ties
    logits[0, 0] = 0  # a constant row
    case = (
        logits,
        torch.tensor([0.5, 0.7]),
        torch.tensor([3, 4]),
        torch.tensor([0, 1]),
        torch.tensor([9, 2]),
        torch.tensor([1e30, 1e30]),
    )
    out = ops.diffusion_step(*case)
    ref = reference.diffusion_step(*case)
    assert torch.equal(out.argmax, ref.argmax) and out.argmax[0, 0].item() == 0
    assert torch.equal(out.canvas, native_sample(out, case[2], case[3], case[4]))


def test_masked_logits(C):
    case = list(make_case(2, 5, 64, seed=3))
    case[0][:, :, 1::2] = float("-inf")
    case[5] = torch.full((2,), 1e30)
    out = ops.diffusion_step(*case)
    ref = reference.diffusion_step(*case)
    assert torch.equal(out.processed, ref.processed) and torch.equal(out.argmax, ref.argmax)
    assert torch.isfinite(out.entropy).all()
    assert torch.allclose(out.entropy, ref.entropy, rtol=0, atol=ENTROPY_ATOL_VS_REFERENCE)
    assert (out.canvas % 2 == 0).all()  # never a masked token


def test_strided_logits(C):
    case = list(make_case(2, 10, 33, seed=4))
    case[0] = case[0][:, ::2, :]  # position stride 66, vocabulary contiguous
    out = ops.diffusion_step(*case)
    assert torch.equal(out.processed, reference.diffusion_step(*case).processed)


def test_deterministic_and_thread_invariant(C):
    case = make_case(3, 16, 1000, seed=9)
    first = ops.diffusion_step(*case)
    for _ in range(10):
        again = ops.diffusion_step(*case)
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = ops.diffusion_step(*case)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(first, single, strict=True))


def test_cpu_code_paths_identical(C, cpu_levels):
    case = make_case(2, 8, 203, torch.bfloat16, seed=12)
    outs = []
    for level in cpu_levels:
        C._set_cpu_level(level)
        outs.append(ops.diffusion_step(*case))
    for other in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0], other, strict=True))


def test_native_disabled_is_the_reference(C):
    case = make_case(2, 5, 7, seed=1)
    with ops.native_disabled():
        got = ops.diffusion_step(*case)
    want = reference.diffusion_step(*case)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_unsupported_inputs_fall_back(C):
    case = list(make_case(1, 3, 11, seed=2))
    case[0] = case[0].half()
    out = ops.diffusion_step(*case)
    assert all(torch.equal(a, b) for a, b in zip(out, reference.diffusion_step(*case), strict=True))


def test_validation_messages_name_the_argument(C, step_buffers):
    B, C_len, V = 2, 3, 5
    ins, outs = step_buffers(B, C_len, V)
    C.diffusion_step(**ins, **outs)  # valid
    for name, bad in [
        ("logits", torch.zeros(B, C_len, V).half()),
        ("temperature", torch.ones(B + 1)),
        ("steps", torch.ones(B)),
        ("entropy_bound", torch.ones(B, dtype=torch.float64)),
    ]:
        with pytest.raises(ValueError, match=f"`{name}`"):
            C.diffusion_step(**{**ins, name: bad}, **outs)
    for name, bad in [
        ("processed", torch.empty(B, C_len, V + 1)),
        ("accepted", torch.empty(B, C_len)),
        ("mean_entropy", torch.empty(B, 1)),
    ]:
        with pytest.raises(ValueError, match=f"`{name}`"):
            C.diffusion_step(**ins, **{**outs, name: bad})
    with pytest.raises(ValueError, match="steps"):
        C.diffusion_step(**{**ins, "steps": torch.full((B,), -1, dtype=torch.int64)}, **outs)
