"""gumbel_noise: the native op against reference.gumbel_noise (docs/seeded-noise.md). The native logs are the
contract's dg_logf, the reference's torch.log: the same noise within 2 ulp of max(|g|, 1) (the contract's bound;
torch.log's last bits depend on the machine, test_philox.py), same shape and dtype; the Philox words and the
Gumbel transform themselves are checked in test_philox.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dgserve import ops
from dgserve.ops import reference
from dgserve.ops.gumbel_noise import gumbel_noise_native_ok


def _inputs(B: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    seeds = torch.randint(-(2**63), 2**63 - 1, (B,), generator=gen, dtype=torch.int64)
    blocks = torch.randint(0, 2**32, (B,), generator=gen, dtype=torch.int64)
    steps = torch.randint(0, 2**31, (B,), generator=gen, dtype=torch.int64)
    return seeds, blocks, steps


def _ulps_of_max_g_1(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = torch.from_numpy(np.spacing(np.maximum(np.abs(want.numpy()), 1).astype(np.float32)))
    return ((got - want).abs() / scale).max().item()


@pytest.mark.parametrize("B, C_len, V", [(1, 1, 1), (2, 5, 7), (3, 16, 301), (1, 3, 4099)])
def test_native_within_two_ulp_of_reference(C, B, C_len, V):
    args = _inputs(B, B * 100 + V)
    assert gumbel_noise_native_ok(*args, C_len, V)
    got = ops.gumbel_noise(*args, C_len, V)
    want = reference.gumbel_noise(*args, C_len, V)
    assert got.shape == (B, C_len, V) and got.dtype == torch.float32
    assert torch.isfinite(got).all()
    assert _ulps_of_max_g_1(got, want) <= 2.0
    with ops.native_disabled():
        assert torch.equal(ops.gumbel_noise(*args, C_len, V), want)


def test_empty_canvas(C):
    args = _inputs(2, 3)
    assert ops.gumbel_noise(*args, 0, 11).shape == (2, 0, 11)


def test_other_inputs_use_the_reference(C):
    seeds, blocks, steps = _inputs(2, 4)
    assert not gumbel_noise_native_ok(seeds.int(), blocks, steps, 3, 5)  # int32 seeds
    assert not gumbel_noise_native_ok(seeds, blocks[:1], steps, 3, 5)  # shapes disagree
    assert not gumbel_noise_native_ok(seeds, blocks, steps, 3, 0)  # no vocabulary
    got = ops.gumbel_noise(seeds.int(), blocks, steps, 3, 5)
    assert torch.equal(got, reference.gumbel_noise(seeds.int(), blocks, steps, 3, 5))


def test_deterministic(C):
    args = _inputs(3, 5)
    first = ops.gumbel_noise(*args, 7, 257)
    for _ in range(10):
        assert torch.equal(ops.gumbel_noise(*args, 7, 257), first)


def test_native_validates_arguments(C):
    seeds, blocks, steps = _inputs(1, 6)
    with pytest.raises(ValueError, match="`out`"):
        C.gumbel_noise(seeds, blocks, steps, 2, 5, torch.empty(1, 2, 4))
    with pytest.raises(ValueError, match="`steps`"):
        C.gumbel_noise(seeds, blocks, steps.int(), 2, 5, torch.empty(1, 2, 5))
