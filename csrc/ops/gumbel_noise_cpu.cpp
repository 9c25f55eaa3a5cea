// gumbel_noise on the CPU: positions in parallel; each row uses the vectorised Philox + dg_logf of cpu_vec.h
// (the same bits as common/philox.h philox4x32_10 + gumbel_from_bits, on every CPU code path).
#include "../common/check.h"
#include "../common/philox.h"
#include "cpu_vec.h"
#include "gumbel_noise.h"

namespace dg {

Status gumbel_noise_cpu(const NoiseParams& p, float* out) {
  DG_RETURN_IF_ERROR(check_noise_params(p, "gumbel_noise", /*check_values=*/true));
  const int64_t C = p.canvas_length, V = p.vocab_size;
#pragma omp parallel for schedule(static) if (p.batch * C * V >= 65536)
  for (int64_t bc = 0; bc < p.batch * C; ++bc) {
    const int64_t b = bc / C;
    const uint32_t k0 = seed_key0(p.seeds[b]), k1 = seed_key1(p.seeds[b]);
    const uint32_t blk = (uint32_t)p.blocks[b], ctr3 = (uint32_t)(2 * p.steps[b] + 1), pos = (uint32_t)(bc % C);
    float* row = out + bc * V;
    run_vectorized([&]() DG_INLINE_LAMBDA {
      float g[128];
      for (int64_t v0 = 0; v0 < V; v0 += 128) {
        gumbel_x128((uint32_t)(v0 / 128), pos, blk, ctr3, k0, k1, g);
        const int64_t n = V - v0 < 128 ? V - v0 : 128;
        for (int64_t i = 0; i < n; ++i) row[v0 + i] = g[i];
      }
      return 0;
    });
  }
  return Status::Ok();
}

}  // namespace dg
