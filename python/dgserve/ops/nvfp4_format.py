"""The NVFP4 format as the ops use it: exact decode, a ModelOpt-faithful quantizer, the W4A16 kernel layout and the
experts' torch reference (docs/kernels.md, NVFP4 layout).

Format: a weight W [N, K] is stored as
  weight          uint8 [N, Kp/2]   two E2M1 codes per byte, element 2j in the LOW nibble, 2j+1 in the high one
  weight_scale    float8_e4m3fn [N, Kp/16]   one scale per 16 consecutive elements along K
  weight_scale_2  float32 []        per-tensor global scale
  input_scale     float32 []        activation scale (only W4A4 kernels use it; kept for compatibility)
with Kp = K rounded up to a multiple of 16 (zero padding, dropped after decoding).
Dequantization, in ModelOpt's order: ``w[n, k] = e2m1(code) × (f32(weight_scale[n, k // 16]) × weight_scale_2)``
with the bracket in fp32; checkpoints in a lower dtype round once at the end.

This module is the ops layer's: it imports torch only (never ``dgserve.model.nvfp4``, the model, or the engine).
``dgserve.ops.nvfp4_repack`` holds the repack op and ``pack_experts`` (a layer's experts → ``PackedExperts``);
``dgserve.model.nvfp4`` re-exports both modules next to what loading needs on top (checkpoint names).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

GROUP = 16
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


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
    if bool((((raw & 0x80) != 0) & (raw != 0x80)).any()):  # -0 is harmless
        raise ValueError(f"{name}: contains negative block scales")


def dequantize(
    weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor, k: int | None = None
) -> torch.Tensor:
    """Exact fp32 dequantization of one NVFP4 matrix → [N, K] (K = k, padding dropped; default Kp)."""
    codes = unpack(weight)
    n, kp = codes.shape
    if weight_scale.shape != (n, kp // GROUP):
        raise ValueError(f"weight_scale: expected shape {[n, kp // GROUP]}, got {list(weight_scale.shape)}")
    block = weight_scale.to(torch.float32) * weight_scale_2.to(torch.float32).reshape(())  # fp32 bracket
    w = e2m1_decode(codes).view(n, kp // GROUP, GROUP) * block[..., None]
    return w.view(n, kp)[:, : (kp if k is None else k)]


# ----------------------------------------------------------------------------------------------------------
# The quantizer (ModelOpt's rules): tests, the self-check and ``--quantize nvfp4`` build NVFP4 weights with it
# ----------------------------------------------------------------------------------------------------------

# rounding boundaries between consecutive E2M1 magnitudes; a value exactly on a boundary rounds to the
# even code (0.25→0, 0.75→1.0, 1.25→1.0, 1.75→2.0, 2.5→2.0, 3.5→4.0, 5→4.0), as ModelOpt's _cast_fp4 does
_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_ROUND_UP_ON_TIE = (0.75, 1.75, 3.5)  # boundaries whose upper neighbour has the even code
E4M3_MAX = 448.0
E4M3_MIN_SUBNORMAL = 2.0**-9


def cast_e2m1(x: torch.Tensor) -> torch.Tensor:
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
    codes = cast_e2m1((blocks / denom[..., None]).view(n, kp))
    packed = (codes[:, 1::2] << 4) | codes[:, 0::2]
    return packed, scale, scale_2.reshape(()).to(torch.float32)


# ----------------------------------------------------------------------------------------------------------
# The W4A16 kernel layout (docs/kernels.md; csrc/ops/nvfp4_layout.h is the contract, this is its torch reference,
# written independently: index tensors here, per-element functions there)
# ----------------------------------------------------------------------------------------------------------

CHUNK_K = 64  # K per chunk of the packed layout (4 k-tiles of mma.m16n8k16)
_SCALE_BIAS = 0x7680  # bf16 bits of 2^110 = 2^-9 · 2^119: scale code 0


class PackedExperts(NamedTuple):
    """One layer's NVFP4 experts in the kernel layout (built once at load by ``nvfp4_repack.pack_experts``).

    With KC1 = ceil(pad16(H) / 64), KC2 = ceil(pad16(I) / 64):
    w13 int32 [E, 2I/16, KC1, 128], s13 uint8 [E, 2I/16, KC1, 64]: gate and up, rows interleaved by 8;
    w2 int32 [E, H/16, KC2, 128], s2 uint8 [E, H/16, KC2, 64]: down; gs fp32 [E, 3]: weight_scale_2 of
    gate, up, down (applied after the fp32 sums, never folded into the block scales).
    """

    w13: torch.Tensor
    s13: torch.Tensor
    w2: torch.Tensor
    s2: torch.Tensor
    gs: torch.Tensor
    hidden: int
    inter: int


def chunks(k: int) -> int:
    """K-chunks of 64 covering padded(k)."""
    return -(-padded(k) // CHUNK_K)


def interleave_rows(n: int, device=None) -> torch.Tensor:
    """Source row of each packed row of a stacked [gate; up] operand [n = 2I]: 16i + r → 8i + r (gate),
    16i + 8 + r → I + 8i + r (up)."""
    r = torch.arange(n, device=device)
    i, q = r // 16, r % 16
    return torch.where(q < 8, 8 * i + q, n // 2 + 8 * i + q - 8)


def _fragments(device) -> tuple[torch.Tensor, torch.Tensor]:
    """For lane l and fragment element i of mma.m16n8k16's A operand: flat index row·16 + col inside the 16×16
    tile [32, 8], and the bit position of element i in the lane's word [8]."""
    lane = torch.arange(32, device=device)[:, None]
    i = torch.arange(8, device=device)[None, :]
    row = lane // 4 + 8 * ((i // 2) % 2)
    col = 2 * (lane % 4) + i % 2 + 8 * (i // 4)
    shift = torch.where(i[0] % 2 == 1, 28, 12) - 4 * (i[0] // 2)
    return row * 16 + col, shift


def encode_scales(scale: torch.Tensor) -> torch.Tensor:
    """E4M3 block scales (finite, >= 0) → kernel scale codes uint8: bf16(s · 2^119) = bits (code << 4) + 0x7680.
    Zero scales get code 0 (``repack`` zeroes their codes)."""
    raw = scale.view(torch.uint8)
    s = raw.view(torch.float8_e4m3fn).to(torch.float32) * 2.0**119  # exact, a normal fp32
    bits = s.view(torch.int32) >> 16  # exact bf16 (<= 4 significant bits)
    code = (((bits >> 7) - 237) << 3) | ((bits >> 4) & 7)
    return torch.where((raw & 0x7F) == 0, 0, code).to(torch.uint8)


def decode_scale_codes(codes: torch.Tensor) -> torch.Tensor:
    """Kernel scale codes → the E4M3 scale values s (fp32, exact)."""
    bits = ((codes.to(torch.int32) << 4) + _SCALE_BIAS) << 16
    return bits.view(torch.float32) * 2.0**-119


def repack(
    weight: torch.Tensor, weight_scale: torch.Tensor, interleave: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The formula of ``reference.nvfp4_repack``: ModelOpt tensors of E experts → (words, scales) in the kernel layout.

    weight uint8 [E, N, Kp/2]; weight_scale float8_e4m3fn (or its uint8 bytes) [E, N, Kp/16], finite and >= 0;
    interleave: N = 2I stacks gate over up (GEMM1's operand). → words int32 [E, N/16, KC, 128] (lane-major
    fragment words), scales uint8 [E, N/16, KC, 64] (byte 8g + 4h + j: row g + 8h, k-block j of the chunk).
    """
    E, N, half = weight.shape
    kp, kc, dev = 2 * half, chunks(2 * half), weight.device
    if N % 16:
        raise ValueError(f"nvfp4_repack: rows must be a multiple of 16 (I of 8 for gate/up), got {N}")
    raw = weight_scale.reshape(E, N, kp // GROUP).view(torch.uint8)
    check_scales(raw, "weight_scale")
    codes = unpack(weight).view(E, N, kp // GROUP, GROUP).masked_fill(((raw & 0x7F) == 0)[..., None], 0)
    enc = encode_scales(raw)
    if interleave:
        rows = interleave_rows(N, dev)
        codes, enc = codes[:, rows], enc[:, rows]
    codes = torch.nn.functional.pad(codes.reshape(E, N, kp), (0, kc * CHUNK_K - kp))
    tiles = codes.view(E, N // 16, 16, kc, 4, 16).permute(0, 1, 3, 4, 2, 5).reshape(E, N // 16, kc, 4, 256)
    index, shift = _fragments(dev)
    frag = tiles[..., index.reshape(-1)].view(E, N // 16, kc, 4, 32, 8).to(torch.int64)
    words = (frag << shift).sum(-1).transpose(-1, -2)  # [E, RT, KC, 32 lanes, 4 k-tiles]
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    enc = torch.nn.functional.pad(enc, (0, 4 * kc - kp // GROUP))
    scales = enc.view(E, N // 16, 2, 8, kc, 4).permute(0, 1, 4, 3, 2, 5).reshape(E, N // 16, kc, 64)
    return words.reshape(E, N // 16, kc, 128).contiguous(), scales.contiguous()


def decode_repacked(words: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Inverse of ``repack`` up to the global scale: fp32 [E, N, 64·KC] of E2M1 · s in packed row order
    (interleaved for GEMM1), 0 past Kp. The native ``nvfp4_decode`` returns these values × 2^-7 in bf16."""
    E, RT, kc = words.shape[:3]
    w = (words.view(E, RT, kc, 32, 4).to(torch.int64) & 0xFFFFFFFF).transpose(-1, -2)  # [E, RT, KC, 4, 32]
    index, shift = _fragments(words.device)
    codes = ((w[..., None] >> shift) & 0xF).reshape(E, RT, kc, 4, 256)
    tiles = torch.empty_like(codes)
    tiles[..., index.reshape(-1)] = codes
    tiles = tiles.view(E, RT, kc, 4, 16, 16).permute(0, 1, 4, 2, 3, 5).reshape(E, RT * 16, kc * 4, 16)
    s = decode_scale_codes(scales.view(E, RT, kc, 8, 2, 4).permute(0, 1, 4, 3, 2, 5).reshape(E, RT * 16, kc * 4))
    return (e2m1_decode(tiles) * s[..., None]).reshape(E, RT * 16, kc * CHUNK_K)


def expert_outputs(
    x: torch.Tensor,
    experts: PackedExperts,
    weights: torch.Tensor,
    offsets: torch.Tensor,
    sorted_pairs: torch.Tensor,
    decode=decode_repacked,
) -> torch.Tensor:
    """Kernel-faithful reference of ``_C.nvfp4_moe_experts`` (torch GEMMs per expert): y by pair, not combined.

    x [T, H] (bf16 for the kernel); weights [T, K] fp32; offsets [E+1], sorted_pairs [P] int32 from
    ``moe_align`` (entries outside [0, T·K) are padding) → y [T·K, H] fp32 by pair p = t·K + k:
    ``act = bf16(gelu_tanh(gs_g · (Wg_q·x_t)) · (gs_u · (Wu_q·x_t)))``, ``y_p = (gs_d · (Wd_q·act)) · w_p``,
    W_q = E2M1·E4M3 exactly, fp32 sums. Pairs absent from sorted_pairs get zero rows. ``decode`` may be any
    exact decoder with ``decode_repacked``'s contract (the CPU op passes the native one: same values, faster).
    """
    T, K = weights.shape
    H, inter, P = experts.hidden, experts.inter, T * K
    y = torch.zeros(P, H, dtype=torch.float32, device=x.device)
    offs = offsets.tolist()
    pairs = sorted_pairs.long()
    gather = torch.argsort(interleave_rows(2 * inter, x.device))  # packed row of each source row
    for e in range(experts.gs.shape[0]):
        seg = pairs[offs[e] : offs[e + 1]]
        seg = seg[(seg >= 0) & (seg < P)]
        if seg.numel() == 0:
            continue
        w13 = decode(experts.w13[e : e + 1], experts.s13[e : e + 1])[0][gather, :H]  # [2I, H]: gate; up
        wd = decode(experts.w2[e : e + 1], experts.s2[e : e + 1])[0][:, :inter]  # [H, I]
        gs = experts.gs[e]
        gu = x[seg // K].float() @ w13.T
        act = torch.nn.functional.gelu(gu[:, :inter] * gs[0], approximate="tanh") * (gu[:, inter:] * gs[1])
        y[seg] = ((act.to(torch.bfloat16).float() @ wd.T) * gs[2]) * weights.reshape(-1)[seg, None]
    return y
