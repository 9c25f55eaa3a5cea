// The NVFP4 kernel layout (docs/kernels.md, "NVFP4 kernel layout"), shared by the repack, the decode hook, the
// CPU GEMMs and the CUDA kernels: every index and bit trick lives here once, __host__ __device__, so the CPU tests
// exercise the exact code the GPU runs (except the bf16x2 multiply, which is exact either way).
//
// A weight matrix W [N, Kp] (N % 16 == 0; Kp = K rounded up to 16; ModelOpt codes, element 2j in the low nibble
// of byte j) becomes, per expert, with RT = N / 16 row tiles and KC = ceil(Kp / 64) K-chunks:
//
//   words  uint32 [RT][KC][32 lanes][4]   word (rt, kc, lane, j) holds the 8 E2M1 codes that lane needs for
//                                         k-tile kt = 4·kc + j of mma.m16n8k16's A fragment of row tile rt:
//                                         element i (0..7) = (row g + 8·((i>>1)&1), col 2t + (i&1) + 8·(i>>2))
//                                         of the 16×16 tile, g = lane/4, t = lane%4, at bit kNibbleShift[i]
//   scales uint8  [RT][KC][64]            byte 8g + 4h + j = scale code of row 16·rt + g + 8h, k-block 4·kc + j
//
// so one 16-byte load per lane fetches 4 k-tiles of fragments (a warp reads 512 contiguous bytes) and one 8-byte
// load its 8 scales. Past Kp the codes and scale codes are 0. A block whose E4M3 scale is ±0 gets codes 0 (its
// weights are 0 either way), so decode never needs a zero scale.
//
// GEMM1's operand is gate and up stacked ([2I, Kp], gate rows first) with rows interleaved by 8: packed row
// 16i + r = gate row 8i + r, packed row 16i + 8 + r = up row 8i + r (r < 8). In the m16n8 accumulator a lane then
// holds gate(8i + g) in c0/c1 and up(8i + g) in c2/c3 for the same two tokens (no shuffles for the activation).
//
// Exact decode (docs/kernels.md, "Exact in-register decode"): pair(q) = (q & 0x80008000) | ((q & 0x70007000) >> 6)
// turns the top nibble of each half-word into a bf16 equal to E2M1 · 2^-126 (code 1 → the subnormal 2^-127). A
// scale code c (0..142) decodes to the bf16 with bits (c << 4) + 0x7680, equal to s · 2^119. Their product,
// E2M1 · s · 2^-7, is a normal bf16 and exact (≤ 6 significant bits); the kernels multiply the fp32 accumulator by
// gs · 2^7 at the end.
#pragma once

#include <math.h>
#include <stdint.h>

#include "../common/dtype.h"

namespace dg {
namespace nvfp4 {

constexpr int kTileRows = 16;     // rows per row tile (mma M)
constexpr int kChunkK = 64;       // K per chunk: 4 k-tiles of 16
constexpr int kWordsPerChunk = 128;  // 32 lanes × 4 words = 512 bytes
constexpr int kScalesPerChunk = 64;  // 8 row pairs × (4 + 4) bytes
constexpr uint32_t kScaleBias = 0x7680u;  // 237 << 7: bf16 exponent field of s · 2^119 for s = 2^-9

// bit position of fragment element i within its word (elements 2r, 2r+1 end up in bits 12..15 / 28..31 after
// the word is shifted left by 4r)
DG_HD int nibble_shift(int i) { return (i & 1 ? 28 : 12) - 4 * (i >> 1); }

// (row, col) inside the 16×16 tile of fragment element i (0..7) held by `lane` (PTX mma.m16n8k16 A, row-major)
DG_HD int frag_row(int lane, int i) { return (lane >> 2) + 8 * ((i >> 1) & 1); }
DG_HD int frag_col(int lane, int i) { return 2 * (lane & 3) + (i & 1) + 8 * (i >> 2); }

// source row (in the [N, Kp] matrix) of packed row r; `interleave_half` = I for GEMM1's gate/up operand, else 0
DG_HD int64_t source_row(int64_t r, int64_t interleave_half) {
  if (interleave_half == 0) return r;
  const int64_t i = r >> 4, q = r & 15;
  return q < 8 ? 8 * i + q : interleave_half + 8 * i + (q - 8);
}

// E4M3 byte (finite, non-negative, non-zero) → scale code with bf16 bits (code << 4) + kScaleBias = s · 2^119.
// Returns 0 for ±0 (the repack zeroes that block's codes), 0xFF for NaN or a negative scale (rejected earlier).
DG_HD uint32_t encode_scale(uint32_t b) {
  if ((b & 0x7Fu) == 0u) return 0u;
  if ((b & 0x80u) != 0u || (b & 0x7Fu) == 0x7Fu) return 0xFFu;
  const uint32_t e = (b >> 3) & 15u, m = b & 7u;
  if (e > 0u) return ((e + 2u) << 3) | m;   // (1 + m/8)·2^(e-7)·2^119: bf16 exponent field e + 239 = 237 + (e + 2)
  if (m >= 4u) return (2u << 3) | ((m - 4u) << 1);   // subnormal m/8·2^-6 → normalise
  if (m >= 2u) return (1u << 3) | ((m - 2u) << 2);
  return 0u;                                          // m == 1: 2^-9
}

DG_HD bool scale_is_zero(uint32_t b) { return (b & 0x7Fu) == 0u; }

// The packed word (rt, kc, lane, j) of one matrix. `codes(row, k)` returns the 4-bit code of source element
// (row, k) (0 past Kp); `zero(row, kb)` says whether block (row, kb) has a zero scale.
template <class CodeFn, class ZeroFn>
DG_HD uint32_t pack_word(int64_t rt, int64_t kc, int lane, int j, int64_t interleave_half, int64_t kp, CodeFn codes,
                         ZeroFn zero) {
  const int64_t kt = 4 * kc + j;
  if (kt * 16 >= kp) return 0u;
  uint32_t w = 0u;
  for (int i = 0; i < 8; ++i) {
    const int64_t row = source_row(rt * kTileRows + frag_row(lane, i), interleave_half);
    if (zero(row, kt)) continue;
    w |= (uint32_t)(codes(row, kt * 16 + frag_col(lane, i)) & 0xF) << nibble_shift(i);
  }
  return w;
}

// The scale byte (rt, kc, b) of one matrix; `scale(row, kb)` returns the E4M3 byte of source block (row, kb).
template <class ScaleFn>
DG_HD uint32_t pack_scale(int64_t rt, int64_t kc, int b, int64_t interleave_half, int64_t kp, ScaleFn scale) {
  const int64_t kb = 4 * kc + (b & 3);
  if (kb * 16 >= kp) return 0u;
  const int g = b >> 3, h = (b >> 2) & 1;
  return encode_scale(scale(source_row(rt * kTileRows + g + 8 * h, interleave_half), kb));
}

// ---- decode (the MMA A operand) --------------------------------------------------------------------------

DG_HD uint32_t pair_bits(uint32_t q) { return (q & 0x80008000u) | ((q & 0x70007000u) >> 6); }
DG_HD uint32_t scale_bits(uint32_t code) { return (code << 4) + kScaleBias; }

// bf16x2 multiply of a (E2M1·2^-126 pairs) by s (s·2^119, both halves): exact, so any rounding mode agrees.
DG_HD uint32_t mul_bf16x2(uint32_t a, uint32_t s) {
#if defined(__CUDA_ARCH__)
  uint32_t d;
  // fma with -0 addend: x·y + (-0) = x·y for every x·y (including +0); exists on sm_80+ (mul.bf16x2 needs sm_90)
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(s), "r"(0x80008000u));
  return d;
#else
  const float lo = bits_to_float(a << 16) * bits_to_float(s << 16);
  const float hi = bits_to_float(a & 0xFFFF0000u) * bits_to_float(s & 0xFFFF0000u);
  return (uint32_t)float_to_bf16(lo).bits | ((uint32_t)float_to_bf16(hi).bits << 16);
#endif
}

// The four A registers (bf16x2: elements (0,1), (2,3), (4,5), (6,7)) of k-tile j from a lane's word q and its
// scale words sg (row g, k-blocks 0..3 in bytes 0..3) and sg8 (row g + 8).
DG_HD void decode_fragment(uint32_t q, uint32_t sg, uint32_t sg8, int j, uint32_t a[4]) {
  const uint32_t lo = scale_bits((sg >> (8 * j)) & 0xFFu), hi = scale_bits((sg8 >> (8 * j)) & 0xFFu);
  const uint32_t s_g = lo | (lo << 16), s_g8 = hi | (hi << 16);
  a[0] = mul_bf16x2(pair_bits(q), s_g);
  a[1] = mul_bf16x2(pair_bits(q << 4), s_g8);
  a[2] = mul_bf16x2(pair_bits(q << 8), s_g);
  a[3] = mul_bf16x2(pair_bits(q << 12), s_g8);
}

// Host decode of one 64-column chunk of one 16-row tile (kWordsPerChunk words, kScalesPerChunk scale bytes)
// through the kernels' own fragment decode: store(row in [0, 16), col in [0, 64), bf16 bits) for every element.
template <class Store>
inline void decode_chunk(const uint32_t* words, const uint8_t* sc, Store&& store) {
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane >> 2;
    uint32_t sg = 0, sg8 = 0;
    for (int b = 0; b < 4; ++b) {
      sg |= (uint32_t)sc[8 * g + b] << (8 * b);
      sg8 |= (uint32_t)sc[8 * g + 4 + b] << (8 * b);
    }
    for (int j = 0; j < 4; ++j) {
      uint32_t a[4];
      decode_fragment(words[lane * 4 + j], sg, sg8, j, a);
      for (int i = 0; i < 8; ++i)
        store(frag_row(lane, i), 16 * j + frag_col(lane, i), (uint16_t)(a[i >> 1] >> (16 * (i & 1))));
    }
  }
}

}  // namespace nvfp4
}  // namespace dg
