// CPU code paths of the hot loops (internal to csrc/ops/*_cpu.cpp; no torch, no CUDA).
//
// run_vectorized(f) runs the callable f in one of three builds of the same code, chosen once per process
// from the CPU's features: baseline x86-64, AVX2+FMA, or AVX-512 (F/VL/DQ/BW)+FMA. f must be an
// always-inline lambda (DG_INLINE_LAMBDA) whose body calls only inline code, so each build of it is
// compiled -- and vectorised -- for its target. The three builds give identical bits: the code uses only
// IEEE operations that round the same way scalar or vector (no fast-math, -ffp-contract=off, explicit fmaf;
// the baseline build calls libm's correctly rounded fmaf). set_cpu_level_override (a test hook) forces one.
#pragma once

#include <stdint.h>

#include <atomic>

#include "../common/philox.h"

#define DG_INLINE_LAMBDA __attribute__((always_inline))

namespace dg {

// Override for tests: -1 = automatic; 0, 1, 2 = baseline, AVX2, AVX-512 (capped at what the CPU has).
inline std::atomic<int>& cpu_level_override() {
  static std::atomic<int> level{-1};
  return level;
}

// The highest code path this CPU runs: 0 baseline, 1 AVX2+FMA, 2 AVX-512 (F, VL, DQ, BW)+FMA.
inline int cpu_level_supported() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const int level =
      (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
       __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("fma"))
          ? 2
      : (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) ? 1
                                                                          : 0;
  return level;
#else
  return 0;
#endif
}

inline int cpu_level() {
  const int forced = cpu_level_override().load(std::memory_order_relaxed);
  const int supported = cpu_level_supported();
  return forced >= 0 && forced < supported ? forced : supported;
}

template <class F>
__attribute__((noinline)) auto run_cpu_baseline(const F& f) {
  return f();
}

#if defined(__x86_64__) && defined(__GNUC__)
template <class F>
__attribute__((noinline, target("avx2,fma"))) auto run_cpu_avx2(const F& f) {
  return f();
}

template <class F>
__attribute__((noinline, target("avx512f,avx512vl,avx512dq,avx512bw,avx2,fma,prefer-vector-width=512"))) auto
run_cpu_avx512(const F& f) {
  return f();
}
#endif

template <class F>
auto run_vectorized(const F& f) {
#if defined(__x86_64__) && defined(__GNUC__)
  switch (cpu_level()) {
    case 2: return run_cpu_avx512(f);
    case 1: return run_cpu_avx2(f);
    default: break;
  }
#endif
  return run_cpu_baseline(f);
}

// 32 Philox4x32-10 calls with counters (q0 + l, c1, c2, c3), l = 0..31, written as r[4l + j] = out[j]: the
// arithmetic of common/philox.h philox4x32_10, laid out over lanes so that it vectorises. 32 lanes rather than 16:
// a round is a chain of dependent multiplies, and four independent 8-lane chains keep the multiplier busy where two
// left it waiting (2.5x the draws per second on AVX-512).
DG_HD void philox_x32(uint32_t q0, uint32_t c1_, uint32_t c2_, uint32_t c3_, uint32_t k0, uint32_t k1, uint32_t* r) {
  constexpr int L = 32;
  uint32_t c0[L], c1[L], c2[L], c3[L];
  for (int l = 0; l < L; ++l) {
    c0[l] = q0 + (uint32_t)l;
    c1[l] = c1_;
    c2[l] = c2_;
    c3[l] = c3_;
  }
#pragma GCC unroll 1
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += kPhiloxW0;
      k1 += kPhiloxW1;
    }
#pragma omp simd
    for (int l = 0; l < L; ++l) {
      const uint64_t p0 = (uint64_t)kPhiloxM0 * c0[l];
      const uint64_t p1 = (uint64_t)kPhiloxM1 * c2[l];
      const uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1[l] ^ k0;
      const uint32_t n2 = (uint32_t)(p0 >> 32) ^ c3[l] ^ k1;
      c1[l] = (uint32_t)p1;
      c3[l] = (uint32_t)p0;
      c0[l] = n0;
      c2[l] = n2;
    }
  }
  for (int l = 0; l < L; ++l) {
    r[4 * l + 0] = c0[l];
    r[4 * l + 1] = c1[l];
    r[4 * l + 2] = c2[l];
    r[4 * l + 3] = c3[l];
  }
}

// Gumbel noise of vocabulary entries 128*j .. 128*j + 127 of one position: counters (32j + l, pos, block, ctr3).
DG_HD void gumbel_x128(uint32_t pair, uint32_t pos, uint32_t block, uint32_t ctr3, uint32_t k0, uint32_t k1, float* g) {
  uint32_t r[128];
  philox_x32(pair * 32u, pos, block, ctr3, k0, k1, r);
  for (int i = 0; i < 128; ++i) g[i] = gumbel_from_bits(r[i]);
}

}  // namespace dg
