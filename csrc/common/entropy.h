// Entropy helpers shared by the CPU and CUDA diffusion_step (__host__ __device__, no library calls).
#pragma once

#include <stdint.h>

#include "philox.h"  // DG_HD, dg_fmaf, bit casts

namespace dg {

// exp(d) for d <= 0 in fp32 (entropy only, not a contract value): round-to-nearest n = d / ln2, r = d - n ln2
// (two fmas), degree-7 Taylor polynomial on |r| <= ln2/2 (relative error < 1e-7 before the two roundings),
// scaled by 2^n; exp(d) < 2^-126 (d < -87) is flushed to 0, negligible against the sum's term exp(0) = 1.
DG_HD float exp_nonpositive(float d) {
  const float dc = d < -100.0f ? -100.0f : d;  // also maps -inf; keeps n in range
  const float kShift = 0x1.8p23f;              // 1.5 * 2^23: adding it rounds to an integer
  const float nf = dg_fmaf(dc, 0x1.715476p+0f, kShift) - kShift;
  float r = dg_fmaf(nf, -0x1.62e4p-1f, dc);
  r = dg_fmaf(nf, -0x1.7f7d1cp-20f, r);
  float p = 1.0f / 5040.0f;
  p = dg_fmaf(p, r, 1.0f / 720.0f);
  p = dg_fmaf(p, r, 1.0f / 120.0f);
  p = dg_fmaf(p, r, 1.0f / 24.0f);
  p = dg_fmaf(p, r, 1.0f / 6.0f);
  p = dg_fmaf(p, r, 0.5f);
  p = dg_fmaf(p, r, 1.0f);
  p = dg_fmaf(p, r, 1.0f);
  const int32_t n = (int32_t)nf;
  const float scale = bits_to_float((uint32_t)(n < -126 ? 0 : n + 127) << 23);
  const float e = p * scale;  // computed unconditionally: the selects below then vectorise
  return d < -87.0f ? 0.0f : e;
}

}  // namespace dg
