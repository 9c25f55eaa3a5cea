// diffusion_step: one denoising step of the sampler for `batch` canvas rows (docs/generation.md, "Denoising
// loop"; the noise: docs/seeded-noise.md), the contract of ops.reference.diffusion_step.
//
// Inputs
//   logits:        [batch, canvas_length, vocab_size] fp32 | bf16, element (b, c, v) at
//                  b * logits_stride_b + c * logits_stride_c + v (strides in elements; vocab contiguous)
//   temperature:   [batch] fp32          seeds, blocks, steps: [batch] int64 (steps = remaining-steps k >= 1)
//   entropy_bound: [batch] fp32
//   bitmask:       optional [batch, canvas_length, ceil(vocab_size / 32)] int32, contiguous (nullptr: none); bit
//                  (v % 32) of word v / 32 set = token v allowed (llguidance / xgrammar layout). A disallowed
//                  token's processed value is -inf, so it gets probability 0 in everything below (argmax, the
//                  Gumbel draw, the entropy and the self-conditioning logits). Bits >= vocab_size are ignored. A
//                  position with no allowed token (fully masked) is left unmasked: the mask is a constraint to
//                  satisfy when it can be, never a reason to produce -inf everywhere (documented in ops).
// Outputs (contiguous, preallocated by the caller; every element is written)
//   processed:     [B, C, V] fp32  = f32(logits) / temperature[b]               (IEEE division: bit-exact)
//                                    (-inf where the bitmask disallows the token)
//   argmax:        [B, C] int64    = argmax_v processed (lowest index on ties; the first NaN wins, as torch)
//   canvas:        [B, C] int64    = accepted ? argmax_v (processed + gumbel) : canvas_noise(seed, block, step)
//                  gumbel = common/philox.h gumbel_from_bits (dg_logf), counter (v/4, c, block, 2*step+1)
//   entropy:       [B, C] fp32     = H = log(s) - t/s with s = sum_v e_v, t = sum_v e_v*(y_v - m),
//                  e_v = exp(y_v - m) (fp32, common/entropy.h), m = max_v y_v: the entropy of
//                  softmax(processed) with the sums in double, rounded once; measured within 0.5 ulp of the
//                  float64 entropy, while the reference's fp32 formula is off by up to ~3e-5 (tests/ops)
//   accepted:      [B, C] bool (uint8 0/1) = entropy-bound acceptance (docs/generation.md): stable ascending
//                  sort of H (ties by position, NaN last), running sum in double with each prefix rounded to
//                  fp32, keep where f32(cum - H) <= entropy_bound[b]
//   mean_entropy:  [B] fp32        = sum_c H / C, the sum in torch's CPU order (common/torch_sum.h with
//                  sum_lanes), i.e. bit-identical to entropy.mean(-1) on the CPU
//
// CPU: positions in parallel (OpenMP), then canvases in parallel; results do not depend on the thread count.
// CUDA: one block per position (online max / log-sum-exp / entropy, warp-level argmaxes), then one block per
// canvas (rank sort, sequential fp64 prefix sum, acceptance, renoise, mean); no host sync, no allocation;
// canvas_length <= kDiffusionStepMaxCanvasCuda (ops.diffusion_step uses the reference beyond).
// Both paths skip the Philox draw and logs of entries that cannot win the Gumbel race (f32(y + kGumbelMax) <
// the running best z, common/philox.h): exact, since g <= kGumbelMax and rounding is monotone.
// CUDA entropy is accumulated in a different order (tree), so it may differ from the CPU op's in the last
// bits; processed, argmax, the Gumbel noise and the sampled tokens are bit-identical to the CPU op.
#pragma once

#include <stdint.h>

#include "../common/dtype.h"
#include "../common/philox.h"
#include "../common/status.h"

namespace dg {

struct DiffusionStepParams {
  // inputs
  DType logits_dtype;
  const void* logits;
  int64_t logits_stride_b;       // elements
  int64_t logits_stride_c;       // elements
  const float* temperature;      // [B]
  const int64_t* seeds;          // [B]
  const int64_t* blocks;         // [B]
  const int64_t* steps;          // [B]
  const float* entropy_bound;    // [B]
  const int32_t* bitmask;        // [B, C, bitmask_words] or nullptr (unconstrained)
  // outputs
  int64_t* canvas;               // [B, C]
  int64_t* argmax;               // [B, C]
  float* entropy;                // [B, C]
  uint8_t* accepted;             // [B, C]
  float* mean_entropy;           // [B]
  float* processed;              // [B, C, V]
  // sizes
  int64_t batch;
  int64_t canvas_length;
  int64_t vocab_size;
  int sum_lanes;                 // 8 or 16: torch's Vectorized<float>::size() (common/torch_sum.h)
};

// Words per position of the bitmask: ceil(V / 32).
DG_HD int64_t bitmask_words(int64_t vocab_size) { return (vocab_size + 31) / 32; }

// Whether token v is allowed by one position's mask words (bit v % 32 of word v / 32).
DG_HD bool bitmask_allows(const int32_t* words, int64_t v) { return ((uint32_t)words[v >> 5] >> (v & 31)) & 1u; }

// Whether one position's mask allows any token in [0, V) (bits >= V ignored); false = fully masked.
DG_HD bool bitmask_any(const int32_t* words, int64_t V) {
  const int64_t W = bitmask_words(V);
  uint32_t acc = 0;
  for (int64_t w = 0; w + 1 < W; ++w) acc |= (uint32_t)words[w];
  const int tail = (int)(V - 32 * (W - 1));  // 1..32 valid bits in the last word
  acc |= (uint32_t)words[W - 1] & (tail == 32 ? 0xFFFFFFFFu : ((1u << tail) - 1u));
  return acc != 0;
}

// The CUDA accept kernel keeps 16 bytes per position in shared memory, plus 64 static bytes, within the 48 KB
// a block gets without an opt-in.
constexpr int64_t kDiffusionStepMaxCanvasCuda = 3056;

Status diffusion_step_cpu(const DiffusionStepParams& p);
Status diffusion_step_cuda(const DiffusionStepParams& p, void* stream);  // compiled only with CUDA

// Shared size checks (no data access).
Status check_diffusion_step_params(const DiffusionStepParams& p);

}  // namespace dg
