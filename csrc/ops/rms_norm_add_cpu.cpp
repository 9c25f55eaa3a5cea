// rms_norm_add on the CPU (contract: rms_norm_add.h): one row per iteration, rows in parallel (OpenMP), each row in
// the CPU's widest build (cpu_vec.h); the norm's sum in torch's order (rms_norm_row.h), so the result does not depend
// on the thread count or the code path.
#include "../common/check.h"
#include "cpu_vec.h"
#include "rms_norm_add.h"
#include "rms_norm_row.h"

namespace dg {
namespace {

template <class T, int W>
void rows(const RmsNormAddParams& p) {
  const T* res = static_cast<const T*>(p.residual);
  const T* x = static_cast<const T*>(p.x);
  T* out = static_cast<T*>(p.out);
  const int64_t dim = p.dim;
#pragma omp parallel for schedule(static) if (p.rows * dim >= 32768)
  for (int64_t r = 0; r < p.rows; ++r) {
    const T* rr = res + r * p.residual_row_stride;
    const T* xr = x + r * p.x_row_stride;
    T* yr = out + r * p.out_row_stride;
    run_vectorized([&]() DG_INLINE_LAMBDA {
      const float inv = rms_norm_inv<T, W>(xr, dim, p.eps);
      if (p.has_scale) {
        for (int64_t k = 0; k < dim; ++k) {
          const float n = round_to<T>(rms_norm_value(to_float(xr[k]), inv, p.weight, k));
          yr[k] = from_float<T>(round_to<T>(to_float(rr[k]) + n) * p.scale);
        }
      } else {
        for (int64_t k = 0; k < dim; ++k) {
          const float n = round_to<T>(rms_norm_value(to_float(xr[k]), inv, p.weight, k));
          yr[k] = from_float<T>(to_float(rr[k]) + n);
        }
      }
      return 0;
    });
  }
}

}  // namespace

Status rms_norm_add_cpu(const RmsNormAddParams& p) {
  DG_CHECK_ARG(p.rows >= 0 && p.dim >= 1, "rms_norm_add: need rows >= 0 and dim >= 1, got rows=%lld dim=%lld",
               (long long)p.rows, (long long)p.dim);
  DG_CHECK_ARG(p.sum_lanes == 8 || p.sum_lanes == 16, "rms_norm_add: sum_lanes must be 8 or 16, got %d", p.sum_lanes);
  with_norm_types(p.dtype, p.sum_lanes, [&]<class T, int W>() { rows<T, W>(p); });
  return Status::Ok();
}

}  // namespace dg
