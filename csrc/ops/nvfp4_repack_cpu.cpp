// nvfp4_repack / nvfp4_decode on the CPU: the obvious loops over the packed layout, calling the same
// nvfp4_layout.h functions as the CUDA kernels (one output word / scale byte / fragment at a time).
#include "../common/check.h"
#include "nvfp4_layout.h"
#include "nvfp4_repack.h"

namespace dg {

Status nvfp4_repack_cpu(const Nvfp4RepackParams& p) {
  DG_RETURN_IF_ERROR(nvfp4_repack_check(p));
  const int64_t rt_n = p.rows / 16, kc_n = (p.kp + 63) / 64, half_k = p.kp / 2, nb = p.kp / 16;
#pragma omp parallel for schedule(static) if (p.experts * rt_n >= 16)
  for (int64_t er = 0; er < p.experts * rt_n; ++er) {
    const int64_t e = er / rt_n, rt = er % rt_n;
    const uint8_t* w = p.weight + e * p.rows * half_k;
    const uint8_t* s = p.scale + e * p.rows * nb;
    auto codes = [&](int64_t row, int64_t k) { return (uint32_t)(w[row * half_k + k / 2] >> (4 * (k & 1))) & 0xFu; };
    auto zero = [&](int64_t row, int64_t kb) { return nvfp4::scale_is_zero(s[row * nb + kb]); };
    auto scale = [&](int64_t row, int64_t kb) { return (uint32_t)s[row * nb + kb]; };
    for (int64_t kc = 0; kc < kc_n; ++kc) {
      uint32_t* words = p.words + (er * kc_n + kc) * nvfp4::kWordsPerChunk;
      uint8_t* scales = p.scales + (er * kc_n + kc) * nvfp4::kScalesPerChunk;
      for (int lane = 0; lane < 32; ++lane)
        for (int j = 0; j < 4; ++j)
          words[lane * 4 + j] = nvfp4::pack_word(rt, kc, lane, j, p.interleave_half, p.kp, codes, zero);
      for (int b = 0; b < nvfp4::kScalesPerChunk; ++b)
        scales[b] = (uint8_t)nvfp4::pack_scale(rt, kc, b, p.interleave_half, p.kp, scale);
    }
  }
  return Status::Ok();
}

Status nvfp4_decode_cpu(const Nvfp4DecodeParams& p) {
  DG_CHECK_ARG(p.experts >= 0 && p.rows >= 0 && p.rows % 16 == 0 && p.chunks >= 0,
               "nvfp4_decode: need rows %% 16 == 0, got E=%lld N=%lld KC=%lld", (long long)p.experts, (long long)p.rows,
               (long long)p.chunks);
  const int64_t rt_n = p.rows / 16, width = 64 * p.chunks;
#pragma omp parallel for schedule(static) if (p.experts * rt_n >= 16)
  for (int64_t er = 0; er < p.experts * rt_n; ++er) {
    const int64_t e = er / rt_n, rt = er % rt_n;
    bf16* out = p.out + (e * p.rows + rt * 16) * width;
    for (int64_t kc = 0; kc < p.chunks; ++kc) {
      const uint32_t* words = p.words + (er * p.chunks + kc) * nvfp4::kWordsPerChunk;
      const uint8_t* sc = p.scales + (er * p.chunks + kc) * nvfp4::kScalesPerChunk;
      nvfp4::decode_chunk(words, sc, [&](int r, int c, uint16_t bits) { out[r * width + 64 * kc + c] = bf16{bits}; });
    }
  }
  return Status::Ok();
}

}  // namespace dg
