// moe_combine on the CPU: the obvious loop, tokens in parallel (contract: moe_combine.h).
#include "../common/check.h"
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
    for (int64_t h = 0; h < H; ++h) {
      float acc = wt != nullptr ? yt[h] * wt[0] : yt[h];
      for (int64_t k = 1; k < K; ++k) acc = acc + (wt != nullptr ? yt[k * H + h] * wt[k] : yt[k * H + h]);
      ot[h] = from_float<T>(acc);
    }
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
