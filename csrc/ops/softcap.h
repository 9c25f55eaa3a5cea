// softcap: the final logit soft-capping x ← tanh(x / cap)·cap in place, the contract of ops.reference.softcap
// (docs/kernels.md, "softcap: the logit soft-cap").
//
//   x: [n] fp32, contiguous, rewritten in place;  cap > 0
//   x_i ← tanh_fixed(x_i / cap) · cap   (an IEEE division, tanh_fixed below, an IEEE product)
//
// tanh_fixed is one fixed scalar formula of +, -, *, / and explicit fmas only, so an element's value depends on its
// value alone: not on where it sits in the tensor, the thread count, the CPU's vector width or the device (torch's
// vectorised tanh computes a loop's scalar tail with other code). Within 4 fp32 ulp of tanh, not bit-identical to
// torch's.
#pragma once

#include <stdint.h>

#include "../common/entropy.h"  // exp_nonpositive
#include "../common/status.h"

namespace dg {

// |t| < 0.25: the odd Taylor polynomial to t^11 (truncation below 3e-10 relative), Horner in t² with explicit fmas;
// otherwise (1 - e) / (1 + e) with e = exp(-2|t|) (exp_nonpositive), the sign of t restored. Both are computed and
// one is selected (branch-free: the loop vectorises); ±0 stay ±0, ±inf give ±1, NaN gives NaN.
DG_HD float tanh_fixed(float t) {
  const float a = t < 0.0f ? -t : t;
  const float s = t * t;
  float p = -1382.0f / 155925.0f;
  p = dg_fmaf(p, s, 62.0f / 2835.0f);
  p = dg_fmaf(p, s, -17.0f / 315.0f);
  p = dg_fmaf(p, s, 2.0f / 15.0f);
  p = dg_fmaf(p, s, -1.0f / 3.0f);
  const float small = dg_fmaf(t * s, p, t);
  const float e = exp_nonpositive(-2.0f * a);
  const float big = (1.0f - e) / (1.0f + e);
  const float signed_big = t < 0.0f ? -big : big;
  return a < 0.25f ? (a == 0.0f ? t : small) : (t != t ? t : signed_big);  // ±0 keep their sign
}

struct SoftcapParams {
  float* x;   // [n] fp32, in place
  int64_t n;
  float cap;  // > 0
};

Status softcap_cpu(const SoftcapParams& p);

}  // namespace dg
