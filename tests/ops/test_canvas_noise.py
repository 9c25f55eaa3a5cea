"""canvas_noise (docs/seeded-noise.md, "Canvas noise"): worked examples, and native == reference bit for bit."""

from __future__ import annotations

import pytest
import torch

from dgserve import ops
from dgserve.ops import reference

T = torch.tensor


def test_spec_examples_reference():
    with ops.native_disabled():
        assert ops.canvas_noise(T([1234]), T([0]), T([0]), 8, 300).tolist() == [[292, 281, 260, 166, 35, 57, 82, 145]]
        tok = ops.canvas_noise(T([0x0123456789ABCDEF]), T([3]), T([7]), 6, 262144)
        assert tok[0, 5].item() == 92438


def test_spec_examples_native(C):
    out = torch.empty(1, 8, dtype=torch.int64)
    C.canvas_noise(T([1234]), T([0]), T([0]), 8, 300, out)
    assert out.tolist() == [[292, 281, 260, 166, 35, 57, 82, 145]]
    assert ops.canvas_noise(T([0x0123456789ABCDEF]), T([3]), T([7]), 6, 262144)[0, 5].item() == 92438


@pytest.mark.parametrize("B, C_len, V", [(1, 1, 1), (2, 5, 7), (3, 16, 300), (4, 13, 262144), (1, 256, 32768)])
def test_native_matches_reference(C, B, C_len, V):
    gen = torch.Generator().manual_seed(B * 1000 + C_len)
    seeds = torch.randint(-(2**63), 2**63 - 1, (B,), generator=gen, dtype=torch.int64)
    seeds[0] = -1  # all key bits set
    blocks = torch.randint(0, 2**32, (B,), generator=gen, dtype=torch.int64)
    steps = torch.randint(0, 2**31, (B,), generator=gen, dtype=torch.int64)
    got = ops.canvas_noise(seeds, blocks, steps, C_len, V)
    assert torch.equal(got, reference.canvas_noise(seeds, blocks, steps, C_len, V))


def test_native_rejects_counters_out_of_range(C):
    out = torch.empty(1, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match="steps"):
        C.canvas_noise(T([1]), T([0]), T([-1]), 4, 10, out)
    with pytest.raises(ValueError, match="blocks"):
        C.canvas_noise(T([1]), T([2**32]), T([0]), 4, 10, out)


def test_native_validates_arguments(C):
    with pytest.raises(ValueError, match="`out`"):
        C.canvas_noise(T([1]), T([0]), T([0]), 4, 10, torch.empty(1, 5, dtype=torch.int64))
    with pytest.raises(ValueError, match="`seeds`"):
        C.canvas_noise(T([1.0]), T([0]), T([0]), 4, 10, torch.empty(1, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="`blocks`"):
        C.canvas_noise(T([1]), T([0, 1]), T([0]), 4, 10, torch.empty(1, 4, dtype=torch.int64))


def test_native_disabled_context_restores(C):
    assert ops.native_enabled()
    with ops.native_disabled():
        assert not ops.native_enabled() and not ops.has_native("canvas_noise")
        with ops.native_disabled():
            assert not ops.native_enabled()
        assert not ops.native_enabled()
    assert ops.native_enabled() and ops.has_native("canvas_noise")
