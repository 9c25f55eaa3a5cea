// rms_norm_rope: the per-head RMSNorm of queries or keys, then the rotate-half RoPE, in one pass; the contract of
// ops.reference.rms_norm_rope (docs/kernels.md, "rms_norm_add and rms_norm_rope: norms fused with their neighbours").
//
//   x:      [T, heads, hd] fp32 | bf16, element (t, h, d) at x[t * x_row_stride + h * x_head_stride + d]; hd even,
//           at most kRmsNormRopeMaxHeadDim
//   weight: [hd] fp32 or nullptr (as rms_norm.h)
//   cos, sin: [T, hd] same dtype, contiguous
//   out:    [T, heads, hd] same dtype, contiguous
//   n   = rnd(rms_norm(x[t, h, :]; weight))   (rms_norm.h: its sum in torch's CPU order, one rounding)
//   out = rope(n, cos, sin)                   (rope.h: md rounding after each product and the sum)
//
// Bit-identical to the reference's rms_norm then rope, on every code path; a row's bits depend on that row alone.
#pragma once

#include <stdint.h>

#include "../common/dtype.h"
#include "../common/status.h"

namespace dg {

constexpr int64_t kRmsNormRopeMaxHeadDim = 1024;

struct RmsNormRopeParams {
  DType dtype;  // of x, cos, sin and out
  const void* x;
  int64_t x_row_stride;   // elements
  int64_t x_head_stride;  // elements
  const float* weight;    // [hd] or nullptr
  const void* cos;        // [T, hd]
  const void* sin;        // [T, hd]
  void* out;              // [T, heads, hd] contiguous
  int64_t rows;           // T
  int64_t heads;
  int64_t head_dim;  // hd, even, <= kRmsNormRopeMaxHeadDim
  float eps;         // rounded to fp32
  int sum_lanes;     // 8 or 16 (common/torch_sum.h)
};

Status rms_norm_rope_cpu(const RmsNormRopeParams& p);

}  // namespace dg
