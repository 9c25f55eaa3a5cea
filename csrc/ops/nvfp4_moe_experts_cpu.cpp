// nvfp4_moe_experts on the CPU: the kernel-faithful loop. One expert per iteration (experts in parallel; each
// output row is written by exactly one iteration, so results do not depend on the thread count): decode the
// expert's repacked weights with the kernels' own fragment decode (nvfp4::decode_fragment), then plain fp32 dot
// products in k order, the same epilogues as the CUDA kernels (global scales after the sums, never folded).
#include <algorithm>
#include <vector>

#include "../common/activation.h"
#include "../common/check.h"
#include "nvfp4_layout.h"
#include "nvfp4_moe_experts.h"

namespace dg {
namespace {

// Dense fp32 [rows, 64·chunks] of one expert's packed matrix: element (r, k) = E2M1 · s · 2^-7 (packed row order).
void decode_expert(const uint32_t* words, const uint8_t* scales, int64_t rows, int64_t chunks, float* out) {
  const int64_t width = 64 * chunks;
  for (int64_t rt = 0; rt < rows / 16; ++rt) {
    for (int64_t kc = 0; kc < chunks; ++kc) {
      const uint32_t* w = words + (rt * chunks + kc) * nvfp4::kWordsPerChunk;
      const uint8_t* sc = scales + (rt * chunks + kc) * nvfp4::kScalesPerChunk;
      nvfp4::decode_chunk(w, sc, [&](int r, int c, uint16_t bits) {
        out[(rt * 16 + r) * width + 64 * kc + c] = bits_to_float((uint32_t)bits << 16);
      });
    }
  }
}

float dot(const float* w, const float* x, int64_t n) {
  float acc = 0.0f;
  for (int64_t k = 0; k < n; ++k) acc += w[k] * x[k];
  return acc;
}

template <class T>
void run_expert(const Nvfp4MoeParams& p, int64_t e, std::vector<float>& w, std::vector<float>& v) {
  const int64_t H = p.hidden, I = p.inter, K = p.top_k, pairs = p.tokens * p.top_k;
  const int64_t kc1 = nvfp4_chunks(H), kc2 = nvfp4_chunks(I), rt1 = 2 * I / 16, rt2 = H / 16;
  const int64_t begin = std::min<int64_t>(std::max<int64_t>(p.offsets[e], 0), p.slots);
  const int64_t end = std::min<int64_t>(std::max<int64_t>(p.offsets[e + 1], begin), p.slots);
  auto pair_at = [&](int64_t s) { return (int64_t)p.sorted_pairs[s]; };
  bool any = false;
  for (int64_t s = begin; s < end && !any; ++s) any = pair_at(s) >= 0 && pair_at(s) < pairs;
  if (!any) return;
  const float* gs = p.gs + 3 * e;
  const float gs_g = gs[0] * 128.0f, gs_u = gs[1] * 128.0f, gs_d = gs[2] * 128.0f;
  // GEMM1 + activation: packed row 16i + r is gate(8i + r), 16i + 8 + r is up(8i + r)
  w.resize((size_t)(2 * I * 64 * kc1));
  decode_expert(p.w13 + e * rt1 * kc1 * nvfp4::kWordsPerChunk, p.s13 + e * rt1 * kc1 * nvfp4::kScalesPerChunk, 2 * I,
                kc1, w.data());
  v.resize((size_t)std::max(H, I));
  const T* x = static_cast<const T*>(p.x);
  for (int64_t s = begin; s < end; ++s) {
    const int64_t pair = pair_at(s);
    if (pair < 0 || pair >= pairs) continue;
    const T* xr = x + (pair / K) * p.x_row_stride;
    for (int64_t k = 0; k < H; ++k) v[k] = to_float(xr[k]);
    for (int64_t j = 0; j < I; ++j) {
      const int64_t row = 16 * (j / 8) + j % 8;
      const float g = dot(&w[row * 64 * kc1], v.data(), H) * gs_g;
      const float u = dot(&w[(row + 8) * 64 * kc1], v.data(), H) * gs_u;
      p.act[s * I + j] = float_to_bf16(gelu_tanh(g) * u);
    }
  }
  // GEMM2 + global scale + routing weight, written by pair
  w.resize((size_t)(H * 64 * kc2));
  decode_expert(p.w2 + e * rt2 * kc2 * nvfp4::kWordsPerChunk, p.s2 + e * rt2 * kc2 * nvfp4::kScalesPerChunk, H, kc2,
                w.data());
  for (int64_t s = begin; s < end; ++s) {
    const int64_t pair = pair_at(s);
    if (pair < 0 || pair >= pairs) continue;
    for (int64_t k = 0; k < I; ++k) v[k] = to_float(p.act[s * I + k]);
    const float rw = p.topk_w[pair];
    for (int64_t h = 0; h < H; ++h) p.y[pair * H + h] = (dot(&w[h * 64 * kc2], v.data(), I) * gs_d) * rw;
  }
}

}  // namespace

Status nvfp4_moe_experts_cpu(const Nvfp4MoeParams& p) {
  DG_RETURN_IF_ERROR(nvfp4_moe_check(p));
#pragma omp parallel
  {
    std::vector<float> w, v;  // per thread: one expert's decoded matrix, one input row
#pragma omp for schedule(dynamic, 1)
    for (int64_t e = 0; e < p.experts; ++e) {
      if (p.x_dtype == DType::kBFloat16) {
        run_expert<bf16>(p, e, w, v);
      } else {
        run_expert<float>(p, e, w, v);
      }
    }
  }
  return Status::Ok();
}

}  // namespace dg
