// canvas_noise on the CPU: the obvious loop (C Philox calls per row), and the counter checks shared with
// gumbel_noise.
#include "../common/check.h"
#include "../common/philox.h"
#include "canvas_noise.h"

namespace dg {

Status check_noise_params(const NoiseParams& p, const char* op, bool check_values) {
  DG_CHECK_ARG(p.batch >= 0 && p.canvas_length >= 0, "%s: need batch >= 0 and canvas_length >= 0, got %lld, %lld", op,
               (long long)p.batch, (long long)p.canvas_length);
  DG_CHECK_ARG(p.vocab_size >= 1 && p.vocab_size <= 0xFFFFFFFFll, "%s: vocab_size must be in [1, 2^32), got %lld", op,
               (long long)p.vocab_size);
  DG_CHECK_ARG(p.canvas_length <= 0xFFFFFFFFll, "%s: canvas_length must be < 2^32, got %lld", op,
               (long long)p.canvas_length);
  if (!check_values) return Status::Ok();
  for (int64_t b = 0; b < p.batch; ++b) {
    DG_CHECK_ARG(p.blocks[b] >= 0 && p.blocks[b] <= 0xFFFFFFFFll, "%s: blocks[%lld] = %lld is outside [0, 2^32)", op,
                 (long long)b, (long long)p.blocks[b]);
    DG_CHECK_ARG(p.steps[b] >= 0 && p.steps[b] <= 0x7FFFFFFFll, "%s: steps[%lld] = %lld is outside [0, 2^31)", op,
                 (long long)b, (long long)p.steps[b]);
  }
  return Status::Ok();
}

Status canvas_noise_cpu(const NoiseParams& p, int64_t* out) {
  DG_RETURN_IF_ERROR(check_noise_params(p, "canvas_noise", /*check_values=*/true));
  for (int64_t b = 0; b < p.batch; ++b) {
    for (int64_t c = 0; c < p.canvas_length; ++c) {
      out[b * p.canvas_length + c] = canvas_token(p.seeds[b], p.blocks[b], p.steps[b], c, p.vocab_size);
    }
  }
  return Status::Ok();
}

}  // namespace dg
