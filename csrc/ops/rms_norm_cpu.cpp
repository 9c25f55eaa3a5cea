// rms_norm on the CPU: the obvious loop, one row per iteration, rows in parallel (OpenMP).
// Each row is summed serially in torch's order, so the result does not depend on the thread count.
#include <math.h>

#include "../common/check.h"
#include "../common/torch_sum.h"
#include "rms_norm.h"

namespace dg {
namespace {

template <class T, int W>
void rms_norm_rows(const RmsNormParams& p) {
  const T* x = static_cast<const T*>(p.x);
  T* out = static_cast<T*>(p.out);
  const int64_t dim = p.dim;
  const float fdim = (float)dim;  // torch divides the fp32 sum by the int64 count, promoted to fp32
#pragma omp parallel for schedule(static) if (p.rows * dim >= 32768)
  for (int64_t r = 0; r < p.rows; ++r) {
    const T* xr = x + r * p.x_row_stride;
    T* yr = out + r * p.out_row_stride;
    const float ss = torch_sum_detail::inner_sum<W>(
        [&](int64_t k) {
          const float a = to_float(xr[k]);
          return a * a;
        },
        dim);
    const float inv = 1.0f / sqrtf(ss / fdim + p.eps);
    for (int64_t k = 0; k < dim; ++k) {
      float y = to_float(xr[k]) * inv;
      if (p.weight != nullptr) y = y * p.weight[k];
      yr[k] = from_float<T>(y);
    }
  }
}

template <class T>
void dispatch_lanes(const RmsNormParams& p) {
  if (p.sum_lanes == 16) {
    rms_norm_rows<T, 16>(p);
  } else {
    rms_norm_rows<T, 8>(p);
  }
}

}  // namespace

Status rms_norm_cpu(const RmsNormParams& p) {
  DG_CHECK_ARG(p.rows >= 0 && p.dim >= 1, "rms_norm: need rows >= 0 and dim >= 1, got rows=%lld dim=%lld",
               (long long)p.rows, (long long)p.dim);
  DG_CHECK_ARG(p.sum_lanes == 8 || p.sum_lanes == 16, "rms_norm: sum_lanes must be 8 or 16, got %d", p.sum_lanes);
  if (p.dtype == DType::kFloat32) {
    dispatch_lanes<float>(p);
  } else {
    dispatch_lanes<bf16>(p);
  }
  return Status::Ok();
}

}  // namespace dg
