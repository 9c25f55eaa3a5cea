// nvfp4_repack / nvfp4_decode on the GPU: one thread per output word (repack) or per lane fragment (decode),
// calling the nvfp4_layout.h functions the CPU loops call. Load-time only; plain CUDA, no torch headers.
#include <cuda_runtime.h>

#include "../common/check.h"
#include "nvfp4_layout.h"
#include "nvfp4_repack.h"

namespace dg {
namespace {

constexpr int kThreads = 256;

// one thread per (e, rt, kc, lane): its 4 words, and for lanes < 16 four of the chunk's 64 scale bytes
__global__ void repack_kernel(Nvfp4RepackParams p, int64_t total) {
  const int64_t idx = (int64_t)blockIdx.x * kThreads + threadIdx.x;
  if (idx >= total) return;
  const int lane = (int)(idx & 31);
  const int64_t rt_n = p.rows / 16, kc_n = (p.kp + 63) / 64, half_k = p.kp / 2, nb = p.kp / 16;
  const int64_t chunk = idx >> 5, kc = chunk % kc_n, er = chunk / kc_n, rt = er % rt_n, e = er / rt_n;
  const uint8_t* w = p.weight + e * p.rows * half_k;
  const uint8_t* s = p.scale + e * p.rows * nb;
  auto codes = [&](int64_t row, int64_t k) { return (uint32_t)(w[row * half_k + k / 2] >> (4 * (k & 1))) & 0xFu; };
  auto zero = [&](int64_t row, int64_t kb) { return nvfp4::scale_is_zero(s[row * nb + kb]); };
  auto scale = [&](int64_t row, int64_t kb) { return (uint32_t)s[row * nb + kb]; };
  uint4 out;
  out.x = nvfp4::pack_word(rt, kc, lane, 0, p.interleave_half, p.kp, codes, zero);
  out.y = nvfp4::pack_word(rt, kc, lane, 1, p.interleave_half, p.kp, codes, zero);
  out.z = nvfp4::pack_word(rt, kc, lane, 2, p.interleave_half, p.kp, codes, zero);
  out.w = nvfp4::pack_word(rt, kc, lane, 3, p.interleave_half, p.kp, codes, zero);
  reinterpret_cast<uint4*>(p.words)[idx] = out;
  if (lane < 16) {
    uint8_t* sc = p.scales + chunk * nvfp4::kScalesPerChunk;
    for (int b = 4 * lane; b < 4 * lane + 4; ++b)
      sc[b] = (uint8_t)nvfp4::pack_scale(rt, kc, b, p.interleave_half, p.kp, scale);
  }
}

// one thread per (e, rt, kc, lane): decode its 4 k-tiles of fragments exactly as the GEMM kernels do
__global__ void decode_kernel(Nvfp4DecodeParams p, int64_t total) {
  const int64_t idx = (int64_t)blockIdx.x * kThreads + threadIdx.x;
  if (idx >= total) return;
  const int lane = (int)(idx & 31), g = lane >> 2;
  const int64_t chunk = idx >> 5, kc = chunk % p.chunks, er = chunk / p.chunks;
  const int64_t width = 64 * p.chunks;
  const uint4 q = reinterpret_cast<const uint4*>(p.words)[idx];
  const uint2 s = *reinterpret_cast<const uint2*>(p.scales + chunk * nvfp4::kScalesPerChunk + 8 * g);
  const uint32_t qs[4] = {q.x, q.y, q.z, q.w};
  bf16* out = p.out + er * 16 * width;  // er = e * RT + rt, rows of expert e start at e * N = e * RT * 16
  for (int j = 0; j < 4; ++j) {
    uint32_t a[4];
    nvfp4::decode_fragment(qs[j], s.x, s.y, j, a);
    for (int i = 0; i < 8; ++i)
      out[nvfp4::frag_row(lane, i) * width + (4 * kc + j) * 16 + nvfp4::frag_col(lane, i)] =
          bf16{(uint16_t)(a[i >> 1] >> (16 * (i & 1)))};
  }
}

unsigned blocks_for(int64_t total) { return (unsigned)((total + kThreads - 1) / kThreads); }

}  // namespace

Status nvfp4_repack_cuda(const Nvfp4RepackParams& p, void* stream) {
  DG_RETURN_IF_ERROR(nvfp4_repack_check(p));
  const int64_t total = p.experts * (p.rows / 16) * ((p.kp + 63) / 64) * 32;
  if (total == 0) return Status::Ok();
  DG_CHECK_ARG(total / kThreads < 0x7fffffff, "nvfp4_repack: %lld lanes exceed the CUDA grid", (long long)total);
  repack_kernel<<<blocks_for(total), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p, total);
  DG_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

Status nvfp4_decode_cuda(const Nvfp4DecodeParams& p, void* stream) {
  DG_CHECK_ARG(p.experts >= 0 && p.rows >= 0 && p.rows % 16 == 0 && p.chunks >= 0,
               "nvfp4_decode: need rows %% 16 == 0, got E=%lld N=%lld KC=%lld", (long long)p.experts, (long long)p.rows,
               (long long)p.chunks);
  const int64_t total = p.experts * (p.rows / 16) * p.chunks * 32;
  if (total == 0) return Status::Ok();
  DG_CHECK_ARG(total / kThreads < 0x7fffffff, "nvfp4_decode: %lld lanes exceed the CUDA grid", (long long)total);
  decode_kernel<<<blocks_for(total), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p, total);
  DG_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

}  // namespace dg
