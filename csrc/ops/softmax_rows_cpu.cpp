// softmax_rows on the CPU: rows in parallel (OpenMP), each row three loops the compiler vectorises (cpu_vec.h picks
// the build): the max, e = exp_nonpositive(x - max) with its 16 interleaved partial sums, then e / Z. Every lane and
// the scalar tail compute the same bits (softmax_rows.h).
#include "../common/check.h"
#include "../common/entropy.h"
#include "cpu_vec.h"
#include "softmax_rows.h"

namespace dg {
namespace {

constexpr int kLanes = 16;

template <class T>
__attribute__((always_inline)) inline void one_row(const T* x, float* y, int64_t V) {
  // the max over 16 lanes, then across them (exact: a max rounds nothing; NaN propagates)
  const int64_t whole = V / kLanes * kLanes;
  float lane_max[kLanes];
  for (int l = 0; l < kLanes; ++l) lane_max[l] = to_float(x[0]);
  for (int64_t v0 = 0; v0 < whole; v0 += kLanes) {
#pragma omp simd
    for (int l = 0; l < kLanes; ++l) {
      const float a = to_float(x[v0 + l]);
      lane_max[l] = (a > lane_max[l] || a != a) ? a : lane_max[l];
    }
  }
  for (int64_t v = whole; v < V; ++v) {
    const float a = to_float(x[v]);
    lane_max[0] = (a > lane_max[0] || a != a) ? a : lane_max[0];
  }
  float m = lane_max[0];
  for (int l = 1; l < kLanes; ++l) m = (lane_max[l] > m || lane_max[l] != lane_max[l]) ? lane_max[l] : m;
  float part[kLanes] = {};
  for (int64_t v0 = 0; v0 < whole; v0 += kLanes) {
#pragma omp simd
    for (int l = 0; l < kLanes; ++l) {
      const float e = exp_nonpositive(to_float(x[v0 + l]) - m);
      y[v0 + l] = e;
      part[l] = part[l] + e;
    }
  }
  for (int64_t v = whole; v < V; ++v) {  // the tail: lane v % 16, as in the blocks
    const float e = exp_nonpositive(to_float(x[v]) - m);
    y[v] = e;
    part[v - whole] = part[v - whole] + e;
  }
  float z = 0.0f;
  for (int l = 0; l < kLanes; ++l) z = z + part[l];
#pragma omp simd
  for (int64_t v = 0; v < V; ++v) y[v] = y[v] / z;
}

template <class T>
void rows(const SoftmaxRowsParams& p) {
  const T* x = static_cast<const T*>(p.x);
#pragma omp parallel for schedule(static) if (p.rows * p.cols >= 65536)
  for (int64_t r = 0; r < p.rows; ++r) {
    run_vectorized([&]() DG_INLINE_LAMBDA {
      one_row<T>(x + r * p.x_row_stride, p.y + r * p.y_row_stride, p.cols);
      return 0;
    });
  }
}

}  // namespace

Status softmax_rows_cpu(const SoftmaxRowsParams& p) {
  DG_CHECK_ARG(p.rows >= 0 && p.cols >= 1, "softmax_rows: need rows >= 0 and cols >= 1, got rows=%lld cols=%lld",
               (long long)p.rows, (long long)p.cols);
  if (p.dtype == DType::kFloat32) {
    rows<float>(p);
  } else {
    rows<bf16>(p);
  }
  return Status::Ok();
}

}  // namespace dg
