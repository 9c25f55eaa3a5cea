// moe_experts on the GPU, bf16 (contract: moe_experts.h; design: docs/kernels.md, "Grouped expert GEMMs (Hopper
// design)", swap-AB).
//
// Both GEMMs are expert-major: grid (row tiles × chunk splits, experts), 4 warps per block, each block reads
// counts[e] and offsets[e] from device memory and leaves when the expert has no pairs, or none in its chunks
// (no host sync, static grid for CUDA graphs: the split count Z depends on the token count only). A warp owns
// 32 weight rows (two m16 tiles) and takes its expert's 32-token chunks z, z + Z, z + 2Z, ... (four n8 tiles;
// a partial chunk issues only the tiles it needs), streaming the K dimension in slabs of 32:
//   weights (A, row-major [rows, K]): lane (g = lane/4, t = lane%4) loads 16 bytes of rows g and g+8 at
//     k = 8t..8t+7 (a warp reads 8 rows × 64 contiguous bytes per tile: full 32-byte sectors);
//   tokens  (B, row-major [tokens, K]): the same lane loads 16 bytes of token g at k = 8t..8t+7.
// Using the same K permutation for A and B keeps the dot products exact: for k-step s of the slab, the
// m16n8k16 fragments' logical k {2t, 2t+1} map to physical 8t+4s+{0,1} and {2t+8, 2t+9} to 8t+4s+{2,3}.
// One slab is prefetched into registers while the current one feeds the tensor cores (fp32 accumulate).
//
// GEMM1 (grid ceil(inter/64) × experts): warp rows = gate features f..f+15 and up features f..f+15, so each
//   thread holds gate and up of the same (feature, token) and applies a = rnd(rnd(gelu(rnd(g))) · rnd(u)) in
//   its epilogue; act rows are the pairs' sorted positions. Tokens are gathered from x[pair / top_k].
// GEMM2 (grid ceil(hidden/128) × experts): warp rows = 32 output features of down[e]; tokens are act rows
//   (contiguous); epilogue y[pair, h] = f32(rnd(acc)) · weights[pair].
// Each weight byte is read once per 32-pair chunk: once in total for experts with <= 32 pairs (one canvas:
// 16 on average, read with evict-first loads). Hotter experts (16 canvases: 256 pairs on average) re-read
// their slice once per chunk; the Z splits of a row tile are adjacent in blockIdx.x, so those re-reads run
// concurrently on neighbouring SMs and hit L2 (normal-priority loads), instead of one block walking the
// chunks one after another and streaming the slice from HBM each time.
// Tunables: rows per warp (32), warps per block (4), chunk (32), slab (32), prefetch depth (1).
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "../common/activation.h"
#include "../common/check.h"
#include "../common/dtype.h"
#include "moe_experts.h"

namespace dg {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kChunk = 32;            // tokens per pass
constexpr int kNT = kChunk / 8;       // n8 tiles per pass
constexpr int kSlab = 32;             // K per iteration (two k16 steps)
constexpr int kGemm1Features = 16 * kWarps;   // gate/up features per block
constexpr int kGemm2Rows = 32 * kWarps;       // output rows per block
constexpr int kMaxSplits = 8;                 // chunk splits per (row tile, expert): 8 × 32 = 256 pairs at once

// read once (the expert's pairs fit one chunk): evict-first; re-read by the sibling blocks: normal, to hit L2
__device__ __forceinline__ uint4 load_weights(const uint16_t* p, bool once) {
  return once ? __ldcs(reinterpret_cast<const uint4*>(p)) : __ldg(reinterpret_cast<const uint4*>(p));
}
__device__ __forceinline__ uint4 load_tokens(const uint16_t* p) {   // reused by the block's warps: via L1
  return __ldg(reinterpret_cast<const uint4*>(p));
}

__device__ __forceinline__ void mma_bf16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// Word w (0..3) of a 16-byte load.
__device__ __forceinline__ uint32_t word(const uint4& v, int w) {
  return w == 0 ? v.x : w == 1 ? v.y : w == 2 ? v.z : v.w;
}

// Registers of one slab: two m16 tiles (rows g and g+8 each) and up to kNT token tiles.
struct Slab {
  uint4 a[2][2];
  uint4 b[kNT];
};

// A warp's view of one pass: its 32 weight rows (2 tiles × rows g, g+8) and its chunk's token rows.
struct Pass {
  const uint16_t* a_row[2][2];
  const uint16_t* b_row[kNT];  // nullptr: no token (past the expert's count)
  int ntiles;
  int64_t K;
  bool once;  // the expert's weights are read by this pass only (count <= kChunk)
};

__device__ __forceinline__ void load_slab(const Pass& ps, int64_t k0, int t, Slab& s) {
  const int64_t k = k0 + 8 * t;
  const bool kv = k < ps.K;  // K % 8 == 0: a lane's 8 elements are all in range or all out
  const uint4 zero = make_uint4(0, 0, 0, 0);
#pragma unroll
  for (int m = 0; m < 2; ++m) {
#pragma unroll
    for (int h = 0; h < 2; ++h) s.a[m][h] = kv ? load_weights(ps.a_row[m][h] + k, ps.once) : zero;
  }
#pragma unroll
  for (int j = 0; j < kNT; ++j) {
    s.b[j] = (j < ps.ntiles && kv && ps.b_row[j] != nullptr) ? load_tokens(ps.b_row[j] + k) : zero;
  }
}

__device__ __forceinline__ void mma_slab(const Pass& ps, const Slab& s, float acc[2][kNT][4]) {
#pragma unroll
  for (int step = 0; step < 2; ++step) {
    uint32_t a[2][4];
#pragma unroll
    for (int m = 0; m < 2; ++m) {
      a[m][0] = word(s.a[m][0], 2 * step);
      a[m][1] = word(s.a[m][1], 2 * step);
      a[m][2] = word(s.a[m][0], 2 * step + 1);
      a[m][3] = word(s.a[m][1], 2 * step + 1);
    }
#pragma unroll
    for (int j = 0; j < kNT; ++j) {
      if (j < ps.ntiles) {  // warp-uniform
        const uint32_t b0 = word(s.b[j], 2 * step), b1 = word(s.b[j], 2 * step + 1);
        mma_bf16(acc[0][j], a[0], b0, b1);
        mma_bf16(acc[1][j], a[1], b0, b1);
      }
    }
  }
}

// acc[m][j][r] for rows (tile m, half r/2) and tokens (tile j, column 2t + r%2), over the full K.
__device__ __forceinline__ void run_pass(const Pass& ps, int t, float acc[2][kNT][4]) {
#pragma unroll
  for (int m = 0; m < 2; ++m)
#pragma unroll
    for (int j = 0; j < kNT; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[m][j][r] = 0.0f;
  Slab cur, nxt;
  load_slab(ps, 0, t, cur);
  for (int64_t k0 = 0; k0 < ps.K; k0 += kSlab) {
    if (k0 + kSlab < ps.K) load_slab(ps, k0 + kSlab, t, nxt);
    mma_slab(ps, cur, acc);
    cur = nxt;
  }
}

__device__ __forceinline__ float round_bf16(float v) { return to_float(float_to_bf16(v)); }

__global__ void __launch_bounds__(kThreads) moe_gemm1_kernel(MoeExpertsParams p, int nsplits) {
  const int e = blockIdx.y;
  const int count = p.counts[e];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int64_t H = p.hidden, I = p.inter;
  const int splits = nsplits, split = (int)(blockIdx.x % nsplits);  // the splits of a tile are adjacent
  const int64_t f0 = (int64_t)(blockIdx.x / splits) * kGemm1Features + warp * 16;
  if (count <= split * kChunk || f0 >= I) return;  // whole warps leave; no block barriers below
  const int64_t base = p.offsets[e];
  const uint16_t* W = static_cast<const uint16_t*>(p.gate_up) + (int64_t)e * 2 * I * H;
  const uint16_t* x = static_cast<const uint16_t*>(p.x);
  uint16_t* act = static_cast<uint16_t*>(p.act);
  Pass ps;
  ps.K = H;
  ps.once = count <= kChunk;
  for (int h = 0; h < 2; ++h) {  // rows past inter read a valid row; their results are never stored
    const int64_t f = f0 + g + 8 * h < I ? f0 + g + 8 * h : I - 1;
    ps.a_row[0][h] = W + f * H;          // gate
    ps.a_row[1][h] = W + (I + f) * H;    // up
  }
  for (int c0 = split * kChunk; c0 < count; c0 += splits * kChunk) {
    ps.ntiles = (min(kChunk, count - c0) + 7) / 8;
#pragma unroll
    for (int j = 0; j < kNT; ++j) {
      const int i = c0 + 8 * j + g;
      ps.b_row[j] = i < count ? x + (int64_t)(p.sorted_pairs[base + i] / p.top_k) * H : nullptr;
    }
    float acc[2][kNT][4];
    run_pass(ps, t, acc);
#pragma unroll
    for (int j = 0; j < kNT; ++j) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int64_t f = f0 + g + 8 * (r >> 1);
        const int i = c0 + 8 * j + 2 * t + (r & 1);
        if (j < ps.ntiles && f < I && i < count) {
          const float gate = round_bf16(acc[0][j][r]), up = round_bf16(acc[1][j][r]);
          act[(base + i) * I + f] = float_to_bf16(__fmul_rn(round_bf16(gelu_tanh(gate)), up)).bits;
        }
      }
    }
  }
}

__global__ void __launch_bounds__(kThreads) moe_gemm2_kernel(MoeExpertsParams p, int nsplits) {
  const int e = blockIdx.y;
  const int count = p.counts[e];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int64_t H = p.hidden, I = p.inter;
  const int splits = nsplits, split = (int)(blockIdx.x % nsplits);
  const int64_t h0 = (int64_t)(blockIdx.x / splits) * kGemm2Rows + warp * 32;
  if (count <= split * kChunk || h0 >= H) return;
  const int64_t base = p.offsets[e];
  const uint16_t* W = static_cast<const uint16_t*>(p.down) + (int64_t)e * H * I;
  const uint16_t* act = static_cast<const uint16_t*>(p.act);
  Pass ps;
  ps.K = I;
  ps.once = count <= kChunk;
  for (int m = 0; m < 2; ++m)
    for (int h = 0; h < 2; ++h) {
      const int64_t row = h0 + 16 * m + g + 8 * h;
      ps.a_row[m][h] = W + (row < H ? row : H - 1) * I;
    }
  for (int c0 = split * kChunk; c0 < count; c0 += splits * kChunk) {
    ps.ntiles = (min(kChunk, count - c0) + 7) / 8;
#pragma unroll
    for (int j = 0; j < kNT; ++j) {
      const int i = c0 + 8 * j + g;
      ps.b_row[j] = i < count ? act + (base + i) * I : nullptr;
    }
    float acc[2][kNT][4];
    run_pass(ps, t, acc);
#pragma unroll
    for (int j = 0; j < kNT; ++j) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int i = c0 + 8 * j + 2 * t + (r & 1);
        if (j >= ps.ntiles || i >= count) continue;
        const int64_t pair = p.sorted_pairs[base + i];
        const float w = p.weights[pair];
#pragma unroll
        for (int m = 0; m < 2; ++m) {
          const int64_t h = h0 + 16 * m + g + 8 * (r >> 1);
          if (h < H) p.y[pair * H + h] = __fmul_rn(round_bf16(acc[m][j][r]), w);
        }
      }
    }
  }
}

}  // namespace

Status moe_experts_cuda(const MoeExpertsParams& p, void* stream) {
  DG_RETURN_IF_ERROR(check_moe_experts_params(p));
  DG_CHECK_ARG(p.dtype == DType::kBFloat16, "moe_experts: the CUDA kernels take bfloat16, got %s", dtype_name(p.dtype));
  DG_CHECK_ARG(p.hidden % 8 == 0 && p.inter % 8 == 0,
               "moe_experts: CUDA needs hidden %% 8 == 0 and inter %% 8 == 0, got %lld, %lld", (long long)p.hidden,
               (long long)p.inter);
  for (const void* ptr : {p.x, p.gate_up, p.down, (const void*)p.act}) {
    DG_CHECK_ARG(((uintptr_t)ptr & 15u) == 0, "moe_experts: CUDA needs 16-byte aligned x, gate_up, down, act");
  }
  DG_CHECK_ARG(p.experts <= 65535, "moe_experts: experts=%lld exceeds the CUDA grid", (long long)p.experts);
  if (p.tokens == 0) return Status::Ok();
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  // An expert gets at most `tokens` pairs from a top-k without repeats; more (repeated ids) are still
  // covered: each block strides over the chunks.
  const unsigned splits = (unsigned)moe_chunk_splits(p.tokens, kChunk, kMaxSplits);
  const dim3 grid1((unsigned)((p.inter + kGemm1Features - 1) / kGemm1Features) * splits, (unsigned)p.experts);
  moe_gemm1_kernel<<<grid1, kThreads, 0, s>>>(p, (int)splits);
  DG_CUDA_CHECK(cudaGetLastError());
  const dim3 grid2((unsigned)((p.hidden + kGemm2Rows - 1) / kGemm2Rows) * splits, (unsigned)p.experts);
  moe_gemm2_kernel<<<grid2, kThreads, 0, s>>>(p, (int)splits);
  DG_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

}  // namespace dg
