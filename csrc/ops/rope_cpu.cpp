// rope on the CPU: rows in parallel, each row's heads in one build (cpu_vec.h picks it), each head one loop per half
// the compiler vectorises.
// Products and sums are IEEE operations rounded to the dtype after each (no fused multiply-add: build.py's
// -ffp-contract=off), so every lane and the scalar tail compute the reference's bits (rope.h).
#include "../common/check.h"
#include "cpu_vec.h"
#include "rope.h"
#include "rope_row.h"

namespace dg {
namespace {

template <class T>
void rope_rows(const RopeParams& p) {
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
      for (int64_t h = 0; h < H; ++h) {
        const T* xr = x + t * p.x_row_stride + h * p.x_head_stride;
        rope_head(xr, c, s, hd, o + (t * H + h) * hd);
      }
      return 0;
    });
  }
}

}  // namespace

Status rope_cpu(const RopeParams& p) {
  DG_CHECK_ARG(p.rows >= 0 && p.heads >= 0 && p.head_dim >= 0 && p.head_dim % 2 == 0,
               "rope: sizes must be >= 0 with an even head dim, got T=%lld heads=%lld hd=%lld", (long long)p.rows,
               (long long)p.heads, (long long)p.head_dim);
  if (p.dtype == DType::kFloat32) {
    rope_rows<float>(p);
  } else {
    rope_rows<bf16>(p);
  }
  return Status::Ok();
}

}  // namespace dg
