// Argument checks for core functions: return an InvalidArgument Status naming the op and the argument.
//
//   DG_CHECK_ARG(C >= 1, "diffusion_step: canvas_length must be >= 1, got %lld", (long long)C);
//
// bindings.cpp validates tensors (dtype, device, shape, contiguity) before calling a core; these checks
// guard the sizes a core relies on, so a core called from elsewhere (a benchmark, a test) fails cleanly.
#pragma once

#include "status.h"

#define DG_CHECK_ARG(cond, ...)                                                                \
  do {                                                                                         \
    if (!(cond)) return ::dg::Status::printf(::dg::StatusCode::kInvalidArgument, __VA_ARGS__); \
  } while (0)

#define DG_RETURN_IF_ERROR(expr)             \
  do {                                       \
    ::dg::Status dg_status_ = (expr);        \
    if (!dg_status_.ok()) return dg_status_; \
  } while (0)

#if defined(__CUDACC__)
// Wrap a CUDA runtime call (or cudaGetLastError() after a launch): a failure becomes a CudaError status.
#define DG_CUDA_CHECK(expr)                                                                                 \
  do {                                                                                                      \
    cudaError_t dg_err_ = (expr);                                                                           \
    if (dg_err_ != cudaSuccess)                                                                             \
      return ::dg::Status::printf(::dg::StatusCode::kCudaError, "%s:%d: %s: %s", __FILE__, __LINE__, #expr, \
                                  cudaGetErrorString(dg_err_));                                             \
  } while (0)
#endif
