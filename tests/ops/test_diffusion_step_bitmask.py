"""diffusion_step with a token bitmask (structured output): native vs reference on odd shapes, and what masking
means for every output: a disallowed token has probability 0 in the argmax, the Gumbel draw, the entropy (the
acceptance rule sees the masked distribution) and the processed logits (-inf; the self-conditioning input).

Tolerances are those of test_diffusion_step.py (same reasons): processed and argmax bit-exact, entropy within
the reference's own fp32 error, the sample exactly argmax(processed + the native noise).
"""

from __future__ import annotations

import pytest
import torch
from test_diffusion_step import (
    ENTROPY_ATOL_VS_REFERENCE,
    assert_tokens_differ_only_at_near_ties,
    make_case,
    native_sample,
)

from dgserve import ops
from dgserve.ops import reference


def pack(allowed: torch.Tensor) -> torch.Tensor:
    """allowed [..., V] bool → bitmask [..., ceil(V/32)] int32 (bit v % 32 of word v // 32), junk in bits >= V."""
    V = allowed.shape[-1]
    W = (V + 31) // 32
    pad = torch.ones(*allowed.shape[:-1], 32 * W - V, dtype=torch.bool)  # bits >= V set: must be ignored
    bits = torch.cat([allowed, pad], -1).view(*allowed.shape[:-1], W, 32).to(torch.int64)
    words = (bits << torch.arange(32)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def random_allowed(B, C_len, V, seed, p=0.3):
    gen = torch.Generator().manual_seed(seed)
    allowed = torch.rand(B, C_len, V, generator=gen) < p
    allowed[..., torch.randint(0, V, (1,), generator=gen)] = True  # never fully masked here
    return allowed


def test_pack_roundtrip():
    allowed = random_allowed(2, 3, 77, seed=1)
    assert torch.equal(reference.bitmask_allowed(pack(allowed), 77), allowed)


# V not a multiple of 32, V = 1 and 2, a prime, exactly 32 and 64, and a canvas of 1
MASK_SHAPES = [(1, 1, 1), (2, 3, 2), (2, 5, 31), (1, 4, 32), (3, 7, 33), (2, 16, 97), (1, 5, 64), (2, 6, 1000)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B, C_len, V", MASK_SHAPES)
def test_masked_step_matches_reference(C, B, C_len, V, dtype):
    case = make_case(B, C_len, V, dtype, seed=7 * B + 3 * C_len + V)
    allowed = random_allowed(B, C_len, V, seed=V + C_len)
    mask = pack(allowed)
    out = ops.diffusion_step(*case, mask)
    ref = reference.diffusion_step(*case, mask)
    assert torch.equal(out.processed, ref.processed)
    assert torch.equal(out.argmax, ref.argmax)
    assert torch.allclose(out.entropy, ref.entropy, rtol=0, atol=ENTROPY_ATOL_VS_REFERENCE)
    assert torch.equal(out.accepted, reference.entropy_bound_accept(out.entropy, case[5]))
    # disallowed tokens: -inf processed, never the argmax, never sampled where accepted
    assert bool((out.processed[~allowed] == float("-inf")).all())
    assert bool(allowed.gather(-1, out.argmax[..., None]).all())
    sample = native_sample(out, case[2], case[3], case[4])
    assert bool(allowed.gather(-1, sample[..., None]).all())
    noise = reference.canvas_noise(case[2], case[3], case[4], C_len, V)
    assert torch.equal(out.canvas, torch.where(out.accepted, sample, noise))
    assert_tokens_differ_only_at_near_ties(sample, case, out.processed)


def test_no_mask_and_all_ones_mask_equal_today(C):
    """bitmask None keeps today's results bit for bit; an all-allowed mask gives the same results."""
    case = make_case(3, 16, 1000, seed=9)
    base = ops.diffusion_step(*case)
    assert all(torch.equal(a, b) for a, b in zip(base, ops.diffusion_step(*case, None), strict=True))
    ones = pack(torch.ones(3, 16, 1000, dtype=torch.bool))
    assert all(torch.equal(a, b) for a, b in zip(base, ops.diffusion_step(*case, ones), strict=True))


def test_all_but_one_masked_forces_that_token(C):
    B, C_len, V = 2, 9, 101
    case = list(make_case(B, C_len, V, seed=4))
    case[5] = torch.full((B,), 1e30)  # accept everything: the canvas is the sample
    only = torch.randint(0, V, (B, C_len), generator=torch.Generator().manual_seed(2))
    allowed = torch.zeros(B, C_len, V, dtype=torch.bool).scatter(-1, only[..., None], True)
    for f in (ops.diffusion_step, reference.diffusion_step):
        out = f(*case, pack(allowed))
        assert torch.equal(out.argmax, only) and torch.equal(out.canvas, only)
        assert torch.equal(out.entropy, torch.zeros(B, C_len))  # one token: probability 1, entropy exactly 0


def test_fully_masked_position_is_left_unmasked(C):
    """A position with no allowed token (bits >= V do not count) behaves exactly as with no mask."""
    B, C_len, V = 2, 4, 45
    case = make_case(B, C_len, V, seed=6)
    allowed = random_allowed(B, C_len, V, seed=3)
    allowed[0, 2] = False
    allowed[1, 0] = False
    mask = pack(allowed)  # pack sets the 19 bits >= V of the last word: still fully masked
    free = ops.diffusion_step(*case)
    for f in (ops.diffusion_step, reference.diffusion_step):
        out = f(*case, mask)
        for b, c in [(0, 2), (1, 0)]:
            assert torch.equal(out.processed[b, c], free.processed[b, c])
            assert out.argmax[b, c] == free.argmax[b, c]


def test_masked_step_deterministic_and_thread_invariant(C, cpu_levels):
    case = make_case(3, 16, 203, torch.bfloat16, seed=12)
    mask = pack(random_allowed(3, 16, 203, seed=5))
    first = ops.diffusion_step(*case, mask)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for level in cpu_levels:
            C._set_cpu_level(level)
            again = ops.diffusion_step(*case, mask)
            assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    finally:
        torch.set_num_threads(threads)


def test_bitmask_validation_names_the_argument(C, step_buffers):
    B, C_len, V = 2, 3, 40
    ins, outs = step_buffers(B, C_len, V)
    C.diffusion_step(**ins, **outs, bitmask=torch.full((B, C_len, 2), -1, dtype=torch.int32))  # valid
    for bad in [
        torch.zeros(B, C_len, 1, dtype=torch.int32),  # ceil(40 / 32) = 2 words
        torch.zeros(B, C_len, 2, dtype=torch.int64),
        torch.zeros(B, C_len * 2, dtype=torch.int32),
        torch.zeros(B, C_len, 4, dtype=torch.int32)[..., ::2],  # not contiguous
    ]:
        with pytest.raises(ValueError, match="`bitmask`"):
            C.diffusion_step(**ins, **outs, bitmask=bad)
