// rms_norm on the GPU: one 256-thread block per row. Memory-bound (one read for the sum of squares, one
// read + write for the scale), so the kernel keeps it simple: strided loads, a warp-shuffle tree sum of
// a*a, then every thread scales its elements. The tree order differs from torch's, so results may differ
// from the reference by an ulp of the mean square (see rms_norm.h); plain CUDA, no torch headers.
#include <cuda_runtime.h>

#include "../common/check.h"
#include "../common/dtype.h"
#include "rms_norm.h"

namespace dg {
namespace {

constexpr int kThreads = 256;

template <class T>
__global__ void rms_norm_kernel(RmsNormParams p) {
  const T* xr = static_cast<const T*>(p.x) + (int64_t)blockIdx.x * p.x_row_stride;
  T* yr = static_cast<T*>(p.out) + (int64_t)blockIdx.x * p.out_row_stride;
  float ss = 0.0f;
  for (int64_t k = threadIdx.x; k < p.dim; k += kThreads) {
    const float a = to_float(xr[k]);
    ss = __fadd_rn(ss, __fmul_rn(a, a));
  }
  for (int off = 16; off > 0; off >>= 1) ss = __fadd_rn(ss, __shfl_xor_sync(0xffffffffu, ss, off));
  __shared__ float warp_sums[kThreads / 32];
  __shared__ float inv_shared;
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = ss;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0.0f;
    for (int w = 0; w < kThreads / 32; ++w) total = __fadd_rn(total, warp_sums[w]);
    const float ms = __fdiv_rn(total, (float)p.dim);
    inv_shared = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(ms, p.eps)));
  }
  __syncthreads();
  const float inv = inv_shared;
  for (int64_t k = threadIdx.x; k < p.dim; k += kThreads) {
    float y = __fmul_rn(to_float(xr[k]), inv);
    if (p.weight != nullptr) y = __fmul_rn(y, p.weight[k]);
    yr[k] = from_float<T>(y);
  }
}

}  // namespace

Status rms_norm_cuda(const RmsNormParams& p, void* stream) {
  DG_CHECK_ARG(p.rows >= 0 && p.dim >= 1, "rms_norm: need rows >= 0 and dim >= 1, got rows=%lld dim=%lld",
               (long long)p.rows, (long long)p.dim);
  DG_CHECK_ARG(p.rows <= 0x7fffffff, "rms_norm: rows=%lld exceeds the CUDA grid", (long long)p.rows);
  if (p.rows == 0) return Status::Ok();
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (p.dtype == DType::kFloat32) {
    rms_norm_kernel<float><<<(unsigned)p.rows, kThreads, 0, s>>>(p);
  } else {
    rms_norm_kernel<bf16><<<(unsigned)p.rows, kThreads, 0, s>>>(p);
  }
  DG_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

}  // namespace dg
