"""nvfp4_repack / nvfp4_decode (CPU): the kernel layout (docs/kernels.md) against ModelOpt's tensors.

Decoding is exact by construction (E2M1 × E4M3 has ≤ 6 significant bits), so every comparison here is bit-exact:
the native decode runs the kernels' own fragment code (csrc/ops/nvfp4_layout.h) and must return
E2M1 · s · 2^-7 for every code and every finite E4M3 scale (on the CPU; the device versions are in
test_nvfp4_cuda.py).
"""

from __future__ import annotations

import nvfp4_cases as cases
import pytest
import torch

from dgserve import ops
from dgserve.model import nvfp4
from dgserve.ops import reference


@pytest.fixture(scope="module")
def C():
    if ops.native._C is None or not hasattr(ops.native._C, "nvfp4_repack"):
        pytest.skip("dgserve._C with nvfp4_repack is not built (run `python build.py`)")
    return ops.native._C


def expected_operands(codes: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """E2M1 · s · 2^-7 in float64 from the bits, rows in packed order → fp32 (exact) [128, 256]."""
    vals = torch.tensor([cases.e2m1_f64(c) for c in range(16)], dtype=torch.float64)[codes.long()]
    s = torch.tensor([cases.e4m3_f64(b) for b in range(256)], dtype=torch.float64)[scale.long()]
    return (vals * s.repeat_interleave(16, dim=1) * 2.0**-7)[rows].float()


def test_scale_codes_exhaustive():
    raw = torch.arange(0x7F, dtype=torch.uint8)
    codes = nvfp4.encode_scales(raw)
    assert codes[0] == 0 and int(codes.max()) <= 142
    want = torch.tensor([cases.e4m3_f64(b) for b in range(0x7F)], dtype=torch.float64)
    assert torch.equal(nvfp4.decode_scale_codes(codes[1:]).double(), want[1:])
    bits = (codes[1:].int() << 4) + 0x7680  # bf16 of s · 2^119: always normal, never inf
    assert bool(((bits >> 7) >= 237).all() and ((bits >> 7) <= 254).all())


@pytest.mark.parametrize("interleave", [False, True])
def test_decode_exhaustive_all_codes_all_scales(C, interleave):
    weight, scale, codes, raw = cases.exhaustive_matrix()
    words, scales = ops.nvfp4_repack(weight, scale, interleave)
    assert words.shape == (1, 8, 4, 128) and scales.shape == (1, 8, 4, 64)
    rows = nvfp4.interleave_rows(128) if interleave else torch.arange(128)
    want = expected_operands(codes, raw, rows)
    got = ops.nvfp4_decode(words, scales)[0]  # the kernels' fragment decode, on the CPU
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.float(), want), "native decode is not E2M1·s·2^-7"
    assert torch.equal(nvfp4.decode_repacked(words, scales)[0] * 2.0**-7, want)
    ref = reference.nvfp4_decode(words, scales)
    assert ref.dtype == torch.bfloat16 and torch.equal(ref.view(torch.int16), got.view(torch.int16)[None])
    nonzero = want != 0
    assert bool((got.float()[nonzero].abs() >= 2.0**-17).all())  # smallest product 0.5·2^-9·2^-7: no flush


@pytest.mark.parametrize("E,N,K", [(1, 16, 16), (3, 48, 40), (2, 32, 80), (2, 64, 144), (1, 16, 2816)])
@pytest.mark.parametrize("interleave", [False, True])
def test_native_repack_equals_reference_and_round_trips(C, E, N, K, interleave):
    weight, scale, scale_2 = cases.quantized(E, N, K, seed=N + K)
    scale.view(torch.uint8)[0, 0, 0] = 0  # a zero block scale: its codes must vanish
    words, scales = ops.nvfp4_repack(weight, scale, interleave)
    ref_words, ref_scales = reference.nvfp4_repack(weight, scale, interleave)
    assert words.dtype == torch.int32 and scales.dtype == torch.uint8
    assert torch.equal(words, ref_words) and torch.equal(scales, ref_scales)
    kp = nvfp4.padded(K)
    rows = nvfp4.interleave_rows(N) if interleave else torch.arange(N)
    dec = nvfp4.decode_repacked(words, scales)
    for e in range(E):
        want = nvfp4.dequantize(weight[e], scale[e], torch.tensor(1.0))[rows]
        assert torch.equal(dec[e, :, :kp], want)
        assert not dec[e, :, kp:].any()
        assert torch.equal(ops.nvfp4_decode(words, scales)[e].float(), dec[e] * 2.0**-7)


def test_unpermuted_scales_must_fail(C):
    """Control: scale codes left in plain row-major order decode to different weights."""
    weight, scale, _ = cases.quantized(1, 32, 128, seed=5)
    words, scales = ops.nvfp4_repack(weight, scale)
    plain = nvfp4.encode_scales(scale.view(torch.uint8)).reshape(scales.shape)
    want = nvfp4.dequantize(weight[0], scale[0], torch.tensor(1.0))
    assert torch.equal(nvfp4.decode_repacked(words, scales)[0], want)
    assert not torch.equal(ops.nvfp4_decode(words, plain)[0].float() * 128, want)


@pytest.mark.slow
def test_real_26b_expert_shapes(C):
    """One expert at DiffusionGemma 26B-A4B's shapes: gate/up [2·704, 2816] interleaved, down [2816, 704]."""
    gate, up, down = cases.layer(1, 2816, 704, seed=11)
    w13, s13 = ops.nvfp4_repack(torch.cat([gate[0], up[0]], 1), torch.cat([gate[1], up[1]], 1), True)
    assert w13.shape == (1, 88, 44, 128)
    ref = reference.nvfp4_repack(torch.cat([gate[0], up[0]], 1), torch.cat([gate[1], up[1]], 1), True)
    assert torch.equal(w13, ref[0]) and torch.equal(s13, ref[1])
    w2, s2 = ops.nvfp4_repack(down[0], down[1])
    assert w2.shape == (1, 176, 11, 128)
    assert torch.equal(nvfp4.decode_repacked(w2, s2)[0], nvfp4.dequantize(down[0][0], down[1][0], torch.tensor(1.0)))


def test_pack_experts_layout(C):
    gate, up, down = cases.layer(3, 64, 40, seed=2)
    packed = nvfp4.pack_experts(gate, up, down)
    assert (packed.hidden, packed.inter) == (64, 40)
    assert packed.w13.shape == (3, 5, 1, 128) and packed.w2.shape == (3, 4, 1, 128)
    assert torch.equal(packed.gs, torch.stack([gate[2], up[2], down[2]], 1))
    assert bool((packed.gs[:, 1] > 5 * packed.gs[:, 0]).all())  # gate and up keep their own global scales


def test_rejects_bad_scales_and_shapes(C):
    weight, scale, _ = cases.quantized(1, 16, 32, seed=1)
    for bad, what in ((0x7F, "NaN"), (0xFF, "NaN"), (0x88, "negative")):
        s = scale.clone()
        s.view(torch.uint8)[0, 3, 1] = bad
        with pytest.raises(ValueError, match=what):
            ops.nvfp4_repack(weight, s)
    with pytest.raises(ValueError, match="multiple of 16"):
        ops.nvfp4_repack(weight[:, :8], scale[:, :8])
    words = torch.empty(1, 1, 1, 128, dtype=torch.int32)
    with pytest.raises(ValueError, match="`scales`"):
        C.nvfp4_repack(weight, scale.view(torch.uint8), 0, words, torch.empty(1, 1, 1, 63, dtype=torch.uint8))
    with pytest.raises(ValueError, match="`words`"):
        C.nvfp4_repack(weight, scale.view(torch.uint8), 0, words[..., :64], torch.empty(1, 1, 1, 64, dtype=torch.uint8))
    with pytest.raises(ValueError, match="interleav"):
        C.nvfp4_repack(weight, scale.view(torch.uint8), 4, words, torch.empty(1, 1, 1, 64, dtype=torch.uint8))


def test_reference_without_extension_is_identical(C):
    weight, scale, _ = cases.quantized(2, 32, 48, seed=9)
    native = ops.nvfp4_repack(weight, scale, True)
    decoded = ops.nvfp4_decode(*native)
    with ops.native_disabled():
        ref = ops.nvfp4_repack(weight, scale, True)
        ref_decoded = ops.nvfp4_decode(*ref)
    assert all(torch.equal(a, b) for a, b in zip(native, ref, strict=True))
    assert torch.equal(decoded.view(torch.int16), ref_decoded.view(torch.int16))
