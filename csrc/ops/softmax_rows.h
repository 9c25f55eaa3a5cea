// softmax_rows: the fp32 softmax of each row, the contract of ops.reference.softmax_rows (docs/kernels.md,
// "softmax_rows: the self-conditioning softmax").
//
//   x: [rows, V] fp32 | bf16, element (r, v) at x[r * x_row_stride + v]
//   y: [rows, V] fp32, element (r, v) at y[r * y_row_stride + v]; must not alias x
//   m = max_v x_v;  e_v = exp_nonpositive(x_v - m) (common/entropy.h);
//   Z = Σ_v e_v as 16 interleaved fp32 partial sums (lane v % 16, v in order), then lanes 0..15 in order;
//   y_v = e_v / Z (IEEE division)
//
// One fixed sequence per row of IEEE operations and explicit fmas: a row's values depend on that row alone, not on
// the number of rows, the thread count, the CPU's vector width or where the row's vector tail falls (torch's softmax
// computes its tails with other code). Within a few fp32 ulp of torch's softmax, not bit-identical to it.
#pragma once

#include <stdint.h>

#include "../common/dtype.h"
#include "../common/status.h"

namespace dg {

struct SoftmaxRowsParams {
  DType dtype;  // of x
  const void* x;
  int64_t x_row_stride;  // elements
  float* y;
  int64_t y_row_stride;  // elements
  int64_t rows;
  int64_t cols;  // V
};

Status softmax_rows_cpu(const SoftmaxRowsParams& p);

}  // namespace dg
