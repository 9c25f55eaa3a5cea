// torch_sum: a float32 sum in exactly the order torch's CPU `sum` kernel uses for a contiguous inner
// reduction, so that ops reproducing `x.pow(2).mean(-1)` (rms_norm) or `entropy.mean(-1)` (diffusion_step)
// are bit-identical to the PyTorch reference on the same CPU.
//
// Source of the order: aten/src/ATen/native/cpu/SumKernel.cpp (cascade_sum -> vectorized_inner_sum when
// n >= lanes, else scalar_inner_sum; both via row_sum = multi_row_sum with ILP 4 and a 4-level cascade whose
// level size is 2^max(4, ceil_log2(rows) / 4)), and `mean` on CPU = sum(...) / n (ReduceOps.cpp, mean_out).
// `lanes` is Vectorized<float>::size() of the kernel torch dispatched to: 16 for AVX512, 8 for AVX2 and
// DEFAULT builds; the Python side passes it (torch.backends.cpu.get_cpu_capability()) and verifies it.
// Valid while the reduction runs on one thread per row: torch splits a single-row reduction across
// threads (two-pass) when the input has >= 32768 elements and one output -- the Python dispatcher routes
// that case to the reference.
#pragma once

#include <stdint.h>

#include "philox.h"  // DG_HD

namespace dg {
namespace torch_sum_detail {

template <int W>
struct Lanes {
  float v[W];
};

template <int W>
DG_HD void set_zero(Lanes<W>& a) {
  for (int l = 0; l < W; ++l) a.v[l] = 0.0f;
}
DG_HD void set_zero(float& a) { a = 0.0f; }

template <int W>
DG_HD void add_to(Lanes<W>& a, const Lanes<W>& b) {
  for (int l = 0; l < W; ++l) a.v[l] += b.v[l];
}
DG_HD void add_to(float& a, float b) { a += b; }

DG_HD int64_t ceil_log2(int64_t x) {  // c10 utils::CeilLog2
  if (x <= 2) return 1;
#if defined(__CUDA_ARCH__)
  const int clz = __clzll((long long)(x - 1));
#else
  const int clz = __builtin_clzll((unsigned long long)(x - 1));
#endif
  return (int64_t)(63 - clz) + 1;
}

// multi_row_sum<nrows = 4>: load(i, k) is element (i, k) of a (size, 4) array; returns the 4 column sums.
template <class Acc, class Load>
DG_HD void multi_row_sum4(const Load& load, int64_t size, Acc out[4]) {
  constexpr int64_t kLevels = 4;
  const int64_t level_power = ceil_log2(size) / kLevels > 4 ? ceil_log2(size) / kLevels : 4;
  const int64_t level_step = (int64_t)1 << level_power;
  const int64_t level_mask = level_step - 1;
  if (size < level_step) {  // no cascade step: levels 1..3 stay +0, and (a + 0) + 0 + 0 == a + 0 bit for bit
    Acc a[4], zero;
    set_zero(zero);
    for (int k = 0; k < 4; ++k) set_zero(a[k]);
    for (int64_t i = 0; i < size; ++i)
      for (int k = 0; k < 4; ++k) add_to(a[k], load(i, k));
    for (int k = 0; k < 4; ++k) {
      add_to(a[k], zero);
      out[k] = a[k];
    }
    return;
  }
  Acc acc[kLevels][4];
  for (int j = 0; j < kLevels; ++j)
    for (int k = 0; k < 4; ++k) set_zero(acc[j][k]);

  int64_t i = 0;
  for (; i + level_step <= size;) {
    for (int64_t j = 0; j < level_step; ++j, ++i)
      for (int k = 0; k < 4; ++k) add_to(acc[0][k], load(i, k));
    for (int64_t j = 1; j < kLevels; ++j) {
      for (int k = 0; k < 4; ++k) {
        add_to(acc[j][k], acc[j - 1][k]);
        set_zero(acc[j - 1][k]);
      }
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < size; ++i)
    for (int k = 0; k < 4; ++k) add_to(acc[0][k], load(i, k));
  for (int j = 1; j < kLevels; ++j)
    for (int k = 0; k < 4; ++k) add_to(acc[0][k], acc[j][k]);
  for (int k = 0; k < 4; ++k) out[k] = acc[0][k];
}

// row_sum: load(i) is element i of a row of `size` elements (scalars or lane vectors).
template <class Acc, class Load>
DG_HD Acc row_sum(const Load& load, int64_t size) {
  const int64_t size_ilp = size / 4;
  Acc partial[4];
  multi_row_sum4<Acc>([&](int64_t i, int k) { return load(i * 4 + k); }, size_ilp, partial);
  for (int64_t i = size_ilp * 4; i < size; ++i) add_to(partial[0], load(i));
  for (int k = 1; k < 4; ++k) add_to(partial[0], partial[k]);
  return partial[0];
}

template <int W, class Elem>
DG_HD float inner_sum(const Elem& elem, int64_t n) {
  if (n < W) {  // scalar_inner_sum
    return 0.0f + row_sum<float>(elem, n);
  }
  const int64_t nvec = n / W;  // vectorized_inner_sum
  const Lanes<W> vacc = row_sum<Lanes<W>>(
      [&](int64_t i) {
        Lanes<W> v;
        for (int l = 0; l < W; ++l) v.v[l] = elem(i * W + l);
        return v;
      },
      nvec);
  float acc = 0.0f;
  for (int64_t k = nvec * W; k < n; ++k) acc += elem(k);
  for (int l = 0; l < W; ++l) acc += vacc.v[l];
  return 0.0f + acc;  // CastStoreAccumulate: the output starts at 0
}

}  // namespace torch_sum_detail

// Sum of elem(0) .. elem(n-1) (each a float) in torch's CPU order for Vectorized<float>::size() == lanes.
// lanes must be 8 or 16 (anything else is treated as 8).
template <class Elem>
DG_HD float torch_sum(const Elem& elem, int64_t n, int lanes) {
  return lanes == 16 ? torch_sum_detail::inner_sum<16>(elem, n) : torch_sum_detail::inner_sum<8>(elem, n);
}

// The same sum split by lanes, for a GPU block: every operation on torch's Vectorized accumulator is
// lane-wise and the cascade's shape depends on sizes only, so lane l of it is the scalar cascade of
// elem(l), elem(W + l), elem(2W + l), ... Thread l < torch_sum_width(lanes) computes torch_sum_lane(.., l),
// one thread combines them with torch_sum_from_lanes: bit-identical to torch_sum, with 16 accumulators per
// thread instead of 16 × 16 (which spill in one GPU thread). torch_sum_split runs the same pieces serially.
DG_HD int torch_sum_width(int lanes) { return lanes == 16 ? 16 : 8; }

template <class Elem>
DG_HD float torch_sum_lane(const Elem& elem, int64_t n, int lanes, int l) {
  const int W = torch_sum_width(lanes);
  if (n < W) return 0.0f;  // the scalar path: no vector lanes
  return torch_sum_detail::row_sum<float>([&](int64_t i) { return elem(i * W + l); }, n / W);
}

template <class Elem, class Partial>
DG_HD float torch_sum_from_lanes(const Elem& elem, int64_t n, int lanes, const Partial& partial) {
  const int W = torch_sum_width(lanes);
  if (n < W) return 0.0f + torch_sum_detail::row_sum<float>(elem, n);  // scalar_inner_sum
  float acc = 0.0f;
  for (int64_t k = n / W * W; k < n; ++k) acc += elem(k);
  for (int l = 0; l < W; ++l) acc += partial(l);
  return 0.0f + acc;
}

template <class Elem>
DG_HD float torch_sum_split(const Elem& elem, int64_t n, int lanes) {
  float part[16];
  for (int l = 0; l < torch_sum_width(lanes); ++l) part[l] = torch_sum_lane(elem, n, lanes, l);
  return torch_sum_from_lanes(elem, n, lanes, [&](int l) { return part[l]; });
}

}  // namespace dg
