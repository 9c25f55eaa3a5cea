// diffusion_step on the GPU (contract: diffusion_step.h). Plain CUDA, no torch headers; sm_80 and newer.
//
// Kernel 1, position_kernel: one 256-thread block per position (b, c), grid B*C. The row is streamed once:
// each thread takes groups of 4 vocabulary entries (one Philox call per group, as the contract's counter
// (v/4, c, block, 2k+1) does), so a warp reads 512 contiguous bytes per step (float4 / 8-byte bf16x4 loads
// when the row is aligned). Per element: y = x / T (IEEE __fdiv_rn), store processed, running argmax of y and
// of z = y + gumbel (dg_logf, shared with the CPU), and an online entropy state (m, s, t) with
// s = sum exp(y - m), t = sum exp(y - m)(y - m) in double, rescaled when m grows. The block then reduces
// the argmaxes (warp shuffles; ties to the lowest index, a NaN beats everything as in torch.argmax) and the
// entropy states, and thread 0 writes argmax, the sample (into canvas) and H = log(s) - t/s. The kernel is
// memory bound (one read of logits, one write of processed); the Philox + 2 logs per element are hidden
// behind the loads on Hopper.
//
// The exact Gumbel skip: a group's Philox call and logs are skipped when every y of the group satisfies
// f32(y + kGumbelMax) < the thread's running best z. Gumbel noise is <= kGumbelMax and rounding is monotone,
// so z = f32(y + g) <= f32(y + kGumbelMax) < best: such an element can never win (nor tie) the race, and the
// sample is bit-identical to computing every z (a NaN y or best makes the comparison false: computed).
//
// Kernel 2, accept_kernel: one 256-thread block per canvas, positions strided over the threads (any C whose
// 16·C bytes of shared memory fit the 48 KB default, kDiffusionStepMaxCanvasCuda; ops.diffusion_step falls
// back to the reference beyond). Stable rank sort of the C entropies in shared memory (O(C^2 / 256) compares
// per thread; NaN last, ties by position), a sequential fp64 prefix sum by one thread (the contract's order:
// each prefix rounded to fp32), then each rank's acceptance and renoise; thread 0 writes the mean entropy in
// torch's CPU sum order, its vector lanes summed by one thread each (torch_sum_lane; at __launch_bounds__(1024)
// one thread held all 16 × 16 lane accumulators in 64 registers: a 5.4 KB spill; now nothing spills).
//
// No host synchronisation and no allocation: both kernels are queued on the caller's stream.
#include <cuda_runtime.h>

#include "../common/check.h"
#include "../common/dtype.h"
#include "../common/entropy.h"
#include "../common/philox.h"
#include "../common/torch_sum.h"
#include "diffusion_step.h"

namespace dg {
namespace {

constexpr int kThreads = 256;
constexpr int kAcceptThreads = 256;
constexpr int kMaxCanvas = (int)kDiffusionStepMaxCanvasCuda;  // accept_kernel: 16 B of shared memory each
constexpr int kLaneSlots = 16;  // torch_sum lanes (at most 16) summed by warp 1
static_assert(kMaxCanvas * (3 * sizeof(float) + sizeof(int)) + kLaneSlots * sizeof(float) <= 48 * 1024,
              "accept_kernel: dynamic + static shared memory within the default 48 KB");

// ---- argmax pairs -----------------------------------------------------------------------------------------

struct ArgMax {
  float value;
  int64_t index;  // INT64_MAX: empty
};

// torch.argmax's order: NaN beats everything (the lowest-index NaN), then the larger value, then the lower index.
__device__ __forceinline__ ArgMax better(const ArgMax& a, const ArgMax& b) {
  const bool an = a.value != a.value, bn = b.value != b.value;
  if (an || bn) {
    if (an && bn) return a.index < b.index ? a : b;
    return an ? a : b;
  }
  if (a.value > b.value) return a;
  if (b.value > a.value) return b;
  return a.index < b.index ? a : b;
}

__device__ __forceinline__ ArgMax shfl_xor(const ArgMax& a, int off) {
  return ArgMax{__shfl_xor_sync(0xffffffffu, a.value, off), __shfl_xor_sync(0xffffffffu, a.index, off)};
}

// ---- online entropy state -----------------------------------------------------------------------------------

struct EntropyState {
  float m;   // running max (-inf: empty)
  double s;  // sum exp(y - m)
  double t;  // sum exp(y - m) * (y - m)
};

__device__ __forceinline__ void entropy_add(EntropyState& st, float y) {
  if (y > st.m) {  // rescale to the new max; exp of a non-positive double
    if (st.s > 0.0) {
      const double shift = (double)st.m - (double)y;  // < 0
      const double alpha = exp(shift);
      st.t = alpha * (st.t + st.s * shift);
      st.s = alpha * st.s;
    }
    st.m = y;
  }
  const float d = __fsub_rn(y, st.m);
  const float e = exp_nonpositive(d);
  if (e > 0.0f) {
    st.s += (double)e;
    st.t += (double)e * (double)d;
  }
}

__device__ __forceinline__ EntropyState entropy_merge(const EntropyState& a, const EntropyState& b) {
  if (!(b.s > 0.0)) return a;
  if (!(a.s > 0.0)) return b;
  const float m = a.m > b.m ? a.m : b.m;
  const double sa = (double)a.m - (double)m, sb = (double)b.m - (double)m;  // <= 0
  const double ea = exp(sa), eb = exp(sb);
  return EntropyState{m, a.s * ea + b.s * eb, (a.t + a.s * sa) * ea + (b.t + b.s * sb) * eb};
}

__device__ __forceinline__ EntropyState shfl_xor(const EntropyState& a, int off) {
  return EntropyState{__shfl_xor_sync(0xffffffffu, a.m, off), __shfl_xor_sync(0xffffffffu, a.s, off),
                      __shfl_xor_sync(0xffffffffu, a.t, off)};
}

// ---- loads -------------------------------------------------------------------------------------------------

__device__ __forceinline__ void load4(const float* row, int64_t v, bool vec, float out[4]) {
  if (vec) {
    const float4 q = *reinterpret_cast<const float4*>(row + v);
    out[0] = q.x, out[1] = q.y, out[2] = q.z, out[3] = q.w;
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) out[j] = row[v + j];
  }
}

__device__ __forceinline__ void load4(const bf16* row, int64_t v, bool vec, float out[4]) {
  if (vec) {
    const uint2 q = *reinterpret_cast<const uint2*>(row + v);
    out[0] = bits_to_float(q.x << 16), out[1] = bits_to_float(q.x & 0xFFFF0000u);
    out[2] = bits_to_float(q.y << 16), out[3] = bits_to_float(q.y & 0xFFFF0000u);
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) out[j] = to_float(row[v + j]);
  }
}

// ---- kernel 1 ----------------------------------------------------------------------------------------------

template <class T>
__global__ void __launch_bounds__(kThreads) position_kernel(DiffusionStepParams p) {
  const int64_t bc = blockIdx.x;
  const int64_t C = p.canvas_length, V = p.vocab_size;
  const int64_t b = bc / C, c = bc % C;
  const T* row = static_cast<const T*>(p.logits) + b * p.logits_stride_b + c * p.logits_stride_c;
  float* out = p.processed + bc * V;
  const float temp = p.temperature[b];
  const int64_t seed = p.seeds[b];
  const uint32_t k0 = seed_key0(seed), k1 = seed_key1(seed);
  const uint32_t block = (uint32_t)p.blocks[b], ctr3 = (uint32_t)(2 * p.steps[b] + 1);
  // Vector loads/stores when every group of 4 is 4-element aligned (the row start and V).
  const bool vec_in = (V % 4 == 0) && (reinterpret_cast<uintptr_t>(row) % (4 * sizeof(T)) == 0);
  const bool vec_out = (V % 4 == 0) && (reinterpret_cast<uintptr_t>(p.processed) % 16 == 0);  // then every row is
  // The position's bitmask words; a fully masked position is left unmasked (the block agrees on `any`).
  const int32_t* mask = p.bitmask == nullptr ? nullptr : p.bitmask + bc * bitmask_words(V);
  if (mask != nullptr) {
    int any = 0;
    const int64_t W = bitmask_words(V);
    for (int64_t w = threadIdx.x; w < W; w += kThreads) {
      const int tail = (int)(V - 32 * w);  // valid bits in word w (>= 32 except the last)
      any |= ((uint32_t)mask[w] & (tail >= 32 ? 0xFFFFFFFFu : ((1u << tail) - 1u))) != 0;
    }
    if (!__syncthreads_or(any)) mask = nullptr;
  }

  ArgMax best_y{-__int_as_float(0x7f800000), INT64_MAX}, best_z{-__int_as_float(0x7f800000), INT64_MAX};
  EntropyState st{-__int_as_float(0x7f800000), 0.0, 0.0};
  bool saw_nan = false;
  const int64_t groups = (V + 3) / 4;
  for (int64_t q = threadIdx.x; q < groups; q += kThreads) {
    const int64_t v0 = 4 * q;
    const bool full = v0 + 4 <= V;
    float x[4];
    if (full) {
      load4(row, v0, vec_in, x);
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) x[j] = v0 + j < V ? to_float(row[v0 + j]) : 0.0f;
    }
    float y[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) y[j] = __fdiv_rn(x[j], temp);  // IEEE division, as the reference
    if (mask != nullptr) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (v0 + j < V && !bitmask_allows(mask, v0 + j)) y[j] = -__int_as_float(0x7f800000);
      }
    }
    bool may_win = false;  // the exact Gumbel skip (see the file comment)
#pragma unroll
    for (int j = 0; j < 4; ++j) may_win |= v0 + j < V && !(__fadd_rn(y[j], kGumbelMax) < best_z.value);
    Philox4 r{};
    if (may_win) r = philox4x32_10((uint32_t)q, (uint32_t)c, block, ctr3, k0, k1);
    if (full && vec_out) {
      *reinterpret_cast<float4*>(out + v0) = make_float4(y[0], y[1], y[2], y[3]);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (v0 + j >= V) break;
      if (!(full && vec_out)) out[v0 + j] = y[j];
      best_y = better(best_y, ArgMax{y[j], v0 + j});
      if (may_win) best_z = better(best_z, ArgMax{__fadd_rn(y[j], gumbel_from_bits(r.v[j])), v0 + j});
      if (y[j] != y[j]) {
        saw_nan = true;
      } else if (y[j] > -__int_as_float(0x7f800000)) {  // -inf (masked) has probability 0: no term
        entropy_add(st, y[j]);
      }
    }
  }

  // Block reduction: warps by shuffles, then warp 0 over the per-warp partials.
  for (int off = 16; off > 0; off >>= 1) {
    best_y = better(best_y, shfl_xor(best_y, off));
    best_z = better(best_z, shfl_xor(best_z, off));
    st = entropy_merge(st, shfl_xor(st, off));
  }
  __shared__ ArgMax warp_y[kThreads / 32], warp_z[kThreads / 32];
  __shared__ EntropyState warp_st[kThreads / 32];
  __shared__ int block_nan;
  if (threadIdx.x == 0) block_nan = 0;
  __syncthreads();
  if (saw_nan) atomicOr(&block_nan, 1);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    warp_y[warp] = best_y;
    warp_z[warp] = best_z;
    warp_st[warp] = st;
  }
  __syncthreads();
  if (warp == 0) {
    const ArgMax empty{-__int_as_float(0x7f800000), INT64_MAX};
    best_y = lane < kThreads / 32 ? warp_y[lane] : empty;
    best_z = lane < kThreads / 32 ? warp_z[lane] : empty;
    st = lane < kThreads / 32 ? warp_st[lane] : EntropyState{-__int_as_float(0x7f800000), 0.0, 0.0};
    for (int off = 16; off > 0; off >>= 1) {
      best_y = better(best_y, shfl_xor(best_y, off));
      best_z = better(best_z, shfl_xor(best_z, off));
      st = entropy_merge(st, shfl_xor(st, off));
    }
    if (lane == 0) {
      // All -inf rows: every candidate is -inf, so the lowest index (0) wins, as in torch.
      p.argmax[bc] = best_y.index == INT64_MAX ? 0 : best_y.index;
      p.canvas[bc] = best_z.index == INT64_MAX ? 0 : best_z.index;  // the sample; kernel 2 renoises
      const float nan = __int_as_float(0x7fc00000);
      p.entropy[bc] = (block_nan || !(st.s > 0.0)) ? nan : (float)(log(st.s) - st.t / st.s);
    }
  }
}

// ---- kernel 2 ----------------------------------------------------------------------------------------------

// Stable ascending order with NaN last: is (hi, i) before (hj, j)?
__device__ __forceinline__ bool sorts_before(float hi, int i, float hj, int j) {
  const bool ni = hi != hi, nj = hj != hj;
  if (ni || nj) return (!ni && nj) || (ni && nj && i < j);
  return hi < hj || (hi == hj && i < j);
}

__global__ void __launch_bounds__(kAcceptThreads) accept_kernel(DiffusionStepParams p) {
  extern __shared__ unsigned char smem[];
  const int C = (int)p.canvas_length;
  float* h = reinterpret_cast<float*>(smem);  // [C] entropies by position
  float* sorted = h + C;                      // [C] by rank
  float* prefix = sorted + C;                 // [C] f32(running fp64 sum) by rank
  int* order = reinterpret_cast<int*>(prefix + C);  // [C] position of each rank
  const int64_t b = blockIdx.x;
  for (int i = threadIdx.x; i < C; i += kAcceptThreads) h[i] = p.entropy[b * C + i];
  __syncthreads();
  for (int i = threadIdx.x; i < C; i += kAcceptThreads) {
    const float hi = h[i];
    int rank = 0;
    for (int j = 0; j < C; ++j) rank += sorts_before(h[j], j, hi, i) ? 1 : 0;
    sorted[rank] = hi;
    order[rank] = i;
  }
  __syncthreads();
  __shared__ float lane_sum[kLaneSlots];
  const auto hk = [&](int64_t k) { return h[k]; };
  const int lane_thread = (int)threadIdx.x - 32;  // warp 1 sums torch's vector lanes while thread 0 runs the prefix
  if (threadIdx.x == 0) {
    double cum = 0.0;
    for (int r = 0; r < C; ++r) {
      cum += (double)sorted[r];
      prefix[r] = (float)cum;
    }
  } else if (lane_thread >= 0 && lane_thread < torch_sum_width(p.sum_lanes)) {
    lane_sum[lane_thread] = torch_sum_lane(hk, C, p.sum_lanes, lane_thread);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    const float sum = torch_sum_from_lanes(hk, C, p.sum_lanes, [&](int l) { return lane_sum[l]; });
    p.mean_entropy[b] = __fdiv_rn(sum, (float)C);
  }
  for (int i = threadIdx.x; i < C; i += kAcceptThreads) {
    const int pos = order[i];  // rank i
    const bool keep = __fsub_rn(prefix[i], sorted[i]) <= p.entropy_bound[b];
    p.accepted[b * C + pos] = keep ? 1 : 0;
    if (!keep) p.canvas[b * C + pos] = canvas_token(p.seeds[b], p.blocks[b], p.steps[b], pos, p.vocab_size);
  }
}

}  // namespace

Status diffusion_step_cuda(const DiffusionStepParams& p, void* stream) {
  DG_RETURN_IF_ERROR(check_diffusion_step_params(p));
  DG_CHECK_ARG(p.canvas_length <= kMaxCanvas, "diffusion_step: the CUDA path supports canvas_length <= %d, got %lld",
               kMaxCanvas, (long long)p.canvas_length);
  DG_CHECK_ARG(p.batch * p.canvas_length <= 0x7FFFFFFFll,
               "diffusion_step: batch * canvas_length = %lld exceeds the grid", (long long)(p.batch * p.canvas_length));
  if (p.batch == 0) return Status::Ok();
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const unsigned positions = (unsigned)(p.batch * p.canvas_length);
  if (p.logits_dtype == DType::kFloat32) {
    position_kernel<float><<<positions, kThreads, 0, s>>>(p);
  } else {
    position_kernel<bf16><<<positions, kThreads, 0, s>>>(p);
  }
  DG_CUDA_CHECK(cudaGetLastError());
  const size_t smem = (size_t)p.canvas_length * (3 * sizeof(float) + sizeof(int));
  accept_kernel<<<(unsigned)p.batch, kAcceptThreads, smem, s>>>(p);
  DG_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

}  // namespace dg
