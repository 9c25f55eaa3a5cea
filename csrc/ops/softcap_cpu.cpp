// softcap on the CPU: chunks in parallel, each one loop the compiler vectorises (cpu_vec.h picks the build).
// tanh_fixed uses only IEEE operations and explicit fmas (correctly rounded in every build), so every lane and the
// scalar tail compute the same bits (softcap.h).
#include "../common/check.h"
#include "cpu_vec.h"
#include "softcap.h"

namespace dg {

Status softcap_cpu(const SoftcapParams& p) {
  DG_CHECK_ARG(p.n >= 0, "softcap: size must be >= 0, got %lld", (long long)p.n);
  DG_CHECK_ARG(p.cap > 0.0f, "softcap: cap must be > 0, got %g", (double)p.cap);
  constexpr int64_t kChunk = 1 << 14;
  const int64_t chunks = (p.n + kChunk - 1) / kChunk;
  float* x = p.x;
  const float cap = p.cap;
#pragma omp parallel for schedule(static) if (p.n >= 4 * kChunk)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t i0 = c * kChunk, i1 = i0 + kChunk < p.n ? i0 + kChunk : p.n;
    run_vectorized([&]() DG_INLINE_LAMBDA {
      for (int64_t i = i0; i < i1; ++i) x[i] = tanh_fixed(x[i] / cap) * cap;
      return 0;
    });
  }
  return Status::Ok();
}

}  // namespace dg
