// gumbel_noise on the GPU: one thread per Philox call (4 vocabulary entries), grid-stride loop. Philox and
// dg_logf are the shared __host__ __device__ routines of common/philox.h, so the output equals the CPU op
// (and the noise inside diffusion_step) bit for bit. Plain CUDA, no torch headers.
#include <cuda_runtime.h>

#include "../common/check.h"
#include "../common/philox.h"
#include "gumbel_noise.h"

namespace dg {
namespace {

constexpr int kThreads = 256;

__global__ void gumbel_noise_kernel(NoiseParams p, float* out) {
  const int64_t V = p.vocab_size, nq = (V + 3) / 4;
  const int64_t n = p.batch * p.canvas_length * nq;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t q = i % nq, bc = i / nq, b = bc / p.canvas_length, c = bc % p.canvas_length;
    const int64_t seed = p.seeds[b];
    const Philox4 o = philox4x32_10((uint32_t)q, (uint32_t)c, (uint32_t)p.blocks[b], (uint32_t)(2 * p.steps[b] + 1),
                                    seed_key0(seed), seed_key1(seed));
    float* row = out + bc * V;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (q * 4 + j < V) row[q * 4 + j] = gumbel_from_bits(o.v[j]);
    }
  }
}

unsigned grid_for(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return (unsigned)(blocks < 65535 * 8 ? (blocks > 0 ? blocks : 1) : 65535 * 8);
}

}  // namespace

Status gumbel_noise_cuda(const NoiseParams& p, float* out, void* stream) {
  DG_RETURN_IF_ERROR(check_noise_params(p, "gumbel_noise", /*check_values=*/false));
  const int64_t n = p.batch * p.canvas_length * ((p.vocab_size + 3) / 4);
  if (n == 0) return Status::Ok();
  gumbel_noise_kernel<<<grid_for(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p, out);
  DG_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

}  // namespace dg
