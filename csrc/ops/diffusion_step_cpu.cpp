// diffusion_step on the CPU (contract: diffusion_step.h). Two parallel phases:
//   1. per position (b, c), in parallel: processed row, argmax, Gumbel-max sample, entropy;
//   2. per canvas b, in parallel: entropy-bound acceptance, renoise, mean entropy.
// Each position and canvas is computed serially in a fixed order, so the output does not depend on the
// number of threads. The per-position kernel is built for three CPU levels (cpu_vec.h run_vectorized) so
// the Philox / dg_logf / exp / division loops vectorise; all three give the same bits.
#include <math.h>

#include <algorithm>
#include <numeric>
#include <vector>

#include "../common/check.h"
#include "../common/entropy.h"
#include "../common/philox.h"
#include "../common/torch_sum.h"
#include "cpu_vec.h"
#include "diffusion_step.h"

namespace dg {
namespace {

constexpr int64_t kChunk = 64;  // vocabulary entries per inner block (its skip tests); Philox words are drawn for two
constexpr int kLanes = 8;  // independent double accumulators of the entropy sums

struct PositionArgs {
  const void* logits;  // row start
  float* processed;  // row start
  const int32_t* mask;  // the position's bitmask words, or nullptr (unconstrained or fully masked)
  float temperature;
  uint32_t k0, k1, block, ctr3, pos;  // Philox key and counter words (ctr3 = 2k + 1)
  int64_t vocab;
};

struct PositionResult {
  int64_t argmax;
  int64_t sample;
  float entropy;
};

// torch.argmax's rule as a running update in index order: a larger value wins, equal values keep the lower
// index, and the first NaN wins over everything.
DG_HD void argmax_update(float v, int64_t i, float& best, int64_t& best_i) {
  if (best == best && (v > best || v != v)) {
    best = v;
    best_i = i;
  }
}

// Whether argmax_update could change `best` for some element of a[0..n): a larger value or a NaN, unless
// best is already NaN (then nothing wins). Branch-free, so it vectorises.
DG_HD bool chunk_may_win(const float* a, int64_t n, float best) {
  int hit = 0;
  for (int64_t i = 0; i < n; ++i) hit |= (int)((a[i] > best) | (a[i] != a[i]));
  return hit != 0 && best == best;
}

// Whether some element of y[0..n) could beat `best` after adding Gumbel noise: not f32(y + kGumbelMax) < best
// (NaN y or best: true). When false, the chunk's draw is skipped: g <= kGumbelMax and rounding is monotone, so
// no z of the chunk can beat (or tie) best. Branch-free, so it vectorises.
DG_HD bool chunk_may_beat(const float* y, int64_t n, float best) {
  int hit = 0;
  for (int64_t i = 0; i < n; ++i) hit |= (int)!((y[i] + kGumbelMax) < best);
  return hit != 0;
}

// Whether some element of y[0..n) could beat `best` with its own draw: not f32(y + gumbel_upper_bound(r)) < best
// (NaN: true). When false, the chunk's logs are skipped (its Philox words r are drawn): g <= the bound and rounding
// is monotone. Branch-free, so it vectorises.
DG_HD bool chunk_may_beat_drawn(const float* y, const uint32_t* r, int64_t n, float best) {
  int hit = 0;
  for (int64_t i = 0; i < n; ++i) hit |= (int)!((y[i] + gumbel_upper_bound(r[i])) < best);
  return hit != 0;
}

// y = x / T (IEEE division, as the reference), -inf where the mask disallows v.
template <class T>
DG_HD float processed_value(const T* x, int64_t v, float temperature, const int32_t* mask) {
  const float y = to_float(x[v]) / temperature;
  return (mask == nullptr || bitmask_allows(mask, v)) ? y : -INFINITY;
}

// Entropy of softmax(y[0..V)) around its maximum m (not NaN): H = log(s) - t / s, s = sum e, t = sum e (y - m),
// e = exp(y - m) in fp32, the sums in double over kLanes interleaved partial sums (lane = v % kLanes), then
// lanes 0..kLanes-1 in order: a fixed order for every V.
DG_HD float entropy_of_row(const float* y, int64_t V, float m) {
  double s[kLanes] = {0}, t[kLanes] = {0};
  float d[kChunk + kLanes], e[kChunk + kLanes];
  for (int64_t v0 = 0; v0 < V; v0 += kChunk) {
    const int64_t n = V - v0 < kChunk ? V - v0 : kChunk;
    for (int64_t i = 0; i < n; ++i) {
      d[i] = y[v0 + i] - m;
      e[i] = exp_nonpositive(d[i]);
    }
    for (int64_t i = n; i < (n + kLanes - 1) / kLanes * kLanes; ++i) {  // pad to whole lane groups: adds +0
      d[i] = 0.0f;
      e[i] = 0.0f;
    }
    for (int64_t g0 = 0; g0 < n; g0 += kLanes) {
#pragma omp simd
      for (int l = 0; l < kLanes; ++l) {
        const float ei = e[g0 + l];
        const double ed = (double)ei * (double)d[g0 + l];  // NaN for e = 0, d = -inf: dropped by the select
        s[l] += (double)ei;
        t[l] += ei > 0.0f ? ed : 0.0;
      }
    }
  }
  double S = 0.0, T = 0.0;
  for (int l = 0; l < kLanes; ++l) {
    S += s[l];
    T += t[l];
  }
  return (float)(log(S) - T / S);
}

template <class T>
DG_HD PositionResult position_impl(const PositionArgs& a) {
  const T* x = static_cast<const T*>(a.logits);
  float* y = a.processed;
  const int64_t V = a.vocab;
  float best_y = processed_value(x, 0, a.temperature, a.mask), best_z = 0.0f;
  int64_t arg_y = 0, arg_z = -1;
  float yc[kChunk], zc[kChunk];
  uint32_t pair_r[2 * kChunk];  // the Philox words of chunks 2p and 2p + 1 (philox_x32), drawn when either needs them
  int64_t drawn_pair = -1;
  for (int64_t v0 = 0; v0 < V; v0 += kChunk) {
    const int64_t n = V - v0 < kChunk ? V - v0 : kChunk;
    if (a.mask == nullptr) {  // the unconstrained loop stays branch-free
      for (int64_t i = 0; i < n; ++i) yc[i] = to_float(x[v0 + i]) / a.temperature;  // IEEE division
    } else {
      for (int64_t i = 0; i < n; ++i) yc[i] = processed_value(x, v0 + i, a.temperature, a.mask);
    }
    for (int64_t i = 0; i < n; ++i) y[v0 + i] = yc[i];
    // The running argmaxes change rarely: scan a chunk only when some element could win (vectorised test).
    if (chunk_may_win(yc, n, best_y)) {
      for (int64_t i = 0; i < n; ++i) argmax_update(yc[i], v0 + i, best_y, arg_y);
    }
    // The exact Gumbel skips: no draw where no noise value could lift an entry to the running best, and no logs
    // where no entry's own bound could (once a best exists).
    if (arg_z >= 0 && !chunk_may_beat(yc, n, best_z)) continue;
    const int64_t chunk = v0 / kChunk;
    if (chunk / 2 != drawn_pair) {  // one draw of 128 entries' words (the odd half unused if that chunk is skipped)
      drawn_pair = chunk / 2;
      philox_x32((uint32_t)drawn_pair * 32u, a.pos, a.block, a.ctr3, a.k0, a.k1, pair_r);
    }
    const uint32_t* r = pair_r + (chunk % 2) * kChunk;
    if (arg_z >= 0 && !chunk_may_beat_drawn(yc, r, n, best_z)) continue;
    for (int64_t i = 0; i < n; ++i) zc[i] = yc[i] + gumbel_from_bits(r[i]);
    if (arg_z < 0) {
      best_z = zc[0];
      arg_z = 0;
    }
    if (chunk_may_win(zc, n, best_z)) {
      for (int64_t i = 0; i < n; ++i) argmax_update(zc[i], v0 + i, best_z, arg_z);
    }
  }
  const float h = best_y == best_y ? entropy_of_row(y, V, best_y) : best_y;
  return PositionResult{arg_y, arg_z, h};
}

template <class T>
void positions(const DiffusionStepParams& p) {
  const int64_t C = p.canvas_length, V = p.vocab_size;
  const T* logits = static_cast<const T*>(p.logits);
#pragma omp parallel for schedule(dynamic, 1) if (p.batch * C * V >= 16384)
  for (int64_t bc = 0; bc < p.batch * C; ++bc) {
    const int64_t b = bc / C, c = bc % C;
    PositionArgs a;
    a.logits = logits + b * p.logits_stride_b + c * p.logits_stride_c;
    a.processed = p.processed + bc * V;
    const int32_t* mask = p.bitmask == nullptr ? nullptr : p.bitmask + bc * bitmask_words(V);
    a.mask = (mask != nullptr && bitmask_any(mask, V)) ? mask : nullptr;  // fully masked: left unmasked
    a.temperature = p.temperature[b];
    a.k0 = seed_key0(p.seeds[b]);
    a.k1 = seed_key1(p.seeds[b]);
    a.block = (uint32_t)p.blocks[b];
    a.ctr3 = (uint32_t)(2 * p.steps[b] + 1);
    a.pos = (uint32_t)c;
    a.vocab = V;
    const PositionResult res = run_vectorized([&]() DG_INLINE_LAMBDA { return position_impl<T>(a); });
    p.argmax[bc] = res.argmax;
    p.canvas[bc] = res.sample;  // replaced by noise in phase 2 where not accepted
    p.entropy[bc] = res.entropy;
  }
}

// Phase 2 for canvas b: acceptance (docs/generation.md), renoise (docs/seeded-noise.md), mean entropy.
void accept_canvas(const DiffusionStepParams& p, int64_t b, std::vector<int64_t>& order) {
  const int64_t C = p.canvas_length;
  const float* h = p.entropy + b * C;
  order.resize(C);
  std::iota(order.begin(), order.end(), int64_t(0));
  std::stable_sort(order.begin(), order.end(), [h](int64_t i, int64_t j) {
    const bool ni = h[i] != h[i], nj = h[j] != h[j];
    if (ni || nj) return !ni && nj;  // NaN sorts last, as torch.sort does
    return h[i] < h[j];
  });
  const float bound = p.entropy_bound[b];
  double cum = 0.0;
  for (int64_t j = 0; j < C; ++j) {
    const float hj = h[order[j]];
    cum += (double)hj;
    const float prefix = (float)cum;
    p.accepted[b * C + order[j]] = (prefix - hj) <= bound ? 1 : 0;
  }
  for (int64_t c = 0; c < C; ++c) {
    if (!p.accepted[b * C + c]) {
      p.canvas[b * C + c] = canvas_token(p.seeds[b], p.blocks[b], p.steps[b], c, p.vocab_size);
    }
  }
  // the lane-split form the CUDA accept kernel runs in parallel (bit-identical to torch_sum; tested here)
  p.mean_entropy[b] = torch_sum_split([h](int64_t c) { return h[c]; }, C, p.sum_lanes) / (float)C;
}

}  // namespace

Status check_diffusion_step_params(const DiffusionStepParams& p) {
  DG_CHECK_ARG(p.batch >= 0, "diffusion_step: batch must be >= 0, got %lld", (long long)p.batch);
  DG_CHECK_ARG(p.canvas_length >= 1 && p.canvas_length <= 0x7FFFFFFFll,
               "diffusion_step: canvas_length must be in [1, 2^31), got %lld", (long long)p.canvas_length);
  DG_CHECK_ARG(p.vocab_size >= 1 && p.vocab_size <= 0x7FFFFFFFll,
               "diffusion_step: vocab_size must be in [1, 2^31), got %lld", (long long)p.vocab_size);
  DG_CHECK_ARG(p.sum_lanes == 8 || p.sum_lanes == 16, "diffusion_step: sum_lanes must be 8 or 16, got %d", p.sum_lanes);
  return Status::Ok();
}

Status diffusion_step_cpu(const DiffusionStepParams& p) {
  DG_RETURN_IF_ERROR(check_diffusion_step_params(p));
  for (int64_t b = 0; b < p.batch; ++b) {
    DG_CHECK_ARG(p.blocks[b] >= 0 && p.blocks[b] <= 0xFFFFFFFFll,
                 "diffusion_step: blocks[%lld] = %lld is outside [0, 2^32)", (long long)b, (long long)p.blocks[b]);
    DG_CHECK_ARG(p.steps[b] >= 0 && p.steps[b] <= 0x7FFFFFFFll,
                 "diffusion_step: steps[%lld] = %lld is outside [0, 2^31)", (long long)b, (long long)p.steps[b]);
  }
  if (p.logits_dtype == DType::kFloat32) {
    positions<float>(p);
  } else {
    positions<bf16>(p);
  }
#pragma omp parallel if (p.batch > 1)
  {
    std::vector<int64_t> order;
#pragma omp for schedule(static)
    for (int64_t b = 0; b < p.batch; ++b) accept_canvas(p, b, order);
  }
  return Status::Ok();
}

}  // namespace dg
