// moe_combine: the deterministic sum of each token's top_k expert outputs (the contract of
// ops.reference.moe_combine; the fp32 combine of docs/generation.md, "Feed-forward (dense MLP and MoE)").
//
//   y:       [tokens, top_k, hidden] fp32, contiguous (row p = t * top_k + k is pair p's expert output)
//   weights: [tokens, top_k] fp32, or nullptr when y already carries the routing weights (the CUDA GEMM2
//            epilogue applies them)
//   out:     [tokens, hidden] fp32 | bf16, contiguous
//   out[t, h] = rnd( ((y[t,0,h]·w[t,0] + y[t,1,h]·w[t,1]) + ...) + y[t,K-1,h]·w[t,K-1] )
//   fp32 products, fp32 sums in slot order 0..K-1, one rounding to out's dtype.
//
// Bit-identical to the reference on every device: the same IEEE operations in the same order (no FMA:
// -ffp-contract=off / --fmad=false and explicit __fmul_rn/__fadd_rn on the GPU), no atomics.
// CPU: tokens in parallel (OpenMP). CUDA: one block per token, threads over hidden.
#pragma once

#include <stdint.h>

#include "../common/dtype.h"
#include "../common/status.h"

namespace dg {

struct MoeCombineParams {
  const float* y;         // [tokens, top_k, hidden]
  const float* weights;   // [tokens, top_k] or nullptr
  DType out_dtype;
  void* out;              // [tokens, hidden]
  int64_t tokens;
  int64_t top_k;
  int64_t hidden;
};

Status check_moe_combine_params(const MoeCombineParams& p);
Status moe_combine_cpu(const MoeCombineParams& p);
Status moe_combine_cuda(const MoeCombineParams& p, void* stream);  // compiled only with CUDA

}  // namespace dg
