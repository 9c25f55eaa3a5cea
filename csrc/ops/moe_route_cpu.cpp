// moe_route on the CPU: one token per iteration, tokens in parallel (OpenMP); each token is computed
// serially, so results do not depend on the thread count. Contract and exactness: moe_route.h.
#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "../common/check.h"
#include "../common/torch_sum.h"
#include "moe_route.h"

namespace dg {
namespace {

// torch's CPU topk works on (acc_type, index) pairs; acc_type<float> on CPU is double (no effect on order).
using Elem = std::pair<double, int64_t>;

// ATen TopKImpl.h, largest = true: "NaN sorts as the top for numpy compatibility".
bool topk_greater(const Elem& x, const Elem& y) {
  return (std::isnan(x.first) && !std::isnan(y.first)) || (x.first > y.first);
}

// Replays torch.topk(values, k, largest=True, sorted=True) on the CPU: same algorithms, same comparator.
void torch_cpu_topk(std::vector<Elem>& q, int64_t k) {
  const int64_t n = (int64_t)q.size();
  if (k * 64 <= n) {
    std::partial_sort(q.begin(), q.begin() + k, q.end(), topk_greater);
  } else {
    std::nth_element(q.begin(), q.begin() + k - 1, q.end(), topk_greater);
    std::sort(q.begin(), q.begin() + k - 1, topk_greater);
  }
}

template <class T>
float score(const MoeRouteParams& p, int64_t t, int64_t e) {
  return to_float(static_cast<const T*>(p.scores)[t * p.scores_row_stride + e]);
}

// softmax_fp32 of one row with libm expf and a sequential sum: p = exp(x - max) * (1 / sum), as torch's
// formula (max, exp, sum, reciprocal, scale) but not its vectorised exp and lane order.
template <class T>
void softmax_row(const MoeRouteParams& p, int64_t t, std::vector<float>& out) {
  float m = -INFINITY;
  bool nan = false;
  for (int64_t e = 0; e < p.experts; ++e) {
    const float v = score<T>(p, t, e);
    nan = nan || v != v;
    m = v > m ? v : m;
  }
  if (nan) m = NAN;
  float s = 0.0f;
  for (int64_t e = 0; e < p.experts; ++e) {
    out[e] = expf(score<T>(p, t, e) - m);
    s = s + out[e];
  }
  const float inv = 1.0f / s;
  for (int64_t e = 0; e < p.experts; ++e) out[e] = out[e] * inv;
}

template <class T, int W>
void route_tokens(const MoeRouteParams& p) {
  const int64_t E = p.experts, K = p.top_k;
#pragma omp parallel if (p.tokens * E >= 16384)
  {
    std::vector<Elem> q(E);
    std::vector<float> probs(E);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < p.tokens; ++t) {
      if (p.from_logits) softmax_row<T>(p, t, probs);
      for (int64_t e = 0; e < E; ++e) {
        q[e].first = p.from_logits ? probs[e] : score<T>(p, t, e);
        q[e].second = e;
      }
      torch_cpu_topk(q, K);
      // weights.sum(-1): torch's CPU sum order over the K selected values (float, as topk stores them)
      const float sum = torch_sum_detail::inner_sum<W>([&](int64_t k) { return (float)q[k].first; }, K);
      for (int64_t k = 0; k < K; ++k) {
        const float w = (float)q[k].first / sum;
        p.weights[t * K + k] = w * p.per_expert_scale[q[k].second];
        p.ids[t * K + k] = q[k].second;
      }
    }
  }
}

template <class T>
void dispatch_lanes(const MoeRouteParams& p) {
  if (p.sum_lanes == 16) {
    route_tokens<T, 16>(p);
  } else {
    route_tokens<T, 8>(p);
  }
}

}  // namespace

Status check_moe_route_params(const MoeRouteParams& p) {
  DG_CHECK_ARG(p.tokens >= 0 && p.experts >= 1, "moe_route: need tokens >= 0 and experts >= 1, got %lld, %lld",
               (long long)p.tokens, (long long)p.experts);
  DG_CHECK_ARG(p.top_k >= 1 && p.top_k <= p.experts, "moe_route: top_k must be in [1, experts=%lld], got %lld",
               (long long)p.experts, (long long)p.top_k);
  DG_CHECK_ARG(p.from_logits || p.scores_dtype == DType::kFloat32,
               "moe_route: probabilities (from_logits=false) must be float32");
  return Status::Ok();
}

Status moe_route_cpu(const MoeRouteParams& p) {
  DG_RETURN_IF_ERROR(check_moe_route_params(p));
  DG_CHECK_ARG(p.sum_lanes == 8 || p.sum_lanes == 16, "moe_route: sum_lanes must be 8 or 16, got %d", p.sum_lanes);
  if (p.scores_dtype == DType::kFloat32) {
    dispatch_lanes<float>(p);
  } else {
    dispatch_lanes<bf16>(p);
  }
  return Status::Ok();
}

}  // namespace dg
