// moe_experts on the CPU: the obvious loop, the mirror of the CUDA kernels' contract (moe_experts.h).
// Experts in parallel (OpenMP); every dot product is a sequential fp32 sum over k.
#include <math.h>

#include "../common/activation.h"
#include "../common/check.h"
#include "moe_experts.h"

namespace dg {
namespace {

template <class T>
float dot(const T* a, const T* b, int64_t n) {
  float acc = 0.0f;
  for (int64_t k = 0; k < n; ++k) acc = acc + to_float(a[k]) * to_float(b[k]);
  return acc;
}

template <class T>
void experts_loop(const MoeExpertsParams& p) {
  const int64_t H = p.hidden, I = p.inter, K = p.top_k;
  const T* x = static_cast<const T*>(p.x);
  const T* gate_up = static_cast<const T*>(p.gate_up);
  const T* down = static_cast<const T*>(p.down);
  T* act = static_cast<T*>(p.act);
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t e = 0; e < p.experts; ++e) {
    const T* gu = gate_up + e * 2 * I * H;
    const T* dn = down + e * H * I;
    for (int64_t i = 0; i < p.counts[e]; ++i) {
      const int64_t pos = p.offsets[e] + i;
      const int64_t pair = p.sorted_pairs[pos];
      const T* xt = x + (pair / K) * H;
      T* a = act + pos * I;
      for (int64_t f = 0; f < I; ++f) {
        const float g = round_to<T>(dot(xt, gu + f * H, H));
        const float u = round_to<T>(dot(xt, gu + (I + f) * H, H));
        a[f] = from_float<T>(round_to<T>(gelu_tanh(g)) * u);
      }
      for (int64_t h = 0; h < H; ++h) p.y[pair * H + h] = round_to<T>(dot(a, dn + h * I, I)) * p.weights[pair];
    }
  }
}

}  // namespace

Status check_moe_experts_params(const MoeExpertsParams& p) {
  DG_CHECK_ARG(p.tokens >= 0 && p.top_k >= 1 && p.experts >= 1 && p.hidden >= 1 && p.inter >= 1,
               "moe_experts: need tokens >= 0 and top_k, experts, hidden, inter >= 1, got %lld, %lld, %lld, "
               "%lld, %lld",
               (long long)p.tokens, (long long)p.top_k, (long long)p.experts, (long long)p.hidden, (long long)p.inter);
  DG_CHECK_ARG(p.capacity >= p.tokens * p.top_k && p.capacity < 0x7fffffffLL,
               "moe_experts: capacity %lld must be in [tokens * top_k, 2^31)", (long long)p.capacity);
  return Status::Ok();
}

Status moe_experts_cpu(const MoeExpertsParams& p) {
  DG_RETURN_IF_ERROR(check_moe_experts_params(p));
  const int64_t P = p.tokens * p.top_k;
  for (int64_t e = 0; e < p.experts; ++e) {  // the segments must lie inside the buffers
    DG_CHECK_ARG(p.counts[e] >= 0 && p.offsets[e] >= 0 && (int64_t)p.offsets[e] + p.counts[e] <= p.capacity,
                 "moe_experts: expert %lld's segment [%d, %d + %d) is outside [0, capacity)", (long long)e,
                 p.offsets[e], p.offsets[e], p.counts[e]);
    for (int64_t i = 0; i < p.counts[e]; ++i) {
      const int32_t pair = p.sorted_pairs[p.offsets[e] + i];
      DG_CHECK_ARG(pair >= 0 && pair < P, "moe_experts: sorted_pairs[%lld] = %d is not a pair index",
                   (long long)(p.offsets[e] + i), pair);
    }
  }
  if (p.dtype == DType::kFloat32) {
    experts_loop<float>(p);
  } else {
    experts_loop<bf16>(p);
  }
  return Status::Ok();
}

}  // namespace dg
