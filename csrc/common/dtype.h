// Element types the ops accept, and bfloat16 <-> float32 on raw 16-bit storage, __host__ __device__, without
// cuda_bf16.h (so the same code compiles with g++). float -> bfloat16 rounds to nearest even, as torch does.
#pragma once

#include <stdint.h>

#include "philox.h"  // DG_HD, bit casts

namespace dg {

// Runtime dtype tag for `const void*` tensor arguments (bindings.cpp maps torch dtypes onto it).
enum class DType : int { kFloat32 = 0, kBFloat16 = 1 };

inline const char* dtype_name(DType t) { return t == DType::kFloat32 ? "float32" : "bfloat16"; }

struct bf16 {
  uint16_t bits;
};

DG_HD float to_float(float x) { return x; }
DG_HD float to_float(bf16 x) { return bits_to_float((uint32_t)x.bits << 16); }

DG_HD bf16 float_to_bf16(float x) {
  const uint32_t u = float_to_bits(x);
  if (x != x) return bf16{(uint16_t)0x7FC0u};  // as c10::BFloat16 (scalar path)
  const uint32_t rounding_bias = 0x7FFFu + ((u >> 16) & 1u);
  return bf16{(uint16_t)((u + rounding_bias) >> 16)};
}

template <typename T>
DG_HD T from_float(float x);
template <>
DG_HD float from_float<float>(float x) {
  return x;
}
template <>
DG_HD bf16 from_float<bf16>(float x) {
  return float_to_bf16(x);
}

// x rounded to T and widened back (exact): the model dtype's rounding of an fp32 value, kept in fp32.
template <typename T>
DG_HD float round_to(float x) {
  return to_float(from_float<T>(x));
}

}  // namespace dg
