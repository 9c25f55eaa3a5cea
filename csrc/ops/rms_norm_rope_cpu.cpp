// rms_norm_rope on the CPU (contract: rms_norm_rope.h): rows in parallel (OpenMP), each row's heads in the CPU's
// widest build (cpu_vec.h): a head is normed into a row of the dtype's values (rms_norm_row.h), then rotated by
// rope's own rope_head (rope_row.h). The same IEEE operations in every build and lane: bit-identical to the reference.
#include "../common/check.h"
#include "cpu_vec.h"
#include "rms_norm_rope.h"
#include "rms_norm_row.h"
#include "rope_row.h"

namespace dg {
namespace {

template <class T, int W>
void rows(const RmsNormRopeParams& p) {
  const T* x = static_cast<const T*>(p.x);
  const T* cs = static_cast<const T*>(p.cos);
  const T* sn = static_cast<const T*>(p.sin);
  T* o = static_cast<T*>(p.out);
  const int64_t hd = p.head_dim, H = p.heads;
#pragma omp parallel for schedule(static) if (p.rows * H * hd >= 65536)
  for (int64_t t = 0; t < p.rows; ++t) {
    const T* c = cs + t * hd;
    const T* s = sn + t * hd;
    run_vectorized([&]() DG_INLINE_LAMBDA {
      float n[kRmsNormRopeMaxHeadDim];  // the head after its norm, rounded to the dtype
      for (int64_t h = 0; h < H; ++h) {
        const T* xr = x + t * p.x_row_stride + h * p.x_head_stride;
        T* orow = o + (t * H + h) * hd;
        const float inv = rms_norm_inv<T, W>(xr, hd, p.eps);
        for (int64_t d = 0; d < hd; ++d) n[d] = round_to<T>(rms_norm_value(to_float(xr[d]), inv, p.weight, d));
        rope_head(n, c, s, hd, orow);
      }
      return 0;
    });
  }
}

}  // namespace

Status rms_norm_rope_cpu(const RmsNormRopeParams& p) {
  DG_CHECK_ARG(
      p.rows >= 0 && p.heads >= 0 && p.head_dim >= 2 && p.head_dim % 2 == 0 && p.head_dim <= kRmsNormRopeMaxHeadDim,
      "rms_norm_rope: need sizes >= 0 and an even head dim in [2, %lld], got T=%lld heads=%lld hd=%lld",
      (long long)kRmsNormRopeMaxHeadDim, (long long)p.rows, (long long)p.heads, (long long)p.head_dim);
  DG_CHECK_ARG(p.sum_lanes == 8 || p.sum_lanes == 16, "rms_norm_rope: sum_lanes must be 8 or 16, got %d", p.sum_lanes);
  with_norm_types(p.dtype, p.sum_lanes, [&]<class T, int W>() { rows<T, W>(p); });
  return Status::Ok();
}

}  // namespace dg
