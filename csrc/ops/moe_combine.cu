// moe_combine on the GPU (contract: moe_combine.h): one 256-thread block per token, threads over hidden.
// Each output element is one thread's fixed-order fp32 sum (__fmul_rn / __fadd_rn: no FMA), so the result is
// bit-identical to the CPU op and the reference. Memory bound: reads K·H fp32, writes H; coalesced.
#include <cuda_runtime.h>

#include "../common/check.h"
#include "../common/dtype.h"
#include "moe_combine.h"

namespace dg {
namespace {

constexpr int kThreads = 256;

template <class T>
__global__ void __launch_bounds__(kThreads) moe_combine_kernel(MoeCombineParams p) {
  const int64_t t = blockIdx.x, K = p.top_k, H = p.hidden;
  const float* yt = p.y + t * K * H;
  const float* wt = p.weights != nullptr ? p.weights + t * K : nullptr;
  T* ot = static_cast<T*>(p.out) + t * H;
  for (int64_t h = threadIdx.x; h < H; h += kThreads) {
    float acc = wt != nullptr ? __fmul_rn(yt[h], wt[0]) : yt[h];
    for (int64_t k = 1; k < K; ++k) {
      const float v = yt[k * H + h];
      acc = __fadd_rn(acc, wt != nullptr ? __fmul_rn(v, wt[k]) : v);
    }
    ot[h] = from_float<T>(acc);
  }
}

}  // namespace

Status moe_combine_cuda(const MoeCombineParams& p, void* stream) {
  DG_RETURN_IF_ERROR(check_moe_combine_params(p));
  DG_CHECK_ARG(p.tokens <= 0x7fffffffLL, "moe_combine: tokens=%lld exceeds the CUDA grid", (long long)p.tokens);
  if (p.tokens == 0 || p.hidden == 0) return Status::Ok();
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (p.out_dtype == DType::kFloat32) {
    moe_combine_kernel<float><<<(unsigned)p.tokens, kThreads, 0, s>>>(p);
  } else {
    moe_combine_kernel<bf16><<<(unsigned)p.tokens, kThreads, 0, s>>>(p);
  }
  DG_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

}  // namespace dg
