// gumbel_noise: the contract's Gumbel noise (docs/seeded-noise.md), the noise ops.diffusion_step adds to the processed
// logits, as a tensor (for tests and for seeded parity harnesses).
//
//   seeds, blocks, steps: [batch] int64 (steps = the remaining-steps counter k >= 1)
//   out:                  [batch, canvas_length, vocab_size] fp32, contiguous
//   out[b, p, v] = gumbel(philox4x32_10(counter (v / 4, p, blocks[b], 2 * steps[b] + 1), key(seeds[b]))[v % 4])
//   with gumbel(r) = -dg_logf(-dg_logf(((r >> 9) + 0.5) * 2^-23))   (common/philox.h)
//
// Bit-identical on CPU and GPU and to the noise inside diffusion_step; differs from the torch reference
// (torch.log) by <= 2 ulp (docs/seeded-noise.md, "dg_logf"). Counter ranges as in canvas_noise.h.
#pragma once

#include "canvas_noise.h"  // NoiseParams

namespace dg {

Status gumbel_noise_cpu(const NoiseParams& p, float* out);
Status gumbel_noise_cuda(const NoiseParams& p, float* out, void* stream);  // compiled only with CUDA

}  // namespace dg
