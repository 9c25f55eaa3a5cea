// canvas_noise on the GPU: one thread per position, grid-stride loop, the shared __host__ __device__ Philox of
// common/philox.h (integer only: the CPU op's bits). Plain CUDA, no torch headers.
#include <cuda_runtime.h>

#include "../common/check.h"
#include "../common/philox.h"
#include "canvas_noise.h"

namespace dg {
namespace {

constexpr int kThreads = 256;

__global__ void canvas_noise_kernel(NoiseParams p, int64_t* out) {
  const int64_t n = p.batch * p.canvas_length;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t b = i / p.canvas_length, c = i % p.canvas_length;
    out[i] = canvas_token(p.seeds[b], p.blocks[b], p.steps[b], c, p.vocab_size);
  }
}

unsigned grid_for(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return (unsigned)(blocks < 65535 * 8 ? (blocks > 0 ? blocks : 1) : 65535 * 8);
}

}  // namespace

Status canvas_noise_cuda(const NoiseParams& p, int64_t* out, void* stream) {
  DG_RETURN_IF_ERROR(check_noise_params(p, "canvas_noise", /*check_values=*/false));
  const int64_t n = p.batch * p.canvas_length;
  if (n == 0) return Status::Ok();
  canvas_noise_kernel<<<grid_for(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p, out);
  DG_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

}  // namespace dg
