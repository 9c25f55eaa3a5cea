// nvfp4_repack: ModelOpt NVFP4 matrices → the kernel layout of nvfp4_layout.h (load time, once per tensor);
// nvfp4_decode: the inverse view used by the tests — the bf16 values the GEMM kernels feed to the tensor cores.
//
//   weight   uint8 [E, N, Kp/2]   E2M1 codes, element 2j in the low nibble (ModelOpt `weight`)
//   scale    uint8 [E, N, Kp/16]  E4M3 bytes (ModelOpt `weight_scale`); finite and non-negative (the caller
//                                 checks; a NaN or negative byte is encoded as 0xFF, which decodes to garbage)
//   words    uint32 [E, N/16, KC, 128], scales uint8 [E, N/16, KC, 64] with KC = ceil(Kp / 64)
//   interleave_half = N/2 for GEMM1's stacked [gate; up] operand (8-row interleave), 0 otherwise.
//   decode:  out bf16 [E, N, 64·KC], out[e, r, k] = E2M1(code) · s · 2^-7 of packed row r (interleaved order),
//            computed with the kernels' own fragment decode (nvfp4::decode_fragment); 0 past Kp.
// Pure integer re-indexing (decode: exact products), so CPU and CUDA give identical bytes.
#pragma once

#include <stdint.h>

#include "../common/dtype.h"
#include "../common/status.h"

namespace dg {

struct Nvfp4RepackParams {
  const uint8_t* weight;
  const uint8_t* scale;
  uint32_t* words;
  uint8_t* scales;
  int64_t experts;
  int64_t rows;             // N, a multiple of 16
  int64_t kp;               // padded K, a multiple of 16
  int64_t interleave_half;  // N/2 or 0
};

struct Nvfp4DecodeParams {
  const uint32_t* words;
  const uint8_t* scales;
  bf16* out;
  int64_t experts;
  int64_t rows;             // N
  int64_t chunks;           // KC
};

// size checks shared by both paths
inline Status nvfp4_repack_check(const Nvfp4RepackParams& p) {
  if (p.experts < 0 || p.rows < 0 || p.rows % 16 != 0 || p.kp < 0 || p.kp % 16 != 0)
    return Status::printf(StatusCode::kInvalidArgument,
                          "nvfp4_repack: need experts >= 0, rows %% 16 == 0, Kp %% 16 == 0; got E=%lld N=%lld Kp=%lld",
                          (long long)p.experts, (long long)p.rows, (long long)p.kp);
  if (p.interleave_half != 0 && (p.interleave_half * 2 != p.rows || p.interleave_half % 8 != 0))
    return Status::printf(StatusCode::kInvalidArgument,
                          "nvfp4_repack: interleaving gate/up needs N = 2·I with I %% 8 == 0, got N=%lld I=%lld",
                          (long long)p.rows, (long long)p.interleave_half);
  return Status::Ok();
}
Status nvfp4_repack_cpu(const Nvfp4RepackParams& p);
Status nvfp4_repack_cuda(const Nvfp4RepackParams& p, void* stream);  // compiled only with CUDA
Status nvfp4_decode_cpu(const Nvfp4DecodeParams& p);
Status nvfp4_decode_cuda(const Nvfp4DecodeParams& p, void* stream);  // compiled only with CUDA

}  // namespace dg
