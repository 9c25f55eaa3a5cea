// moe_align on the GPU (contract: moe_align.h): one 1024-thread block, everything on the device.
//
//  1. counts: shared-memory atomics per expert (the totals do not depend on the order of the adds).
//  2. padded offsets: a block-wide exclusive scan of round_up(count, block_size) (warp shuffles, then the
//     32 warp totals by warp 0); counts, offsets and the block -> expert map are written.
//  3. sentinel fill of sorted_pairs, then the pairs in chunks of 1024 (pair p = chunk·1024 + thread):
//     a pair's slot is offsets[e] + (pairs of expert e in earlier chunks) + (in earlier warps of this chunk)
//     + (in earlier lanes of its warp). The last term is popc(match_any(e) & lanemask_lt); the per-(warp,
//     expert) counts of the chunk are scanned over the 32 warps by one thread per expert, on top of a
//     running cursor. This is the stable order of the CPU op, without atomics on the outputs.
// Cost: ~P/1024 chunks of a few barriers each (2 for one 256-token canvas at top-8, 32 for 16 canvases).
#include <cuda_runtime.h>

#include "../common/check.h"
#include "moe_align.h"

namespace dg {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxE = (int)kMoeAlignMaxExpertsCuda;
constexpr unsigned kFull = 0xffffffffu;

__global__ void __launch_bounds__(kThreads) moe_align_kernel(MoeAlignParams p) {
  __shared__ int count[kMaxE];
  __shared__ int offset[kMaxE + 1];
  __shared__ int cursor[kMaxE];
  __shared__ int warp_count[kWarps][kMaxE];  // per chunk: pairs of expert e in warp w, then its prefix
  __shared__ int warp_total[kWarps];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int E = (int)p.experts, bs = (int)p.block_size;
  const int64_t P = p.pairs;
  for (int e = tid; e < E; e += kThreads) count[e] = 0;
  __syncthreads();
  for (int64_t i = tid; i < P; i += kThreads) {
    const int64_t e = p.ids[i];
    if (e >= 0 && e < E) atomicAdd(&count[e], 1);
  }
  __syncthreads();

  // exclusive scan of the padded counts (E <= 1024: one element per thread)
  const int padded = tid < E ? (count[tid] + bs - 1) / bs * bs : 0;
  int incl = padded;
  for (int off = 1; off < 32; off <<= 1) {
    const int v = __shfl_up_sync(kFull, incl, off);
    if (lane >= off) incl += v;
  }
  if (lane == 31) warp_total[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    int w = warp_total[lane];
    for (int off = 1; off < 32; off <<= 1) {
      const int v = __shfl_up_sync(kFull, w, off);
      if (lane >= off) w += v;
    }
    warp_total[lane] = w - warp_total[lane];  // exclusive prefix of the warp totals
  }
  __syncthreads();
  if (tid < E) {
    offset[tid] = warp_total[warp] + incl - padded;
    cursor[tid] = offset[tid];
    p.counts[tid] = count[tid];
    p.offsets[tid] = offset[tid];
  }
  if (tid == E - 1) {
    offset[E] = offset[tid] + padded;
    p.offsets[E] = offset[E];
  }
  __syncthreads();

  const int64_t cap = moe_align_capacity(P, E, bs), nblocks = cap / bs, total = offset[E];
  for (int64_t i = tid; i < cap; i += kThreads) p.sorted_pairs[i] = (int32_t)P;
  for (int64_t b = tid; b < nblocks; b += kThreads) {
    const int64_t start = b * bs;
    int lo = 0, hi = E;  // first e with offset[e + 1] > start
    while (lo < hi) {
      const int mid = (lo + hi) >> 1;
      if (offset[mid + 1] > start)
        hi = mid;
      else
        lo = mid + 1;
    }
    p.block_expert[b] = start < total ? lo : -1;
  }
  __syncthreads();  // the sentinel fill is visible before the pairs overwrite it

  for (int64_t base = 0; base < P; base += kThreads) {
    for (int i = tid; i < kWarps * kMaxE; i += kThreads) (&warp_count[0][0])[i] = 0;
    __syncthreads();
    const int64_t pair = base + tid;
    // range check on the int64 id BEFORE narrowing: an id >= 2^31 (or < 0) whose low 32 bits fall in [0, E)
    // must not alias a real expert and overrun its segment
    const int64_t id = pair < P ? p.ids[pair] : -1;
    const int e = (id >= 0 && id < E) ? (int)id : -1;
    const unsigned peers = __match_any_sync(kFull, e);
    const int rank = __popc(peers & ((1u << lane) - 1u));
    if (e >= 0 && rank == 0) warp_count[warp][e] = __popc(peers);
    __syncthreads();
    for (int x = tid; x < E; x += kThreads) {
      int run = cursor[x];
      for (int w = 0; w < kWarps; ++w) {
        const int c = warp_count[w][x];
        warp_count[w][x] = run;
        run += c;
      }
      cursor[x] = run;
    }
    __syncthreads();
    if (e >= 0) p.sorted_pairs[warp_count[warp][e] + rank] = (int32_t)pair;
    __syncthreads();  // warp_count is cleared by the next chunk
  }
}

}  // namespace

Status moe_align_cuda(const MoeAlignParams& p, void* stream) {
  DG_RETURN_IF_ERROR(check_moe_align_params(p));
  DG_CHECK_ARG(p.experts <= kMoeAlignMaxExpertsCuda, "moe_align: CUDA supports experts <= %lld, got %lld",
               (long long)kMoeAlignMaxExpertsCuda, (long long)p.experts);
  moe_align_kernel<<<1, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
  DG_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

}  // namespace dg
