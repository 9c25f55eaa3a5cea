// Test hooks over common/philox.h (see noise_hooks.h).
#include "../common/check.h"
#include "../common/philox.h"
#include "cpu_vec.h"
#include "noise_hooks.h"

namespace dg {

Status philox_hook(const int64_t* ctr, const int64_t* key, int64_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t* c = ctr + 4 * i;
    const Philox4 o = philox4x32_10((uint32_t)c[0], (uint32_t)c[1], (uint32_t)c[2], (uint32_t)c[3],
                                    (uint32_t)key[2 * i], (uint32_t)key[2 * i + 1]);
    for (int j = 0; j < 4; ++j) out[4 * i + j] = (int64_t)o.v[j];
  }
  return Status::Ok();
}

Status dg_logf_hook(const float* x, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = dg_logf(x[i]);
  return Status::Ok();
}

// out[i] = f(r[i]) for uint32 words r (the gumbel and gumbel_bound hooks)
template <class F>
Status from_words(const char* op, const int64_t* r, float* out, int64_t n, const F& f) {
  for (int64_t i = 0; i < n; ++i) {
    DG_CHECK_ARG(r[i] >= 0 && r[i] <= 0xFFFFFFFFll, "%s: r[%lld] = %lld is not a uint32", op, (long long)i,
                 (long long)r[i]);
    out[i] = f((uint32_t)r[i]);
  }
  return Status::Ok();
}

Status gumbel_hook(const int64_t* r, float* out, int64_t n) {
  return from_words("gumbel", r, out, n, [](uint32_t w) { return gumbel_from_bits(w); });
}

Status gumbel_bound_hook(const int64_t* r, float* out, int64_t n) {
  return from_words("gumbel_bound", r, out, n, [](uint32_t w) { return gumbel_upper_bound(w); });
}

int set_cpu_level(int level) {
  cpu_level_override().store(level < 0 ? -1 : level);
  return cpu_level();
}

int get_cpu_level() { return cpu_level(); }

}  // namespace dg
