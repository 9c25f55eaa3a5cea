// nvfp4_moe_experts: the grouped W4A16 expert MLP on repacked NVFP4 weights (docs/kernels.md), per pair.
//
//   x        [T, H] bf16 (CPU also fp32), row t at x + t·x_row_stride; H = hidden (K of GEMM1)
//   w13, s13 GEMM1 operand [E, 2I/16, KC1, 128] uint32 / [E, 2I/16, KC1, 64] uint8 (gate/up interleaved by 8,
//            nvfp4_repack with interleave_half = I); KC1 = ceil(pad16(H) / 64)
//   w2, s2   GEMM2 operand [E, H/16, KC2, 128] / [E, H/16, KC2, 64]; KC2 = ceil(pad16(I) / 64)
//   gs       [E, 3] fp32 global scales (weight_scale_2 of gate, up, down), kept apart and never folded
//   topk_w   [T·K] fp32 routing weight of pair p = t·K + k
//   sorted_pairs [P] int32, offsets [E+1] int32: the sorted pairs of moe_align. Slots offsets[e] ..
//            offsets[e+1]-1 belong to expert e (non-decreasing offsets, offsets[E] <= P); a slot holds a pair
//            index in [0, T·K), or any value outside it for padding (skipped). Every pair must appear once
//            (a missing pair leaves its row of `y` unwritten).
//   act      [P, I] bf16 workspace: GEMM1's output in slot order
//   y        [T·K, H] fp32 output by pair:
//     act[s, j] = bf16( gelu_tanh(gs_g · (Wg_q[j] · x_t)) · (gs_u · (Wu_q[j] · x_t)) ),  t = pair(s) / K
//     y[p, h]   = (gs_d · (Wd_q[h] · act[s])) · topk_w[p]
//   with W_q = E2M1 · E4M3 (exact in bf16; the fp32 sums are taken over W_q·2^-7 and scaled by gs·2^7, which is
//   the same product), fp32 accumulation. The combine (Σ_k y[t·K + k] in slot order) is moe_combine's job.
// CPU: sums in k order (one thread per expert, deterministic). CUDA (sm_80+; tuned for sm_90a): tensor-core
// sums (mma.m16n8k16 bf16, fixed split-K tree) — bitwise deterministic, not bitwise equal to the CPU.
// CUDA needs H % 8 == 0, 16-byte aligned x rows; no host sync, no allocation, a static grid (graph-capturable).
#pragma once

#include <stdint.h>

#include "../common/dtype.h"
#include "../common/status.h"

namespace dg {

struct Nvfp4MoeParams {
  DType x_dtype;
  const void* x;
  int64_t x_row_stride;  // elements
  const uint32_t* w13;
  const uint8_t* s13;
  const uint32_t* w2;
  const uint8_t* s2;
  const float* gs;
  const float* topk_w;
  const int32_t* sorted_pairs;
  const int32_t* offsets;
  bf16* act;
  float* y;
  int64_t tokens;   // T
  int64_t top_k;    // K
  int64_t experts;  // E
  int64_t hidden;   // H
  int64_t inter;    // I
  int64_t slots;    // P
};

// sizes shared by both paths
DG_HD int64_t nvfp4_chunks(int64_t k) { return ((k + 15) / 16 * 16 + 63) / 64; }

inline Status nvfp4_moe_check(const Nvfp4MoeParams& p) {
  if (p.tokens < 0 || p.top_k < 1 || p.experts < 1 || p.hidden < 1 || p.inter < 1 || p.slots < 0)
    return Status::printf(StatusCode::kInvalidArgument,
                          "nvfp4_moe_experts: bad sizes T=%lld K=%lld E=%lld H=%lld I=%lld P=%lld", (long long)p.tokens,
                          (long long)p.top_k, (long long)p.experts, (long long)p.hidden, (long long)p.inter,
                          (long long)p.slots);
  if (p.hidden % 16 != 0 || p.inter % 8 != 0)
    return Status::printf(StatusCode::kInvalidArgument,
                          "nvfp4_moe_experts: need hidden %% 16 == 0 (rows of down) and inter %% 8 == 0 (gate/up "
                          "interleave), got H=%lld I=%lld",
                          (long long)p.hidden, (long long)p.inter);
  if (p.tokens * p.top_k > 0x7fffffffLL || p.slots > 0x7fffffffLL)
    return Status::InvalidArgument("nvfp4_moe_experts: more than 2^31 pairs or slots");
  return Status::Ok();
}

Status nvfp4_moe_experts_cpu(const Nvfp4MoeParams& p);
Status nvfp4_moe_experts_cuda(const Nvfp4MoeParams& p, void* stream);  // compiled only with CUDA

}  // namespace dg
