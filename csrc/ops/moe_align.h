// moe_align: group token-expert pairs by expert, each expert's segment padded to block_size (the contract
// of ops.reference.moe_align; vLLM's moe_align_block_size with a stable order).
//
//   ids:          [pairs] int64, pair p = t * top_k + k, values in [0, experts)
// Outputs (preallocated, every element written):
//   counts:       [experts] int32                 pairs routed to expert e
//   offsets:      [experts + 1] int32             offsets[0] = 0, offsets[e+1] = offsets[e] + round_up(counts[e],
//                                                 block_size); offsets[experts] = padded total
//   sorted_pairs: [capacity] int32                capacity = pairs + experts * (block_size - 1); expert e's pairs
//                                                 at offsets[e] .. offsets[e] + counts[e] - 1 in ascending pair
//                                                 order (stable); the sentinel `pairs` everywhere else
//   block_expert: [capacity / block_size] int32   expert owning block b (rows b*bs .. b*bs+bs-1); -1 past the
//                                                 padded total
//
// Bit-identical to the reference on every device (integer only; the order within an expert is fixed).
// CPU: counting sort, serial (pairs is at most a few tens of thousands).
// CUDA: one 1024-thread block, no host sync, no atomics on outputs: shared-memory counts, a block scan of
// the padded counts, then the pairs in chunks of 1024: each pair's rank among equal experts in its warp
// (__match_any_sync) plus a per-(warp, expert) prefix carried across chunks gives its stable slot.
// experts <= 256 on CUDA; ids outside [0, experts) are not counted and not placed there (the CPU op
// returns InvalidArgument).
#pragma once

#include <stdint.h>

#include "../common/philox.h"  // DG_HD
#include "../common/status.h"

namespace dg {

struct MoeAlignParams {
  const int64_t* ids;       // [pairs]
  int32_t* counts;          // [experts]
  int32_t* offsets;         // [experts + 1]
  int32_t* sorted_pairs;    // [capacity]
  int32_t* block_expert;    // [capacity / block_size]
  int64_t pairs;
  int64_t experts;
  int64_t block_size;
};

constexpr int64_t kMoeAlignMaxExpertsCuda = 256;

DG_HD int64_t moe_align_capacity(int64_t pairs, int64_t experts, int64_t block_size) {
  return pairs + experts * (block_size - 1);
}

Status check_moe_align_params(const MoeAlignParams& p);
Status moe_align_cpu(const MoeAlignParams& p);
Status moe_align_cuda(const MoeAlignParams& p, void* stream);  // compiled only with CUDA

}  // namespace dg
