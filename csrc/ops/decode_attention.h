// decode_attention: the decoder's attention for B canvases of C queries, each canvas over its own keys (its cache
// slot's visible positions, then its own canvas's), scale 1.0, no mask; the contract of
// ops.reference.decode_attention (docs/kernels.md, "decode_attention: the decoder's attention").
//
//   q:      [nh, B*C, hd] fp32 | bf16, element (h, t, d) at q[h * q_head_stride + t * q_row_stride + d]; canvas b's
//           queries are rows b*C .. b*C + C-1
//   spans:  B records of 7 int64, canvas b's cached keys and values ([nkv, P_b, hd] each, d contiguous, P_b >= 0):
//           {keys address, values address, P_b, keys head stride, keys position stride, values head stride,
//            values position stride} (strides in elements)
//   canvas_keys, canvas_values: [nkv, B*C, hd] (canvas b's are rows b*C ..), element (g, t, d) at
//           ck[g * ck_head_stride + t * ck_row_stride + d] (the same for values)
//   y:      [B*C, nh*hd] same dtype, element (t, h*hd + d) at y[t * y_row_stride + h*hd + d]
//   Canvas b attends to its P_b cached positions, then its C canvas positions: S_b = P_b + C keys, j in that order.
//   Query head h reads KV head h / (nh / nkv). For each canvas, head and query:
//     s_j = rnd(Σ_d f32(q_d)·f32(k_jd))          (d in order, a product then a sum: linear.h's sequence)
//     m = max_j s_j;  e_j = exp_nonpositive(s_j - m) (common/entropy.h);  Z = Σ_j e_j (fp32, j in order)
//     p_j = rnd(e_j / Z);  y_d = rnd(Σ_j f32(p_j)·f32(v_jd))   (j in order, linear.h's sequence)
//   rnd: rounding to the dtype (none in fp32).
//
// Every output element is this one fixed sequence over its own canvas's keys: a canvas's result does not depend on
// the other canvases of the call, the thread count or the CPU's vector width (batch-invariant). The canvas keys are
// read where the projections left them: nothing is written to the cache.
#pragma once

#include <stdint.h>

#include "../common/dtype.h"
#include "../common/status.h"

namespace dg {

constexpr int kDecodeAttentionSpanFields = 7;

struct DecodeAttentionParams {
  DType dtype;  // of q, keys, values and y
  const void* q;
  int64_t q_head_stride;  // elements
  int64_t q_row_stride;   // elements
  const int64_t* spans;   // [canvases][kDecodeAttentionSpanFields], host memory
  const void* canvas_keys;
  const void* canvas_values;
  int64_t ck_head_stride, ck_row_stride;  // elements, canvas_keys
  int64_t cv_head_stride, cv_row_stride;  // elements, canvas_values
  void* y;
  int64_t y_row_stride;  // elements
  int64_t canvases;      // B
  int64_t canvas_length; // C
  int64_t heads;         // nh
  int64_t kv_heads;      // nkv (divides nh)
  int64_t head_dim;      // hd
};

Status decode_attention_cpu(const DecodeAttentionParams& p);

}  // namespace dg
