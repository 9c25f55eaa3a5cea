// nvfp4_moe_experts on the GPU: Marlin-style W4A16 grouped GEMMs with the weights as the MMA A operand ("swap-AB":
// output features are M, an expert's tokens are N), exact in-register FP4→bf16 decode (nvfp4_layout.h),
// mma.sync.m16n8k16 bf16 with fp32 accumulation. Contract in nvfp4_moe_experts.h; design in docs/kernels.md.
//
// Grid (static, graph-capturable): (row slabs of 128 rows × chunk splits Z, experts). A CTA whose expert has no
// slots in its chunks exits at once; otherwise it takes the expert's token chunks (NT·8 tokens each) z, z + Z,
// ... (the Z CTAs of a slab are adjacent in blockIdx.x: they run together, and the re-reads of the slab by hot
// experts' chunks hit L2 instead of HBM; Z depends on the token count only) and, per chunk, streams its 128-row
// weight slab through a kStages-deep cp.async pipeline of K-blocks (256 K): weights, scales and the gathered
// activation rows (GEMM1: x[pair / K], GEMM2: act[slot]) land in shared memory; each of the 8 warps owns 4 row
// tiles (64 rows) × one 64-K chunk of every K-block (2 row groups × 4 K-slices), decodes its fragments once per
// k-tile and reuses them for all NT token tiles. The 4 K-slices are summed through shared memory in a fixed tree
// ((s0 + s2) + (s1 + s3)), so results are bitwise deterministic; no atomics, no host sync, no allocation.
// Epilogues: GEMM1 gelu_tanh(acc_g·gs_g·2^7)·(acc_u·gs_u·2^7) → bf16 act[slot];
// GEMM2 (acc·gs_d·2^7)·w → y[pair].
// Plain CUDA, no torch headers (build.py --check-cuda compiles it alone).
#include <cuda_runtime.h>

#include <atomic>

#include "../common/activation.h"
#include "../common/check.h"
#include "moe_experts.h"  // moe_chunk_splits
#include "nvfp4_layout.h"
#include "nvfp4_moe_experts.h"

namespace dg {
namespace {

constexpr int kThreads = 256;              // 8 warps = 2 row groups × 4 K-slices
constexpr int kTilesPerWarp = 4;           // row tiles (16 rows) per warp
constexpr int kTilesPerCta = 8;            // 128 rows per CTA
constexpr int kBlockK = 256;               // K per pipeline stage = 4 chunks of 64, one per K-slice
constexpr int kStages = 3;
constexpr int kXStride = kBlockK + 8;      // bf16 per token row in shared memory (+16 B: conflict-free B loads)
constexpr int kWBytes = kTilesPerCta * 4 * 512;  // weights of one stage: 8 row tiles × 4 chunks × 512 B
constexpr int kSBytes = kTilesPerCta * 4 * 64;   // their scale bytes
constexpr int kMaxSplits = 8;                    // chunk splits per (slab, expert)

template <int NT>
struct Layout {
  static constexpr int kTokens = NT * 8;
  static constexpr int kXBytes = kTokens * kXStride * 2;
  static constexpr int kStageBytes = kWBytes + kSBytes + kXBytes;
  static constexpr int kAcc = kTilesPerWarp * NT * 4;              // fp32 accumulators per thread
  static constexpr int kRedBytes = 2 * 2 * 32 * kAcc * 4;          // 2 row groups × 2 partial slots
  static constexpr int kBytes = kStages * kStageBytes;
  static_assert(kRedBytes <= kBytes, "reduction buffer must fit in the pipeline buffers");
};

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

// 16-byte async copy global → shared; src_bytes 0 zero-fills the destination without reading
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void mma_bf16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ int64_t clamp64(int64_t v, int64_t lo, int64_t hi) { return v < lo ? lo : v > hi ? hi : v; }

template <int NT, bool kGemm1>
__global__ void __launch_bounds__(kThreads, 2) gemm_kernel(const Nvfp4MoeParams p, int nsplits) {
  using L = Layout<NT>;
  extern __shared__ __align__(16) unsigned char smem[];
  const int64_t e = blockIdx.y, pairs = p.tokens * p.top_k;
  const int64_t begin = clamp64(p.offsets[e], 0, p.slots);
  const int64_t end = clamp64(p.offsets[e + 1], begin, p.slots);
  const int split = (int)(blockIdx.x % nsplits);
  if (begin + (int64_t)split * L::kTokens >= end) return;
  const int64_t K = kGemm1 ? p.hidden : p.inter;
  const int64_t rt_n = (kGemm1 ? 2 * p.inter : p.hidden) / 16, kc_n = nvfp4_chunks(K);
  const uint32_t* W = (kGemm1 ? p.w13 : p.w2) + e * rt_n * kc_n * nvfp4::kWordsPerChunk;
  const uint8_t* S = (kGemm1 ? p.s13 : p.s2) + e * rt_n * kc_n * nvfp4::kScalesPerChunk;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int rg = warp >> 2, ks = warp & 3;
  const int64_t cta_rt = (int64_t)(blockIdx.x / nsplits) * kTilesPerCta;
  const int nkb = (int)((kc_n + 3) / 4);
  const uint16_t* xbase = kGemm1 ? static_cast<const uint16_t*>(p.x) : reinterpret_cast<const uint16_t*>(p.act);

  for (int64_t chunk = begin + (int64_t)split * L::kTokens; chunk < end; chunk += (int64_t)nsplits * L::kTokens) {
    const uint16_t* src[NT];  // this thread's token rows (its 16-byte column c16 of every K-block), or null
#pragma unroll
    for (int i = 0; i < NT; ++i) {
      const int64_t s = chunk + (tid >> 5) + 8 * i;
      const int64_t pair = s < end ? (int64_t)p.sorted_pairs[s] : -1;
      src[i] =
          (pair >= 0 && pair < pairs) ? xbase + (kGemm1 ? (pair / p.top_k) * p.x_row_stride : s * p.inter) : nullptr;
    }
    auto load_stage = [&](int kb) {
      unsigned char* st = smem + (kb % kStages) * L::kStageBytes;
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // weights: 1024 × 16 B; unit u → row tile u/128, chunk (u/32)%4, lane u%32
        const int u = tid + kThreads * i, rtl = u >> 7, c = (u >> 5) & 3;
        const int64_t rt = cta_rt + rtl, kc = (int64_t)kb * 4 + c;
        const bool ok = rt < rt_n && kc < kc_n;
        cp_async16(st + u * 16, ok ? W + (rt * kc_n + kc) * nvfp4::kWordsPerChunk + (u & 31) * 4 : W, ok);
      }
      if (tid < kSBytes / 16) {  // scales: 128 × 16 B; unit → row tile tid/16, chunk (tid/4)%4, quarter tid%4
        const int rtl = tid >> 4, c = (tid >> 2) & 3;
        const int64_t rt = cta_rt + rtl, kc = (int64_t)kb * 4 + c;
        const bool ok = rt < rt_n && kc < kc_n;
        cp_async16(st + kWBytes + tid * 16, ok ? S + (rt * kc_n + kc) * nvfp4::kScalesPerChunk + (tid & 3) * 16 : S,
                   ok);
      }
      uint16_t* xs = reinterpret_cast<uint16_t*>(st + kWBytes + kSBytes);
      const int c16 = tid & 31;
      const int64_t k = (int64_t)kb * kBlockK + c16 * 8;
#pragma unroll
      for (int i = 0; i < NT; ++i) {  // activations: NT·8 tokens × 32 × 16 B, zero past K and for empty slots
        const bool ok = src[i] != nullptr && k < K;
        cp_async16(xs + ((tid >> 5) + 8 * i) * kXStride + c16 * 8, ok ? src[i] + k : xbase, ok);
      }
    };

    float acc[kTilesPerWarp][NT][4];
#pragma unroll
    for (int r = 0; r < kTilesPerWarp; ++r)
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[r][n][c] = 0.0f;

    for (int s = 0; s < kStages - 1; ++s) {
      if (s < nkb) load_stage(s);
      cp_async_commit();
    }
    for (int kb = 0; kb < nkb; ++kb) {
      cp_async_wait<kStages - 2>();
      __syncthreads();  // stage kb landed for every thread; every warp is done with stage kb - 1
      if (kb + kStages - 1 < nkb) load_stage(kb + kStages - 1);
      cp_async_commit();
      if ((int64_t)kb * 4 + ks >= kc_n) continue;  // this K-slice is past K (warp-uniform)
      const unsigned char* st = smem + (kb % kStages) * L::kStageBytes;
      const uint16_t* xs = reinterpret_cast<const uint16_t*>(st + kWBytes + kSBytes) + ks * 64;
      uint4 wq[kTilesPerWarp];
      uint2 sq[kTilesPerWarp];
#pragma unroll
      for (int r = 0; r < kTilesPerWarp; ++r) {
        const int tile = (rg * kTilesPerWarp + r) * 4 + ks;
        wq[r] = *reinterpret_cast<const uint4*>(st + tile * 512 + lane * 16);
        sq[r] = *reinterpret_cast<const uint2*>(st + kWBytes + tile * 64 + 8 * g);
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {  // k-tiles of this 64-K chunk
        uint32_t b[NT][2];
#pragma unroll
        for (int n = 0; n < NT; ++n) {  // B fragment: (k 2t..2t+1 | 2t+8..2t+9, token n·8 + g)
          const uint16_t* row = xs + (n * 8 + g) * kXStride + 16 * j + 2 * t;
          b[n][0] = *reinterpret_cast<const uint32_t*>(row);
          b[n][1] = *reinterpret_cast<const uint32_t*>(row + 8);
        }
#pragma unroll
        for (int r = 0; r < kTilesPerWarp; ++r) {
          if (cta_rt + rg * kTilesPerWarp + r >= rt_n) continue;  // warp-uniform
          const uint32_t q = j == 0 ? wq[r].x : j == 1 ? wq[r].y : j == 2 ? wq[r].z : wq[r].w;
          uint32_t a[4];
          nvfp4::decode_fragment(q, sq[r].x, sq[r].y, j, a);
#pragma unroll
          for (int n = 0; n < NT; ++n) mma_bf16(acc[r][n], a, b[n][0], b[n][1]);
        }
      }
    }
    cp_async_wait<0>();
    __syncthreads();

    // fixed split-K tree: s0 += s2, s1 += s3; then s0 += s1 (slot layout [row group][slot][acc index][lane])
    float* red = reinterpret_cast<float*>(smem);
    auto slot = [&](int sl, int r, int n, int c) -> float& {
      return red[((rg * 2 + sl) * L::kAcc + (r * NT + n) * 4 + c) * 32 + lane];
    };
    auto for_acc = [&](auto f) {
#pragma unroll
      for (int r = 0; r < kTilesPerWarp; ++r)
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
          for (int c = 0; c < 4; ++c) f(r, n, c);
    };
    if (ks >= 2) for_acc([&](int r, int n, int c) { slot(ks - 2, r, n, c) = acc[r][n][c]; });
    __syncthreads();
    if (ks < 2) for_acc([&](int r, int n, int c) { acc[r][n][c] += slot(ks, r, n, c); });
    __syncthreads();
    if (ks == 1) for_acc([&](int r, int n, int c) { slot(0, r, n, c) = acc[r][n][c]; });
    __syncthreads();
    if (ks == 0) {
      for_acc([&](int r, int n, int c) { acc[r][n][c] += slot(0, r, n, c); });
      const float* gs = p.gs + 3 * e;
#pragma unroll
      for (int r = 0; r < kTilesPerWarp; ++r) {
        const int64_t rt = cta_rt + rg * kTilesPerWarp + r;
        if (rt >= rt_n) continue;
#pragma unroll
        for (int n = 0; n < NT; ++n) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {  // c[h]: (row g, token 2t + h); c[2 + h]: (row g + 8, token 2t + h)
            const int64_t s = chunk + n * 8 + 2 * t + h;
            const int64_t pair = s < end ? (int64_t)p.sorted_pairs[s] : -1;
            if (pair < 0 || pair >= pairs) continue;
            if constexpr (kGemm1) {  // rows g / g + 8 of tile rt are gate / up of feature 8·rt + g
              const float gv = acc[r][n][h] * (gs[0] * 128.0f), uv = acc[r][n][2 + h] * (gs[1] * 128.0f);
              p.act[s * p.inter + 8 * rt + g] = float_to_bf16(gelu_tanh(gv) * uv);
            } else {
              const float scale = gs[2] * 128.0f, w = p.topk_w[pair];
              float* yr = p.y + pair * p.hidden + 16 * rt + g;
              yr[0] = (acc[r][n][h] * scale) * w;
              yr[8] = (acc[r][n][2 + h] * scale) * w;
            }
          }
        }
      }
    }
    __syncthreads();  // shared memory is reused by the next token chunk
  }
}

// The dynamic shared memory opt-in of both kernels of one NT, set once per device (a function attribute holds
// for the device's context; setting it on every call cost a driver call per layer). Devices >= 64 set it always.
template <int NT>
Status set_smem_attribute_once(int bytes) {
  static std::atomic<uint64_t> done{0};  // bit d: set on device d
  int dev = 0;
  DG_CUDA_CHECK(cudaGetDevice(&dev));
  const uint64_t bit = dev >= 0 && dev < 64 ? (uint64_t)1 << dev : 0;
  if (bit != 0 && (done.load(std::memory_order_acquire) & bit) != 0) return Status::Ok();
  DG_CUDA_CHECK(cudaFuncSetAttribute(gemm_kernel<NT, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  DG_CUDA_CHECK(cudaFuncSetAttribute(gemm_kernel<NT, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  done.fetch_or(bit, std::memory_order_release);  // two threads racing here both set it: harmless
  return Status::Ok();
}

template <int NT>
Status launch(const Nvfp4MoeParams& p, cudaStream_t stream) {
  const int bytes = Layout<NT>::kBytes;
  const unsigned splits = (unsigned)moe_chunk_splits(p.tokens, Layout<NT>::kTokens, kMaxSplits);
  const dim3 grid1((unsigned)((2 * p.inter / 16 + kTilesPerCta - 1) / kTilesPerCta) * splits, (unsigned)p.experts);
  const dim3 grid2((unsigned)((p.hidden / 16 + kTilesPerCta - 1) / kTilesPerCta) * splits, (unsigned)p.experts);
  DG_RETURN_IF_ERROR(set_smem_attribute_once<NT>(bytes));
  gemm_kernel<NT, true><<<grid1, kThreads, bytes, stream>>>(p, (int)splits);
  DG_CUDA_CHECK(cudaGetLastError());
  gemm_kernel<NT, false><<<grid2, kThreads, bytes, stream>>>(p, (int)splits);
  DG_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

}  // namespace

Status nvfp4_moe_experts_cuda(const Nvfp4MoeParams& p, void* stream) {
  DG_RETURN_IF_ERROR(nvfp4_moe_check(p));
  DG_CHECK_ARG(p.x_dtype == DType::kBFloat16, "nvfp4_moe_experts: x must be bfloat16 on CUDA, got %s",
               dtype_name(p.x_dtype));
  DG_CHECK_ARG(p.x_row_stride % 8 == 0 && (uintptr_t)p.x % 16 == 0 && (uintptr_t)p.act % 16 == 0 &&
                   (uintptr_t)p.w13 % 16 == 0 && (uintptr_t)p.w2 % 16 == 0 && (uintptr_t)p.s13 % 16 == 0 &&
                   (uintptr_t)p.s2 % 16 == 0,
               "nvfp4_moe_experts: x, act, weights and scales need 16-byte aligned rows (x row stride %lld)",
               (long long)p.x_row_stride);
  DG_CHECK_ARG(p.experts <= 65535, "nvfp4_moe_experts: %lld experts exceed the CUDA grid", (long long)p.experts);
  if (p.tokens == 0 || p.slots == 0) return Status::Ok();
  // token chunk: 16 tokens when experts average <= 8 pairs (fewer idle MMAs), else 32; static per shape
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  return p.tokens * p.top_k <= 8 * p.experts ? launch<2>(p, s) : launch<4>(p, s);
}

}  // namespace dg
