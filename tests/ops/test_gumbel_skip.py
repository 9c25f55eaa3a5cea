"""The exact Gumbel skips of diffusion_step: a chunk's draw is skipped when f32(y + kGumbelMax) < the running best z
for each of its entries, and its logs when f32(y + gumbel_upper_bound(r)) < the best for each entry's own Philox
word r. They are exact only if kGumbelMax and the per-word bound bound every Gumbel value the contract can produce,
and the sampled tokens must equal argmax(processed + the native noise) bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dgserve import ops
from dgserve.ops import reference


def test_gumbel_max_bounds_every_u(C):
    # g depends on the Philox word r only through j = r >> 9: all 2^23 values.
    j = torch.arange(2**23, dtype=torch.int64)
    g = torch.empty(2**23, dtype=torch.float32)
    C.gumbel(j << 9, g)
    bound = np.float32(C.build_info()["gumbel_max"])
    assert g.max().item() <= bound  # the skip never drops a possible winner
    assert g.max().item() == bound  # and the bound is tight (the value at u = 1 - 2^-24)


def test_the_per_word_bound_bounds_every_u(C):
    # g and its bound depend on the Philox word r only through j = r >> 9: all 2^23 values.
    r = torch.arange(2**23, dtype=torch.int64) << 9
    g, bound = torch.empty(2**23), torch.empty(2**23)
    C.gumbel(r, g)
    C.gumbel_bound(r, bound)
    assert (bound >= g).all()  # the log skip never drops a possible winner
    # In the tail that wins races (u > 7/8, v = 1 - u < 1/8) loose by less than ln 2 (the exponent of v) plus
    # log(1 + v) (-log u against v): the logs of an entry are needed only that close to the running best.
    tail = (bound - g).double()[-(2**20) :]
    assert tail.max().item() < 0.6932 + 0.1178 + 2**-14
    assert tail.mean().item() < 0.5
    with pytest.raises(ValueError, match="not a uint32"):
        C.gumbel_bound(torch.tensor([-1]), torch.empty(1))


def test_flat_logits_sample_exactly(C):
    # near-flat logits (the small model's): the race is won by the noise, most chunks skip their logs; V odd, so the
    # last chunk is partial and the last pair of chunks has one chunk
    gen = torch.Generator().manual_seed(11)
    B, C_len, V = 3, 5, 5000
    logits = torch.randn(B, C_len, V, generator=gen)
    seeds = torch.randint(0, 2**62, (B,), generator=gen)
    blocks, steps = torch.randint(0, 9, (B,), generator=gen), torch.randint(1, 48, (B,), generator=gen)
    out = ops.diffusion_step(logits, torch.ones(B), seeds, blocks, steps, torch.full((B,), 1e30))
    noise = ops.gumbel_noise(seeds, blocks, steps, C_len, V)
    assert torch.equal(out.canvas, torch.argmax(out.processed + noise, dim=-1))


def _race_case(B, C_len, V, seed):
    """Logits where the Gumbel race is won far from the argmax: entry 0 leads by 10 (its z ~ 10.5), half of the
    other entries sit at 0 (they win with g > ~10.5: a few per row at V = 65536), the rest at -7 or -30, which
    the skip drops once the running best exceeds 9.6 / -13.4."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.zeros(B, C_len, V)
    pick = torch.randint(0, 3, (B, C_len, V), generator=gen)
    logits[pick == 1] = -7.0
    logits[pick == 2] = -30.0
    logits[..., 0] = 10.0
    temperature = torch.ones(B)
    seeds = torch.randint(0, 2**62, (B,), generator=gen)
    blocks = torch.randint(0, 9, (B,), generator=gen)
    steps = torch.randint(1, 48, (B,), generator=gen)
    bound = torch.full((B,), 1e30)  # everything accepted: canvas = the sample
    return logits, temperature, seeds, blocks, steps, bound


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_skip_leaves_the_sample_exact(C, dtype):
    case = list(_race_case(2, 6, 65536, seed=3))
    case[0] = case[0].to(dtype)
    out = ops.diffusion_step(*case)
    _, _, seeds, blocks, steps, _ = case
    noise = ops.gumbel_noise(seeds, blocks, steps, 6, 65536)  # the native draw, bit for bit
    want = torch.argmax(out.processed + noise, dim=-1)
    assert out.accepted.all()
    assert torch.equal(out.canvas, want)
    # the case exercises the skip: the race is won away from the argmax (entry 0) in most positions
    assert (want != 0).float().mean().item() >= 0.25


def test_skip_keeps_the_sample_when_the_leader_comes_late(C):
    # the running best rises late in the row: earlier chunks were computed, later low entries are skipped
    case = list(_race_case(1, 4, 40000, seed=8))
    case[0][..., 0] = 0.0
    case[0][..., 39999] = 10.0
    out = ops.diffusion_step(*case)
    noise = ops.gumbel_noise(*case[2:5], 4, 40000)
    assert torch.equal(out.canvas, torch.argmax(out.processed + noise, dim=-1))


def test_nan_and_inf_rows_are_unaffected_by_the_skip(C):
    case = list(_race_case(1, 3, 3000, seed=5))
    case[0][0, 0, 1234] = float("nan")  # a NaN wins (torch.argmax's rule)
    case[0][0, 1, :] = float("-inf")  # all -inf: index 0
    case[0][0, 2, 2999] = float("inf")  # +inf wins
    out = ops.diffusion_step(*case)
    ref = reference.diffusion_step(*case)
    assert out.argmax[0].tolist() == [1234, 0, 2999]
    assert torch.equal(out.canvas, ref.canvas) and torch.equal(out.accepted, ref.accepted)  # NaN H: renoised
    assert torch.isnan(out.entropy).all()
