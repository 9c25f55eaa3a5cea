// moe_align on the CPU: a serial counting sort (contract: moe_align.h).
#include <vector>

#include "../common/check.h"
#include "moe_align.h"

namespace dg {

Status check_moe_align_params(const MoeAlignParams& p) {
  DG_CHECK_ARG(p.pairs >= 0 && p.experts >= 1 && p.block_size >= 1,
               "moe_align: need pairs >= 0, experts >= 1, block_size >= 1, got %lld, %lld, %lld", (long long)p.pairs,
               (long long)p.experts, (long long)p.block_size);
  DG_CHECK_ARG(moe_align_capacity(p.pairs, p.experts, p.block_size) < 0x7fffffffLL,
               "moe_align: pairs + experts * (block_size - 1) = %lld does not fit int32",
               (long long)moe_align_capacity(p.pairs, p.experts, p.block_size));
  return Status::Ok();
}

Status moe_align_cpu(const MoeAlignParams& p) {
  DG_RETURN_IF_ERROR(check_moe_align_params(p));
  const int64_t E = p.experts, bs = p.block_size, P = p.pairs;
  const int64_t cap = moe_align_capacity(P, E, bs);
  for (int64_t i = 0; i < P; ++i) {
    DG_CHECK_ARG(p.ids[i] >= 0 && p.ids[i] < E, "moe_align: ids[%lld] = %lld is not in [0, %lld)", (long long)i,
                 (long long)p.ids[i], (long long)E);
  }
  std::vector<int64_t> count(E, 0), cursor(E);
  for (int64_t i = 0; i < P; ++i) ++count[p.ids[i]];
  int64_t off = 0;
  for (int64_t e = 0; e < E; ++e) {
    p.counts[e] = (int32_t)count[e];
    p.offsets[e] = (int32_t)off;
    cursor[e] = off;
    off += (count[e] + bs - 1) / bs * bs;
  }
  p.offsets[E] = (int32_t)off;
  for (int64_t i = 0; i < cap; ++i) p.sorted_pairs[i] = (int32_t)P;
  for (int64_t i = 0; i < P; ++i) p.sorted_pairs[cursor[p.ids[i]]++] = (int32_t)i;  // ascending: stable
  int64_t e = 0;
  for (int64_t b = 0; b < cap / bs; ++b) {
    const int64_t start = b * bs;
    while (e < E && p.offsets[e + 1] <= start) ++e;
    p.block_expert[b] = start < off ? (int32_t)e : -1;
  }
  return Status::Ok();
}

}  // namespace dg
