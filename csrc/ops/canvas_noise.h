// canvas_noise: the contract's uniform canvas tokens (docs/seeded-noise.md, "Canvas noise"), the contract of
// ops.reference.canvas_noise.
//
//   seeds, blocks, steps: [batch] int64 (per row; a seed is any int64, read as two's-complement 64 bits)
//   out:                  [batch, canvas_length] int64, contiguous
//   out[b, p] = philox4x32_10(counter (p, 0, blocks[b], 2 * steps[b]), key(seeds[b]))[0] mod vocab_size
//
// Integer only: bit-identical on CPU and GPU. blocks must lie in [0, 2^32) and steps in [0, 2^31) (the
// counter words are uint32); the CPU core checks this, the CUDA core cannot read the values and truncates.
#pragma once

#include <stdint.h>

#include "../common/status.h"

namespace dg {

struct NoiseParams {
  const int64_t* seeds;   // [batch]
  const int64_t* blocks;  // [batch]
  const int64_t* steps;   // [batch]
  int64_t batch;
  int64_t canvas_length;
  int64_t vocab_size;
};

Status canvas_noise_cpu(const NoiseParams& p, int64_t* out);
Status canvas_noise_cuda(const NoiseParams& p, int64_t* out, void* stream);  // compiled only with CUDA

// Shared by the noise ops: sizes and (CPU only) the counter ranges.
Status check_noise_params(const NoiseParams& p, const char* op, bool check_values);

}  // namespace dg
