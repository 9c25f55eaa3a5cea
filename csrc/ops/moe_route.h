// moe_route: the routing half of ops.reference.moe_route (docs/generation.md, "Feed-forward (dense MLP and
// MoE)"), fused after the router projection.
//
//   scores:           [tokens, experts] fp32 | bf16, element (t, e) at scores[t * scores_row_stride + e]:
//                     the router logits z·Wrᵀ (from_logits = true) or their fp32 softmax (from_logits = false,
//                     fp32 only)
//   per_expert_scale: [experts] fp32 (the caller converts the md weight exactly)
//   weights:          [tokens, top_k] fp32 out   ids: [tokens, top_k] int64 out (contiguous)
//
//   π = from_logits ? softmax_fp32(scores) : scores;  (v, e) = top_k(π) descending;
//   w_k = (v_k / Σ_k v_k) · per_expert_scale[e_k]   (two fp32 roundings, in this order)
//
// CPU: written to be bit-identical to the reference *given torch's fp32 softmax* (from_logits = false), which
// is how dgserve.ops dispatches on CPU: torch's vectorised Sleef exp and lane-tree sums of softmax are not
// reproduced here. The top-k selection replays torch's CPU topk (ATen TopKImpl.h): (value, index) pairs with
// the comparator "NaN first, then greater", std::partial_sort when k·64 <= experts, else std::nth_element at
// k-1 followed by std::sort of the first k-1 -- the same libstdc++ algorithms, hence the same order at ties
// (which is NOT lowest-index-first). Σ_k v_k is summed in torch's CPU sum order (common/torch_sum.h,
// sum_lanes). With from_logits = true the CPU op computes softmax with libm expf and a sequential sum (the
// CPU mirror of the CUDA kernel's formula, not bit-identical to torch).
// CUDA: one warp per token, softmax with expf and a fixed xor-shuffle tree sum, k rounds of warp arg-max
// with ties broken toward the LOWEST expert index (vLLM's rule), Σ_k in slot order. Deterministic; equal to
// the reference up to fp32 rounding of the softmax (and ids differ only at exact ties). experts <= 256.
#pragma once

#include <stdint.h>

#include "../common/dtype.h"
#include "../common/status.h"

namespace dg {

struct MoeRouteParams {
  DType scores_dtype;
  const void* scores;
  int64_t scores_row_stride;       // elements
  bool from_logits;                // true: softmax inside; false: scores are fp32 probabilities
  const float* per_expert_scale;   // [experts]
  float* weights;                  // [tokens, top_k]
  int64_t* ids;                    // [tokens, top_k]
  int64_t tokens;
  int64_t experts;
  int64_t top_k;
  int sum_lanes;                   // CPU only: 8 or 16 (torch's Vectorized<float>::size())
};

constexpr int64_t kMoeRouteMaxExpertsCuda = 256;

Status check_moe_route_params(const MoeRouteParams& p);
Status moe_route_cpu(const MoeRouteParams& p);
Status moe_route_cuda(const MoeRouteParams& p, void* stream);  // compiled only with CUDA

}  // namespace dg
