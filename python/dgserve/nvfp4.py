"""NVFP4 (NVIDIA ModelOpt) weights: exact decode, a ModelOpt-faithful quantizer, and per-expert checkpoint names.

Format (spec §2.4, kernels.md §2): a weight W [N, K] is stored as
  weight          uint8 [N, Kp/2]   two E2M1 codes per byte, element 2j in the LOW nibble, 2j+1 in the high one
  weight_scale    float8_e4m3fn [N, Kp/16]   one scale per 16 consecutive elements along K
  weight_scale_2  float32 []        per-tensor global scale
  input_scale     float32 []        activation scale (only W4A4 kernels use it; kept for compatibility)
with Kp = K rounded up to a multiple of 16 (zero padding, dropped after decoding).
Dequantization, in ModelOpt's order: ``w[n, k] = e2m1(code) × (f32(weight_scale[n, k // 16]) × weight_scale_2)``
with the bracket in fp32; checkpoints in a lower dtype round once at the end.
"""
from __future__ import annotations

import re

import torch

GROUP = 16
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# rounding boundaries between consecutive E2M1 magnitudes; a value exactly on a boundary rounds to the
# even code (0.25→0, 0.75→1.0, 1.25→1.0, 1.75→2.0, 2.5→2.0, 3.5→4.0, 5→4.0), as ModelOpt's _cast_fp4 does
_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_ROUND_UP_ON_TIE = (0.75, 1.75, 3.5)   # boundaries whose upper neighbour has the even code
E4M3_MAX = 448.0
E4M3_MIN_SUBNORMAL = 2.0 ** -9
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
EXPERT_NAME = re.compile(r"^(?P<prefix>.*\.layers\.(?P<layer>\d+)\.experts)\.(?P<expert>\d+)\."
                         r"(?P<proj>gate_proj|up_proj|down_proj)\.(?P<part>weight|weight_scale|weight_scale_2|input_scale)$")


def padded(k: int) -> int:
    """K rounded up to the group size."""
    return -(-k // GROUP) * GROUP


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes in [0, 16) → fp32 values (exact)."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, Kp/2] → codes uint8 [N, Kp] (low nibble first)."""
    out = torch.empty(*packed.shape[:-1], packed.shape[-1] * 2, dtype=torch.uint8, device=packed.device)
    out[..., 0::2] = packed & 0x0F
    out[..., 1::2] = packed >> 4
    return out


def check_scales(scale: torch.Tensor, name: str) -> None:
    """E4M3 block scales must be finite and non-negative (kernels rely on it); ValueError names the tensor."""
    raw = scale.view(torch.uint8)
    if bool(((raw & 0x7F) == 0x7F).any()):
        raise ValueError(f"{name}: contains NaN block scales")
    if bool((((raw & 0x80) != 0) & (raw != 0x80)).any()):   # -0 is harmless
        raise ValueError(f"{name}: contains negative block scales")


def dequantize(weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor,
               k: int | None = None) -> torch.Tensor:
    """Exact fp32 dequantization of one NVFP4 matrix → [N, K] (K = k, padding dropped; default Kp)."""
    codes = unpack(weight)
    n, kp = codes.shape
    if weight_scale.shape != (n, kp // GROUP):
        raise ValueError(f"weight_scale: expected shape {[n, kp // GROUP]}, got {list(weight_scale.shape)}")
    block = weight_scale.to(torch.float32) * weight_scale_2.to(torch.float32).reshape(())   # fp32 bracket
    w = e2m1_decode(codes).view(n, kp // GROUP, GROUP) * block[..., None]
    return w.view(n, kp)[:, : (kp if k is None else k)]


def _cast_e2m1(x: torch.Tensor) -> torch.Tensor:
    """fp32 (already divided by its block scale) → E2M1 codes: nearest, ties to the even code, saturating at 6."""
    mag = x.abs()
    bounds = torch.tensor(_BOUNDS, dtype=torch.float32, device=x.device)
    code = torch.searchsorted(bounds, mag)   # first boundary >= |x|: ties stay on the lower side
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
