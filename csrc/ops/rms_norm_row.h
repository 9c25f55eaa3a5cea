// One row of rms_norm on the CPU (contract: rms_norm.h), shared by the CPU ops that norm a row on the way
// (rms_norm, rms_norm_add, rms_norm_rope). Internal to csrc/ops/*_cpu.cpp; call it inside run_vectorized
// (cpu_vec.h) so that it is compiled for the CPU's widest build.
#pragma once

#include <math.h>
#include <stdint.h>

#include "../common/dtype.h"
#include "../common/torch_sum.h"
#include "cpu_vec.h"

namespace dg {

// inv = 1 / sqrt(sum(a*a) / dim + eps), a = f32(x[0 .. dim)), the sum in torch's CPU order for W lanes.
template <class T, int W>
__attribute__((always_inline)) inline float rms_norm_inv(const T* x, int64_t dim, float eps) {
  const float ss = torch_sum_detail::inner_sum<W>(
      [&](int64_t k) DG_INLINE_LAMBDA {
        const float a = to_float(x[k]);
        return a * a;
      },
      dim);
  return 1.0f / sqrtf(ss / (float)dim + eps);  // torch divides the fp32 sum by the int64 count, promoted to fp32
}

// The normed element before its one rounding to the dtype: (a * inv) * w, or a * inv without a weight.
__attribute__((always_inline)) inline float rms_norm_value(float a, float inv, const float* w, int64_t k) {
  return w != nullptr ? (a * inv) * w[k] : a * inv;
}

// f.template operator()<T, W>() for the element type of `dtype` and torch's lane count of the sum (16, else 8):
// the template arguments every norm's rows take.
template <class F>
inline void with_norm_types(DType dtype, int sum_lanes, const F& f) {
  const bool f32 = dtype == DType::kFloat32;
  if (sum_lanes == 16) {
    f32 ? f.template operator()<float, 16>() : f.template operator()<bf16, 16>();
  } else {
    f32 ? f.template operator()<float, 8>() : f.template operator()<bf16, 8>();
  }
}

}  // namespace dg
