// gelu_tanh_mul: the gating of the gated MLP and the MoE experts, out = rnd(rnd(gelu_tanh(g)) * u), the contract of
// ops.reference.gelu_tanh_mul (docs/kernels.md, "gelu_tanh_mul: the gating").
//
//   gate, up: [rows, cols] fp32 | bf16, element (r, c) at gate[r * gate_row_stride + c] (same for up)
//   out:      [rows, cols] same dtype, element (r, c) at out[r * out_row_stride + c]
//
// gelu_tanh is one fixed scalar formula (gelu_tanh_fixed below) of +, -, *, / and explicit fmas only, so an
// element's value depends on its value alone: not on where it sits in the tensor, the thread count, the CPU's
// vector width or the device. It is torch's tanh-approximate GELU, 0.5·x·(1 + tanh(u)), u = √(2/π)·(x + 0.044715·x³),
// rewritten as x·σ(2u) (the same function: 1 + tanh(u) = 2σ(2u)), with σ from the contract's exp of a non-positive
// argument: within a few fp32 ulp of torch's value, not bit-identical to it.
#pragma once

#include <stdint.h>

#include "../common/dtype.h"
#include "../common/entropy.h"  // exp_nonpositive
#include "../common/status.h"

namespace dg {

// x·σ(2u) with e = exp(-2|u|): σ(2u) = 1 / (1 + e) for u >= 0, e / (1 + e) for u < 0 (no overflow, no cancellation).
DG_HD float gelu_tanh_fixed(float x) {
  const float x_cube = x * x * x;
  const float u = 0.7978845608028654f * (x + 0.044715f * x_cube);
  const float au = u < 0.0f ? -u : u;
  const float e = exp_nonpositive(-2.0f * au);
  const float s = (u < 0.0f ? e : 1.0f) / (1.0f + e);
  return x * s;
}

struct GeluTanhMulParams {
  DType dtype;  // of gate, up and out
  const void* gate;
  int64_t gate_row_stride;  // elements
  const void* up;
  int64_t up_row_stride;
  void* out;
  int64_t out_row_stride;
  int64_t rows;
  int64_t cols;
};

Status gelu_tanh_mul_cpu(const GeluTanhMulParams& p);

}  // namespace dg
