// rms_norm: RMSNorm over the last dim, the contract of ops.reference.rms_norm (docs/generation.md, "Primitives
// and rounding").
//
//   x:      [rows, dim] fp32 | bf16, element (r, k) at x[r * x_row_stride + k] (row stride in elements)
//   weight: [dim] fp32, or nullptr for the scale-free variant (the caller converts a bf16 weight to fp32,
//           which is exact, as the reference's weight.float() is)
//   out:    [rows, dim], same dtype as x, element (r, k) at out[r * out_row_stride + k]; may alias x
//   y = rnd((a * (sum(a*a) / dim + f32(eps))^-0.5) * w),  a = f32(x), one rounding to x's dtype at the end.
//
// CPU: bit-identical to the reference on the same CPU. sum(a*a) is summed in torch's CPU `sum` order
// (common/torch_sum.h; sum_lanes = torch's Vectorized<float>::size(), 8 or 16), then divided by dim
// (torch's CPU mean is sum / n), + eps, then 1 / sqrt (torch's pow(t, -0.5) is rsqrt = 1 / sqrt on CPU).
// CUDA: same formula, block-wide tree sum: NOT bit-identical to torch (CUDA or CPU); ops.rms_norm uses it for
// CUDA tensors, and the start-up self-check (ops/native_check.py) holds it to its tolerance.
#pragma once

#include <stdint.h>

#include "../common/dtype.h"
#include "../common/status.h"

namespace dg {

struct RmsNormParams {
  DType dtype;              // of x and out
  const void* x;
  int64_t x_row_stride;     // elements
  const float* weight;      // [dim] or nullptr
  void* out;
  int64_t out_row_stride;   // elements
  int64_t rows;
  int64_t dim;
  float eps;                // already rounded to fp32, as torch adds a Python float to an fp32 tensor
  int sum_lanes;            // CPU only: 8 or 16 (see common/torch_sum.h)
};

Status rms_norm_cpu(const RmsNormParams& p);
Status rms_norm_cuda(const RmsNormParams& p, void* stream);  // compiled only with CUDA

}  // namespace dg
