// One head of rope on the CPU (contract: rope.h), shared by rope and rms_norm_rope. Internal to
// csrc/ops/*_cpu.cpp; call it inside run_vectorized (cpu_vec.h) so that it is compiled for the CPU's widest build.
#pragma once

#include <stdint.h>

#include "../common/dtype.h"

namespace dg {

// out[d] = rnd(rnd(x_d · cos_d) + rnd(rot_d · sin_d)), rot_d = -x_{d + hd/2} for d < hd/2, x_{d - hd/2} beyond;
// x: the head's hd values (of the dtype T, or floats already rounded to it), c, s: its position's tables.
template <class T, class X>
__attribute__((always_inline)) inline void rope_head(const X* x, const T* c, const T* s, int64_t hd, T* out) {
  const int64_t half = hd / 2;
  for (int64_t d = 0; d < half; ++d) {  // rot = -x[d + half]
    const float a = round_to<T>(to_float(x[d]) * to_float(c[d]));
    const float b = round_to<T>(-to_float(x[d + half]) * to_float(s[d]));
    out[d] = from_float<T>(a + b);
  }
  for (int64_t d = half; d < hd; ++d) {  // rot = x[d - half]
    const float a = round_to<T>(to_float(x[d]) * to_float(c[d]));
    const float b = round_to<T>(to_float(x[d - half]) * to_float(s[d]));
    out[d] = from_float<T>(a + b);
  }
}

}  // namespace dg
