// Seeded noise shared by the CPU and CUDA paths (docs/seeded-noise.md): Philox4x32-10, the contract's float32 log, and
// the Gumbel transform. Everything here is __host__ __device__ (DG_HD), has no library calls and no
// data-dependent branches, so g++ and nvcc produce the same bits.
//
// Bit-exactness rules for every translation unit that includes this file:
//   * no -ffast-math; g++ gets -ffp-contract=off and nvcc --fmad=false, so the only fused multiply-adds are
//     the explicit dg_fmaf calls below (the hardware FMA on both sides; a correctly rounded libm fmaf
//     call on a host without FMA, which is slower but gives the same bits).
#pragma once

#include <stdint.h>
#if !defined(__CUDACC__)
#include <string.h>
#endif

#if defined(__CUDACC__)
#define DG_HD __host__ __device__ __forceinline__
#else
#define DG_HD inline __attribute__((always_inline))
#endif

namespace dg {

// ---- bit casts and fma --------------------------------------------------------------------------------

DG_HD float bits_to_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

DG_HD uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

// a*b + c with one rounding (IEEE fusedMultiplyAdd).
DG_HD float dg_fmaf(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return __builtin_fmaf(a, b, c);
#endif
}

// ---- Philox4x32-10 (docs/seeded-noise.md; Salmon et al. SC'11, as in Random123/cuRAND, raw counters) ------

constexpr uint32_t kPhiloxM0 = 0xD2511F53u;
constexpr uint32_t kPhiloxM1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u;
constexpr uint32_t kPhiloxW1 = 0xBB67AE85u;

struct Philox4 {
  uint32_t v[4];
};

DG_HD void mulhilo32(uint32_t a, uint32_t b, uint32_t* hi, uint32_t* lo) {
#if defined(__CUDA_ARCH__)
  *hi = __umulhi(a, b);
  *lo = a * b;
#else
  const uint64_t p = (uint64_t)a * (uint64_t)b;
  *hi = (uint32_t)(p >> 32);
  *lo = (uint32_t)p;
#endif
}

// out = philox4x32_10(counter (c0, c1, c2, c3), key (k0, k1)); the key is bumped before rounds 2..10.
DG_HD Philox4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1) {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int r = 0; r < 10; ++r) {
    if (r > 0) {
      k0 += kPhiloxW0;
      k1 += kPhiloxW1;
    }
    uint32_t hi0, lo0, hi1, lo1;
    mulhilo32(kPhiloxM0, c0, &hi0, &lo0);
    mulhilo32(kPhiloxM1, c2, &hi1, &lo1);
    const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
  }
  return Philox4{{c0, c1, c2, c3}};
}

// The request's 64-bit seed (an int64 that may be negative, two's complement) -> key words
// (docs/seeded-noise.md, "Key").
DG_HD uint32_t seed_key0(int64_t seed) { return (uint32_t)((uint64_t)seed & 0xFFFFFFFFu); }
DG_HD uint32_t seed_key1(int64_t seed) { return (uint32_t)((uint64_t)seed >> 32); }

// Canvas noise (docs/seeded-noise.md, "Canvas noise"): counter (p, 0, b, 2s), token = out[0] mod V.
DG_HD int64_t canvas_token(int64_t seed, int64_t block, int64_t step, int64_t pos, int64_t vocab) {
  const Philox4 o =
      philox4x32_10((uint32_t)pos, 0u, (uint32_t)block, (uint32_t)(2 * step), seed_key0(seed), seed_key1(seed));
  return (int64_t)(o.v[0] % (uint64_t)vocab);
}

// ---- dg_logf: the contract's float32 natural log (docs/seeded-noise.md, "dg_logf") ----------------------
//
// Accuracy (measured exhaustively against the double-precision log by csrc/tools/dg_logf_accuracy.cpp,
// `python build.py --logf-accuracy`): over every positive finite float (2,139,095,039 inputs, subnormals
// included) the max error is 0.836 ulp (at x = 0x1.55a066p+0), so every result is faithfully rounded (one of
// the two floats around the exact log); 99.90% are correctly rounded (2,153,549 are not; over (0, 32], the
// range the Gumbel transform uses, 1,648,141 of 1,107,296,256). log(1) = +0 exactly.
// The Gumbel transform built on it is within 5.2e-7 of -log(-log(u)) evaluated in double for all 2^23 u.
// Method: x = 2^i * m with m in [2/3, 4/3) (integer reduction, subnormals pre-scaled by 2^23),
//   f = m - 1 (exact), log1p(f) = f + f^2 * Q(f) with Q a degree-9 weighted-minimax polynomial
//   (float coefficients, Horner with fma), i*ln2 split in hi (16 bits, so i*hi is exact) + lo, and the
//   hi part added with an exact Fast2Sum. For i = 0 the result is fmaf(f^2, Q, f), one rounding.
// Special inputs: log(+0) = log(-0) = -inf, log(+inf) = +inf, log(x < 0) = log(NaN) = NaN.
// No branches on data (selects only); g++ vectorises loops over dg_logf_reduced (needs -fno-trapping-math,
// which changes no result: it only lets the compiler evaluate both sides of a select).

// log(2^ioff * a) for a positive normal finite float a (ioff: an exponent offset, exact in float).
DG_HD float dg_logf_reduced(float a, float ioff) {
  constexpr float kLn2Hi = 0x1.62e4p-1f;       // 16 significant bits: i * kLn2Hi is exact for |i| < 256
  constexpr float kLn2Lo = 0x1.7f7d1cp-20f;    // ln 2 - kLn2Hi
  const uint32_t ix = float_to_bits(a);
  const int32_t e = (int32_t)(ix - 0x3f2aaaabu) >> 23;  // 0x3f2aaaab = 2/3 rounded up
  const float m = bits_to_float(ix - ((uint32_t)e << 23));  // in [2/3, 4/3)
  const float i = (float)e + ioff;
  const float f = m - 1.0f;                    // exact (Sterbenz)

  float q = 0x1.f220b8p-4f;                    // Q(f) ~ (log1p(f) - f) / f^2, Q(0) = -1/2
  q = dg_fmaf(q, f, -0x1.0af51cp-3f);
  q = dg_fmaf(q, f, 0x1.b6b0a4p-4f);
  q = dg_fmaf(q, f, -0x1.f17202p-4f);
  q = dg_fmaf(q, f, 0x1.250bb6p-3f);
  q = dg_fmaf(q, f, -0x1.55b1d0p-3f);
  q = dg_fmaf(q, f, 0x1.99968cp-3f);
  q = dg_fmaf(q, f, -0x1.fffe28p-3f);
  q = dg_fmaf(q, f, 0x1.555558p-2f);
  q = dg_fmaf(q, f, -0.5f);

  const float f2 = f * f;
  const float f2lo = dg_fmaf(f, f, -f2);       // f*f = f2 + f2lo exactly
  const float hi = i * kLn2Hi;                 // exact
  const float s = hi + f;  // Fast2Sum: exact error below, as |hi| >= kLn2Hi > 1/3 >= |f| when i != 0
  const float err = (hi - s) + f;
  const float c = dg_fmaf(f2, q, dg_fmaf(f2lo, q, dg_fmaf(i, kLn2Lo, err)));
  const float r0 = dg_fmaf(f2, q, f);  // i == 0: one rounding
  const float r1 = s + c;
  return (i == 0.0f) ? r0 : r1;
}

// dg_logf for any float (subnormals scaled by 2^23 first; the special inputs listed above).
DG_HD float dg_logf(float a) {
  const bool sub = a < 0x1p-126f;  // subnormal (or <= 0, fixed up below)
  float r = dg_logf_reduced(a * (sub ? 0x1p23f : 1.0f), sub ? -23.0f : 0.0f);  // the product is exact
  const float kInf = bits_to_float(0x7f800000u);
  r = (a == kInf) ? kInf : r;
  r = (a == 0.0f) ? -kInf : r;
  r = ((a < 0.0f) | (a != a)) ? bits_to_float(0x7fc00000u) : r;
  return r;
}

// ---- Gumbel noise (docs/seeded-noise.md, "Gumbel noise") -------------------------------------------------

// Uniform in (0, 1) from one Philox word: u = ((r >> 9) + 0.5) * 2^-23, exact, 2^-24 <= u <= 1 - 2^-24.
DG_HD float uniform_from_bits(uint32_t r) {
  return ((float)(int32_t)(r >> 9) + 0.5f) * 0x1p-23f;  // via int32: vectorises
}

// g = -log(-log(u)), float32, finite, in [-2.8115408, 16.635532]. Both logs see positive normal floats
// (u >= 2^-24, -log(u) >= 5.96e-8), so dg_logf_reduced(x, 0) == dg_logf(x) there; calling it directly keeps
// the special-case selects out of the loop (which lets g++ vectorise it).
DG_HD float gumbel_from_bits(uint32_t r) {
  return -dg_logf_reduced(-dg_logf_reduced(uniform_from_bits(r), 0.0f), 0.0f);
}

// The largest value gumbel_from_bits returns (u = 1 - 2^-24; tests/ops check it over every u). An upper bound
// of the noise: f32(y + kGumbelMax) < best means f32(y + g) < best for every draw g (rounding is monotone),
// which lets diffusion_step skip the draw of entries that cannot win the Gumbel race.
constexpr float kGumbelMax = 16.635532f;

// An upper bound of gumbel_from_bits(r) without a log, per entry (diffusion_step skips an entry's two logs when
// f32(y + bound) < the running best). With u = uniform_from_bits(r) and v = 1 - u (exact: u is a multiple of 2^-24
// in (0, 1)): -log(u) >= v (log u <= u - 1), so -log(-log u) <= -log(v) <= -e ln 2 for 2^e <= v (e = the
// exponent of v, in [-24, -1]); 2^-16 more covers dg_logf's rounding of g (within 5.2e-7 of the exact value, see
// above) and this float product's. tests/ops check it against gumbel_from_bits for every u. Loose by < ln 2 + 2^-16
// where it matters (u near 1), so only entries within that of the running best need their logs.
DG_HD float gumbel_upper_bound(uint32_t r) {
  const float v = 1.0f - uniform_from_bits(r);
  const int32_t e = (int32_t)((float_to_bits(v) >> 23) & 0xffu) - 127;  // v is a normal float: its exponent
  return (float)(-e) * 0x1.62e430p-1f + 0x1p-16f;  // 0x1.62e430p-1 = ln 2 rounded up
}

}  // namespace dg
