// moe_route on the GPU (contract: moe_route.h): one warp per token, 4 tokens per 128-thread block.
// Lane l holds experts l, l+32, ... (up to 8 per lane, experts <= 256) in registers. Softmax in fp32 (expf,
// a fixed xor-shuffle tree for the max and the sum), then top_k rounds of a warp arg-max over the experts not
// yet taken: the larger value wins, a NaN beats any number, ties go to the lower expert index. Lane k keeps
// round k's (value, expert); the renormalising sum runs over k in slot order. No shared memory, no atomics:
// deterministic.
#include <cuda_runtime.h>
#include <math.h>

#include "../common/check.h"
#include "../common/dtype.h"
#include "moe_route.h"

namespace dg {
namespace {

constexpr int kWarpsPerBlock = 4;
constexpr int kPerLane = (int)(kMoeRouteMaxExpertsCuda / 32);  // 8
constexpr unsigned kFull = 0xffffffffu;

struct Best {
  float value;
  int index;  // INT_MAX: none
};

__device__ __forceinline__ bool beats(const Best& a, const Best& b) {
  if (a.index == 0x7fffffff) return false;
  if (b.index == 0x7fffffff) return true;
  const bool an = a.value != a.value, bn = b.value != b.value;
  if (an != bn) return an;
  if (!an && a.value != b.value) return a.value > b.value;
  return a.index < b.index;
}

template <class T>
__global__ void __launch_bounds__(32 * kWarpsPerBlock) moe_route_kernel(MoeRouteParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t t = (int64_t)blockIdx.x * kWarpsPerBlock + (threadIdx.x >> 5);
  if (t >= p.tokens) return;  // whole warps leave together
  const int E = (int)p.experts, K = (int)p.top_k;
  const T* row = static_cast<const T*>(p.scores) + t * p.scores_row_stride;
  float v[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + 32 * i;
    v[i] = e < E ? to_float(row[e]) : -INFINITY;
  }
  if (p.from_logits) {
    float m = -INFINITY;
    bool nan = false;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      nan = nan || v[i] != v[i];
      m = fmaxf(m, v[i]);
    }
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(kFull, m, off));
    if (__any_sync(kFull, nan)) m = NAN;
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      v[i] = lane + 32 * i < E ? expf(__fsub_rn(v[i], m)) : 0.0f;
      s = __fadd_rn(s, v[i]);
    }
    for (int off = 16; off > 0; off >>= 1) s = __fadd_rn(s, __shfl_xor_sync(kFull, s, off));
    const float inv = __fdiv_rn(1.0f, s);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) v[i] = __fmul_rn(v[i], inv);
  }
  unsigned taken = 0;
  float my_value = 0.0f;
  int my_index = 0;
  for (int k = 0; k < K; ++k) {
    Best best{0.0f, 0x7fffffff};
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const Best c{v[i], lane + 32 * i};
      if (c.index < E && !((taken >> i) & 1u) && beats(c, best)) best = c;
    }
    for (int off = 16; off > 0; off >>= 1) {
      const Best o{__shfl_xor_sync(kFull, best.value, off), __shfl_xor_sync(kFull, best.index, off)};
      if (beats(o, best)) best = o;
    }
    if ((best.index & 31) == lane) taken |= 1u << (best.index >> 5);
    if (lane == k) {
      my_value = best.value;
      my_index = best.index;
    }
  }
  float sum = 0.0f;
  for (int k = 0; k < K; ++k) sum = __fadd_rn(sum, __shfl_sync(kFull, my_value, k));
  if (lane < K) {
    const float w = __fdiv_rn(my_value, sum);
    p.weights[t * K + lane] = __fmul_rn(w, p.per_expert_scale[my_index]);
    p.ids[t * K + lane] = my_index;
  }
}

}  // namespace

Status moe_route_cuda(const MoeRouteParams& p, void* stream) {
  DG_RETURN_IF_ERROR(check_moe_route_params(p));
  DG_CHECK_ARG(p.experts <= kMoeRouteMaxExpertsCuda, "moe_route: CUDA supports experts <= %lld, got %lld",
               (long long)kMoeRouteMaxExpertsCuda, (long long)p.experts);
  DG_CHECK_ARG(p.top_k <= 32, "moe_route: CUDA supports top_k <= 32, got %lld", (long long)p.top_k);
  const int64_t blocks = (p.tokens + kWarpsPerBlock - 1) / kWarpsPerBlock;
  DG_CHECK_ARG(blocks <= 0x7fffffffLL, "moe_route: tokens=%lld exceeds the CUDA grid", (long long)p.tokens);
  if (p.tokens == 0) return Status::Ok();
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (p.scores_dtype == DType::kFloat32) {
    moe_route_kernel<float><<<(unsigned)blocks, 32 * kWarpsPerBlock, 0, s>>>(p);
  } else {
    moe_route_kernel<bf16><<<(unsigned)blocks, 32 * kWarpsPerBlock, 0, s>>>(p);
  }
  DG_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

}  // namespace dg
