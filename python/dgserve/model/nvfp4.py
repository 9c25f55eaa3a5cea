"""NVFP4 (NVIDIA ModelOpt) weights: the format, a ModelOpt-faithful quantizer, per-expert checkpoint names, and
the load-time packing of a layer's experts.

The format itself (exact decode, the W4A16 kernel layout, the experts' torch reference; docs/kernels.md, "NVFP4 format")
lives in the ops layer, ``dgserve.ops.nvfp4_format``, because the ops need it; it is re-exported here so loading
code has one name for everything NVFP4. The dependency runs one way: this module imports ``dgserve.ops``, never
the reverse (tests/test_layering.py).
"""

from __future__ import annotations

import re

import torch

from dgserve import ops
from dgserve.ops.nvfp4_format import (
    CHUNK_K,
    E2M1_VALUES,
    GROUP,
    PackedExperts,
    check_scales,
    chunks,
    decode_repacked,
    decode_scale_codes,
    dequantize,
    e2m1_decode,
    encode_scales,
    expert_outputs,
    interleave_rows,
    padded,
    repack,
    unpack,
)

__all__ = [
    "CHUNK_K",
    "E2M1_VALUES",
    "E4M3_MAX",
    "E4M3_MIN_SUBNORMAL",
    "EXPERT_NAME",
    "GROUP",
    "PROJECTIONS",
    "PackedExperts",
    "check_scales",
    "chunks",
    "decode_repacked",
    "decode_scale_codes",
    "dequantize",
    "e2m1_decode",
    "encode_scales",
    "expert_outputs",
    "interleave_rows",
    "pack_experts",
    "padded",
    "quantize",
    "repack",
    "unpack",
]

# rounding boundaries between consecutive E2M1 magnitudes; a value exactly on a boundary rounds to the
# even code (0.25→0, 0.75→1.0, 1.25→1.0, 1.75→2.0, 2.5→2.0, 3.5→4.0, 5→4.0), as ModelOpt's _cast_fp4 does
_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_ROUND_UP_ON_TIE = (0.75, 1.75, 3.5)  # boundaries whose upper neighbour has the even code
E4M3_MAX = 448.0
E4M3_MIN_SUBNORMAL = 2.0**-9
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
EXPERT_NAME = re.compile(
    r"^(?P<prefix>.*\.layers\.(?P<layer>\d+)\.experts)\.(?P<expert>\d+)\."
    r"(?P<proj>gate_proj|up_proj|down_proj)\.(?P<part>weight|weight_scale|weight_scale_2|input_scale)$"
)


def _cast_e2m1(x: torch.Tensor) -> torch.Tensor:
    """fp32 (already divided by its block scale) → E2M1 codes: nearest, ties to the even code, saturating at 6."""
    mag = x.abs()
    bounds = torch.tensor(_BOUNDS, dtype=torch.float32, device=x.device)
    code = torch.searchsorted(bounds, mag)  # first boundary >= |x|: ties stay on the lower side
    tie_up = torch.zeros_like(mag, dtype=torch.bool)
    for b in _ROUND_UP_ON_TIE:
        tie_up |= mag == b
    code = code + tie_up.to(code.dtype)
    return (code + 8 * (x < 0).to(code.dtype)).to(torch.uint8)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ModelOpt NVFP4 quantization of w [N, K] (any float dtype) → (weight, weight_scale, weight_scale_2).

    Rules (ModelOpt ``NVFP4QTensor.quantize``): K is zero-padded to a multiple of 16;
    ``weight_scale_2 = amax(|w|) / (6·448)`` in fp32; per block ``s = block_amax / (6·weight_scale_2)`` with
    all-zero blocks set to 1.0, cast to E4M3 with round-to-nearest-even (and, unlike some ModelOpt versions,
    clamped to [2^-9, 448] so a tiny non-zero block can never get a zero scale); elements
    ``q = w / (f32(s)·weight_scale_2)`` rounded to E2M1 to nearest with ties to the even code, saturating at ±6.
    A tensor of all zeros gets weight_scale_2 = 0 → its blocks all have scale 1.0 and every code is 0.
    """
    w = w.to(torch.float32)
    n, k = w.shape
    kp = padded(k)
    if kp != k:
        w = torch.nn.functional.pad(w, (0, kp - k))
    scale_2 = w.abs().amax() / (6.0 * E4M3_MAX)
    blocks = w.view(n, kp // GROUP, GROUP)
    block_amax = blocks.abs().amax(-1)
    s = block_amax / (6.0 * scale_2) if scale_2 > 0 else torch.zeros_like(block_amax)
    s = torch.where(s == 0, torch.ones_like(s), s.clamp(E4M3_MIN_SUBNORMAL, E4M3_MAX))
    scale = s.to(torch.float8_e4m3fn)
    denom = scale.to(torch.float32) * scale_2 if scale_2 > 0 else scale.to(torch.float32)
    codes = _cast_e2m1((blocks / denom[..., None]).view(n, kp))
    packed = (codes[:, 1::2] << 4) | codes[:, 0::2]
    return packed, scale, scale_2.reshape(()).to(torch.float32)


def pack_experts(gate: tuple, up: tuple, down: tuple) -> PackedExperts:
    """ModelOpt tensors of one layer → PackedExperts, each projection a tuple (weight uint8 [E, N, Kp/2],
    weight_scale e4m3 [E, N, Kp/16], weight_scale_2 fp32 [E]); gate/up [E, I, pad16(H)/2], down
    [E, H, pad16(I)/2]. Repacks with ``ops.nvfp4_repack`` (native when built) on the tensors' device."""
    E, inter = gate[0].shape[:2]
    hidden = down[0].shape[1]
    if up[0].shape != gate[0].shape or down[0].shape != (E, hidden, padded(inter) // 2):
        raise ValueError(
            f"pack_experts: gate {list(gate[0].shape)}, up {list(up[0].shape)} and down "
            f"{list(down[0].shape)} do not form one [E, I, H] expert set"
        )
    w13, s13 = ops.nvfp4_repack(torch.cat([gate[0], up[0]], 1), torch.cat([gate[1], up[1]], 1), interleave=True)
    w2, s2 = ops.nvfp4_repack(down[0], down[1])
    gs = torch.stack([gate[2], up[2], down[2]], 1).to(torch.float32).reshape(E, 3).contiguous()
    return PackedExperts(w13, s13, w2, s2, gs.to(w13.device), int(hidden), int(inter))
