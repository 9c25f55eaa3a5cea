// moe_combine on the CPU: the obvious loop, tokens in parallel, each token in the CPU's widest build (cpu_vec.h)
// (contract: moe_combine.h).
#include "../common/check.h"
#include "cpu_vec.h"
#include "moe_combine.h"

namespace dg {
namespace {

template <class T>
void combine_tokens(const MoeCombineParams& p) {
  const int64_t K = p.top_k, H = p.hidden;
  T* out = static_cast<T*>(p.out);
#pragma omp parallel for schedule(static) if (p.tokens * K * H >= 65536)
  for (int64_t t = 0; t < p.tokens; ++t) {
    const float* yt = p.y + t * K * H;
    const float* wt = p.weights != nullptr ? p.weights + t * K : nullptr;
    T* ot = out + t * H;
    // h in chunks, k outer within a chunk (each loop over h vectorises), in the CPU's widest build: every element
    // is still acc = y_0·w_0, then acc + y_k·w_k for k = 1 .. K-1, the same IEEE operations in every lane
    run_vectorized([&]() DG_INLINE_LAMBDA {
      constexpr int64_t kChunk = 256;
      float acc[kChunk];
      for (int64_t h0 = 0; h0 < H; h0 += kChunk) {
        const int64_t n = H - h0 < kChunk ? H - h0 : kChunk;
        const float* y0 = yt + h0;
        if (wt != nullptr) {
          for (int64_t i = 0; i < n; ++i) acc[i] = y0[i] * wt[0];
          for (int64_t k = 1; k < K; ++k) {
            const float* yk = y0 + k * H;
            const float wk = wt[k];
            for (int64_t i = 0; i < n; ++i) acc[i] = acc[i] + yk[i] * wk;
          }
        } else {
          for (int64_t i = 0; i < n; ++i) acc[i] = y0[i];
          for (int64_t k = 1; k < K; ++k) {
            const float* yk = y0 + k * H;
            for (int64_t i = 0; i < n; ++i) acc[i] = acc[i] + yk[i];
          }
        }
        for (int64_t i = 0; i < n; ++i) ot[h0 + i] = from_float<T>(acc[i]);
      }
      return 0;
    });
  }
}

}  // namespace

Status check_moe_combine_params(const MoeCombineParams& p) {
  DG_CHECK_ARG(p.tokens >= 0 && p.top_k >= 1 && p.hidden >= 0,
               "moe_combine: need tokens >= 0, top_k >= 1, hidden >= 0, got %lld, %lld, %lld", (long long)p.tokens,
               (long long)p.top_k, (long long)p.hidden);
  return Status::Ok();
}

Status moe_combine_cpu(const MoeCombineParams& p) {
  DG_RETURN_IF_ERROR(check_moe_combine_params(p));
  if (p.out_dtype == DType::kFloat32) {
    combine_tokens<float>(p);
  } else {
    combine_tokens<bf16>(p);
  }
  return Status::Ok();
}

}  // namespace dg
