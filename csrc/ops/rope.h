// rope: rotate-half rotary embedding, the contract of ops.reference.rope (docs/kernels.md, "rope: the rotary
// embedding").
//
//   x:   [T, heads, hd] fp32 | bf16, element (t, h, d) at x[t * x_row_stride + h * x_head_stride + d]; hd even
//   cos, sin: [T, hd] same dtype, contiguous
//   out: [T, heads, hd] same dtype, contiguous
//   rot_d = -x_{d + hd/2} for d < hd/2, x_{d - hd/2} beyond;
//   out_d = rnd(rnd(x_d · cos_d) + rnd(rot_d · sin_d))   (rnd: to the dtype; fp32 products and sum)
//
// IEEE products and a sum per element, each rounded to the dtype as torch's elementwise ops round them: bit-identical
// to the reference on every code path, and an element's value depends on its inputs alone (batch-invariant).
#pragma once

#include <stdint.h>

#include "../common/dtype.h"
#include "../common/status.h"

namespace dg {

struct RopeParams {
  DType dtype;  // of x, cos, sin and out
  const void* x;
  int64_t x_row_stride;   // elements
  int64_t x_head_stride;  // elements
  const void* cos;        // [T, hd]
  const void* sin;        // [T, hd]
  void* out;              // [T, heads, hd] contiguous
  int64_t rows;           // T
  int64_t heads;
  int64_t head_dim;       // hd, even
};

Status rope_cpu(const RopeParams& p);

}  // namespace dg
