// Test hooks over the shared noise routines of common/philox.h (not ops: bound as _C.philox4x32_10,
// _C.dg_logf, _C.gumbel and _C.gumbel_bound so tests can check the C++ Philox against the known answers of
// docs/seeded-noise.md and dg_logf / the Gumbel transform against correctly rounded values).
//
//   philox_hook:  ctr [n, 4] int64 (uint32 values), key [n, 2] int64 (uint32 values) -> out [n, 4] int64
//   dg_logf_hook: x [n] fp32 -> out [n] fp32 = dg_logf(x)
//   gumbel_hook:  r [n] int64 (uint32 values) -> out [n] fp32 = gumbel_from_bits(r)
//   gumbel_bound_hook: r [n] int64 (uint32 values) -> out [n] fp32 = gumbel_upper_bound(r)
#pragma once

#include <stdint.h>

#include "../common/status.h"

namespace dg {

Status philox_hook(const int64_t* ctr, const int64_t* key, int64_t* out, int64_t n);
Status dg_logf_hook(const float* x, float* out, int64_t n);
Status gumbel_hook(const int64_t* r, float* out, int64_t n);
Status gumbel_bound_hook(const int64_t* r, float* out, int64_t n);

// The CPU code path of the vectorised loops (cpu_vec.h): 0 baseline, 1 AVX2+FMA, 2 AVX-512. set_cpu_level(-1)
// restores the automatic choice; a level above what the CPU has is capped. Returns the level now in use.
int set_cpu_level(int level);
int get_cpu_level();

}  // namespace dg
