// linear: y[T, N] = x[T, K] · W[N, K]ᵀ, batch-invariant, the contract of ops.reference.linear (docs/kernels.md,
// "linear: the batch-invariant GEMM").
//
//   x: [T, K] fp32 | bf16, element (t, k) at x[t * x_row_stride + k]
//   w: [N, K] same dtype as x, element (n, k) at w[n * w_n_stride + k * w_k_stride] (any strides: [N, K]
//      contiguous is (K, 1); the transpose of a contiguous [K, N], e.g. an embedding read as x·E, is (1, N))
//   y: [T, N] same dtype, element (t, n) at y[t * y_row_stride + n]; must not alias x or w
//   acc = 0; for k = 0 .. K-1: acc = acc + f32(x[t, k]) * f32(w[n, k])   (a product, then a sum, each rounded
//   to fp32: no fused multiply-add anywhere); y[t, n] = rnd(acc), one rounding to the dtype at the end.
//
// Every output element is this one serial sequence over k, whatever T, the thread count, the CPU's vector width
// or the device: no split-K, and the tiles over T and N never change an element's reduction. A row's result is
// therefore bit-identical alone and in any batch, on the CPU and on CUDA (and CPU == CUDA on the same inputs).
#pragma once

#include <stdint.h>

#include "../common/dtype.h"
#include "../common/status.h"

namespace dg {

struct LinearParams {
  DType dtype;             // of x, w and y
  const void* x;
  int64_t x_row_stride;    // elements
  const void* w;           // [N, K]
  void* y;
  int64_t y_row_stride;    // elements
  int64_t rows;            // T
  int64_t out_features;    // N
  int64_t in_features;     // K
  int64_t w_n_stride;      // elements between w[n, k] and w[n + 1, k]
  int64_t w_k_stride;      // elements between w[n, k] and w[n, k + 1]
};

Status linear_cpu(const LinearParams& p);
Status linear_cuda(const LinearParams& p, void* stream);  // compiled only with CUDA

}  // namespace dg
