// moe_experts: the grouped expert GEMMs over pairs grouped by moe_align (docs/kernels.md, "MoE dispatch" and
// "Grouped expert GEMMs (Hopper design)").
//
// Inputs
//   x:            [tokens, hidden] bf16 | fp32 (md), contiguous
//   gate_up:      [experts, 2·inter, hidden] md (rows 0..inter-1 gate, inter..2·inter-1 up), contiguous
//   down:         [experts, hidden, inter] md, contiguous
//   weights:      [tokens, top_k] fp32 routing weights (pair p = t·top_k + k)
//   counts, offsets, sorted_pairs: moe_align's outputs (any block_size)
// Outputs (preallocated)
//   act:          [capacity, inter] md: row offsets[e] + i = a of pair sorted_pairs[offsets[e] + i]; padding rows
//                 are not written
//   y:            [tokens·top_k, hidden] fp32: row p = f32(rnd(a_p · down[e_p]ᵀ)) · weights[p]
//
//   GEMM1: g, u = rnd(x_t · gate[e]ᵀ), rnd(x_t · up[e]ᵀ); a = rnd(rnd(gelu_tanh(g)) · u)   (fp32 accumulate)
//   GEMM2: y_p = f32(rnd(a · down[e]ᵀ)) · w_p                                             (fp32 accumulate)
// `rnd` rounds to md at the points where the reference's torch ops round (F.linear, F.gelu, the product),
// so the only difference from the reference is the accumulation order of the dot products. moe_combine
// then sums each token's rows (weights = nullptr there). Every pair's y row is written exactly once.
//
// CPU: the obvious loop (sequential fp32 dot products, experts in parallel): the mirror of the CUDA
// kernels' contract for tests; dgserve.ops does not dispatch to it (on CPU the model keeps torch's GEMMs,
// whose bits the reference defines).
// CUDA (bf16 only; hidden % 8 == 0, inter % 8 == 0, 16-byte aligned x/gate_up/down/act): expert-major grids
// that read each expert's weight slice once per 32-token chunk of its pairs (once in total for experts with
// <= 32 pairs, the common case at one canvas: 16 on average). mma.sync m16n8k16 bf16 (sm_80+), weights as
// the A operand (swap-AB: output features on M, tokens on N), 16-byte loads of weights and tokens with a
// consistent permutation of K, one slab of registers prefetched ahead. GEMM1 computes gate and up of the
// same features in one warp (two accumulator sets) and applies the activation in its epilogue; GEMM2 applies
// the routing weight in its epilogue. Fixed per-thread reduction order: deterministic run to run; act rows'
// placement within an expert does not change any value.
#pragma once

#include <stdint.h>

#include "../common/dtype.h"
#include "../common/status.h"

namespace dg {

struct MoeExpertsParams {
  DType dtype;                  // of x, gate_up, down, act
  const void* x;
  const void* gate_up;
  const void* down;
  const float* weights;         // [tokens, top_k]
  const int32_t* counts;        // [experts]
  const int32_t* offsets;       // [experts + 1]
  const int32_t* sorted_pairs;  // [capacity]
  void* act;                    // [capacity, inter]
  float* y;                     // [tokens * top_k, hidden]
  int64_t tokens;
  int64_t top_k;
  int64_t experts;
  int64_t hidden;
  int64_t inter;
  int64_t capacity;
};

// Grid splits of an expert's token chunks (the CUDA kernels of moe_experts and nvfp4_moe_experts): enough for
// `tokens` pairs (an expert's most from a top-k without repeats), at most max_splits, at least 1. Static per
// shape (CUDA graphs); a block takes chunks split, split + splits, ... so any count is covered.
inline int64_t moe_chunk_splits(int64_t tokens, int64_t chunk, int64_t max_splits) {
  const int64_t n = (tokens + chunk - 1) / chunk;
  return n < 1 ? 1 : n > max_splits ? max_splits : n;
}

Status check_moe_experts_params(const MoeExpertsParams& p);
Status moe_experts_cpu(const MoeExpertsParams& p);
Status moe_experts_cuda(const MoeExpertsParams& p, void* stream);  // compiled only with CUDA

}  // namespace dg
