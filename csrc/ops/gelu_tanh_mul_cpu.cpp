// gelu_tanh_mul on the CPU: rows in parallel, each row one loop the compiler vectorises (cpu_vec.h picks the
// build). gelu_tanh_fixed uses only IEEE operations and explicit fmas (correctly rounded in every build), so
// every lane and the scalar tail compute the same bits (gelu_tanh_mul.h).
#include "../common/check.h"
#include "cpu_vec.h"
#include "gelu_tanh_mul.h"

namespace dg {
namespace {

template <class T>
void gelu_tanh_mul_rows(const GeluTanhMulParams& p) {
  const T* g = static_cast<const T*>(p.gate);
  const T* u = static_cast<const T*>(p.up);
  T* o = static_cast<T*>(p.out);
  const int64_t cols = p.cols;
#pragma omp parallel for schedule(static) if (p.rows * cols >= 65536)
  for (int64_t r = 0; r < p.rows; ++r) {
    const T* gr = g + r * p.gate_row_stride;
    const T* ur = u + r * p.up_row_stride;
    T* orow = o + r * p.out_row_stride;
    run_vectorized([&]() DG_INLINE_LAMBDA {
      for (int64_t c = 0; c < cols; ++c) {
        const float act = to_float(from_float<T>(gelu_tanh_fixed(to_float(gr[c]))));  // rounded to md
        orow[c] = from_float<T>(act * to_float(ur[c]));
      }
      return 0;
    });
  }
}

}  // namespace

Status gelu_tanh_mul_cpu(const GeluTanhMulParams& p) {
  DG_CHECK_ARG(p.rows >= 0 && p.cols >= 0, "gelu_tanh_mul: sizes must be >= 0, got rows=%lld cols=%lld",
               (long long)p.rows, (long long)p.cols);
  if (p.dtype == DType::kFloat32) {
    gelu_tanh_mul_rows<float>(p);
  } else {
    gelu_tanh_mul_rows<bf16>(p);
  }
  return Status::Ok();
}

}  // namespace dg
