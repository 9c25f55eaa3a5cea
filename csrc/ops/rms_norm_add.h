// rms_norm_add: a residual plus an RMSNorm, optionally scaled, in one pass; the contract of
// ops.reference.rms_norm_add (docs/kernels.md, "rms_norm_add and rms_norm_rope: norms fused with their neighbours").
//
//   residual: [rows, dim] fp32 | bf16, element (r, k) at residual[r * residual_row_stride + k]
//   x:        [rows, dim] same dtype, element (r, k) at x[r * x_row_stride + k]
//   weight:   [dim] fp32 or nullptr (as rms_norm.h)
//   out:      [rows, dim] same dtype, element (r, k) at out[r * out_row_stride + k]; may alias residual or x
//   n   = rnd(rms_norm(x; weight))                 (rms_norm.h, its one rounding to the dtype)
//   out = rnd(f32(residual) + n), then, with a scale, rnd(out · scale)   (scale: the dtype's value, widened)
//
// Each step is the IEEE operation torch's ops round the same way (rms_norm's sum in torch's CPU order), so the
// result is bit-identical to the reference's rms_norm, add and multiply, and a row's bits depend on that row alone.
#pragma once

#include <stdint.h>

#include "../common/dtype.h"
#include "../common/status.h"

namespace dg {

struct RmsNormAddParams {
  DType dtype;  // of residual, x and out
  const void* residual;
  int64_t residual_row_stride;  // elements
  const void* x;
  int64_t x_row_stride;    // elements
  const float* weight;     // [dim] or nullptr
  void* out;
  int64_t out_row_stride;  // elements
  int64_t rows;
  int64_t dim;
  float eps;       // rounded to fp32
  bool has_scale;  // multiply the sum by scale
  float scale;     // a value of the dtype, widened exactly
  int sum_lanes;   // 8 or 16 (common/torch_sum.h)
};

Status rms_norm_add_cpu(const RmsNormAddParams& p);

}  // namespace dg
