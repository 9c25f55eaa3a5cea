// linear on the GPU: a shared-memory tiled GEMM over T and N only (no split-K). A 16 x 16 thread block computes
// a 64 x 64 tile of y, each thread a 4 x 4 micro-tile; x and w tiles of 32 k values are staged in shared memory,
// and every thread walks k = 0 .. K-1 in order with acc = __fadd_rn(acc, __fmul_rn(a, b)) (two roundings, no
// fma; the file is also built with --fmad=false): the reduction of linear.h, so y equals the CPU core's bits.
// Plain CUDA, no torch headers.
#include <cuda_runtime.h>

#include "../common/check.h"
#include "../common/dtype.h"
#include "linear.h"

namespace dg {
namespace {

constexpr int kTile = 64;  // rows and columns of y per block
constexpr int kK = 32;     // k values per shared-memory stage
constexpr int kMicro = 4;  // rows and columns per thread

template <class T>
__global__ void __launch_bounds__(256) linear_kernel(LinearParams p) {
  __shared__ float xs[kK][kTile + 1];  // xs[k][row]
  __shared__ float ws[kK][kTile + 1];  // ws[k][col]
  const T* x = static_cast<const T*>(p.x);
  const T* w = static_cast<const T*>(p.w);
  const int64_t t0 = (int64_t)blockIdx.y * kTile, n0 = (int64_t)blockIdx.x * kTile;
  const int tx = threadIdx.x, ty = threadIdx.y, tid = ty * 16 + tx;
  float acc[kMicro][kMicro];
#pragma unroll
  for (int i = 0; i < kMicro; ++i) {
#pragma unroll
    for (int j = 0; j < kMicro; ++j) acc[i][j] = 0.0f;
  }
  for (int64_t k0 = 0; k0 < p.in_features; k0 += kK) {
    for (int e = tid; e < kK * kTile; e += 256) {  // stage: row/col e / kK, k e % kK (coalesced along k)
      const int rc = e / kK, kk = e % kK;
      const int64_t k = k0 + kk, t = t0 + rc, n = n0 + rc;
      xs[kk][rc] = (k < p.in_features && t < p.rows) ? to_float(x[t * p.x_row_stride + k]) : 0.0f;
      ws[kk][rc] = (k < p.in_features && n < p.out_features) ? to_float(w[n * p.w_n_stride + k * p.w_k_stride]) : 0.0f;
    }
    __syncthreads();
    const int kn = p.in_features - k0 < kK ? (int)(p.in_features - k0) : kK;
    for (int kk = 0; kk < kn; ++kk) {  // k in order: the contract's sequence
      float a[kMicro], b[kMicro];
#pragma unroll
      for (int i = 0; i < kMicro; ++i) a[i] = xs[kk][ty + 16 * i];
#pragma unroll
      for (int j = 0; j < kMicro; ++j) b[j] = ws[kk][tx + 16 * j];
#pragma unroll
      for (int i = 0; i < kMicro; ++i) {
#pragma unroll
        for (int j = 0; j < kMicro; ++j) acc[i][j] = __fadd_rn(acc[i][j], __fmul_rn(a[i], b[j]));
      }
    }
    __syncthreads();
  }
  T* y = static_cast<T*>(p.y);
#pragma unroll
  for (int i = 0; i < kMicro; ++i) {
    const int64_t t = t0 + ty + 16 * i;
#pragma unroll
    for (int j = 0; j < kMicro; ++j) {
      const int64_t n = n0 + tx + 16 * j;
      if (t < p.rows && n < p.out_features) y[t * p.y_row_stride + n] = from_float<T>(acc[i][j]);
    }
  }
}

}  // namespace

Status linear_cuda(const LinearParams& p, void* stream) {
  DG_CHECK_ARG(p.rows >= 0 && p.out_features >= 0 && p.in_features >= 0,
               "linear: sizes must be >= 0, got T=%lld N=%lld K=%lld", (long long)p.rows, (long long)p.out_features,
               (long long)p.in_features);
  const int64_t gy = (p.rows + kTile - 1) / kTile, gx = (p.out_features + kTile - 1) / kTile;
  DG_CHECK_ARG(gy <= 65535 && gx <= 0x7fffffff, "linear: T=%lld exceeds the CUDA grid", (long long)p.rows);
  if (gy == 0 || gx == 0) return Status::Ok();
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const dim3 grid((unsigned)gx, (unsigned)gy), block(16, 16);
  if (p.dtype == DType::kFloat32) {
    linear_kernel<float><<<grid, block, 0, s>>>(p);
  } else {
    linear_kernel<bf16><<<grid, block, 0, s>>>(p);
  }
  DG_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

}  // namespace dg
