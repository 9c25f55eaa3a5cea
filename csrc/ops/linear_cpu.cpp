// linear on the CPU: a register-blocked GEMM that keeps every output element's reduction one fixed serial sequence
// over k (linear.h), so a row's bits never depend on the row count, the thread count or the CPU's vector width.
//
// How: x is packed into panels of 16 rows, k-major ([panel][k][16 lanes], fp32, rows past T zero), and the
// vectors run ACROSS ROWS: one lane per row, acc_lane = acc_lane + x[t, k] * w[n, k] for k = 0 .. K-1. A lane's
// arithmetic is the same in any lane of any panel and in the scalar, SSE, AVX2 or AVX-512 build (cpu_vec.h), so
// where a row sits in the batch cannot change its result. A tile is RB panels x NB output columns (RB*NB vector
// accumulators held in registers, each w[n, k] broadcast once per k); tiles over T and N run in parallel
// (OpenMP), never over k. bf16 operands are widened exactly to fp32 first; y is rounded once at the end.
//
// No fused multiply-add: build.py compiles every csrc file with -ffp-contract=off (and no fast-math), so
// `acc + xv * w` below is a product rounded to fp32, then a sum rounded to fp32, on every ISA; the code has no
// fma intrinsic and no fmaf call. That is exactly reference.linear's `acc = acc + x[:, k:k+1] * w[:, k]`.
#include <string.h>

#include <vector>

#include "../common/check.h"
#include "cpu_vec.h"
#include "linear.h"

namespace dg {
namespace {

constexpr int kLanes = 16;         // rows per panel = lanes of one accumulator vector
constexpr int64_t kColChunk = 48;  // output columns per parallel work item (a multiple of every NB below)
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));  // unaligned loads of a panel row

struct Ctx {
  const float* xp;  // packed x: [panels][K][16]
  int64_t ps;       // panel stride, K * 16
  const float* w;   // [N, K] fp32, element (n, k) at w[n * sn + k * sk]
  int64_t sn, sk;
  int64_t K;
  void* y;
  int64_t ldy;
  int64_t T;
};

// One tile: panels xp[0 .. RB-1] (stride ps) x weight rows w[0 .. NB-1] (element (j, k) at w[j * sn + k * sk])
// → st[(r*NB + j)*16 + l]. The loops over r and j unroll fully, so the RB*NB accumulators stay in registers.
template <int RB, int NB>
__attribute__((always_inline)) inline void tile(const float* xp, int64_t ps, const float* w, int64_t sn, int64_t sk,
                                                int64_t K, float* st) {
  v16 acc[RB][NB];
#pragma GCC unroll 16
  for (int r = 0; r < RB; ++r) {
#pragma GCC unroll 16
    for (int j = 0; j < NB; ++j) acc[r][j] = (v16){};
  }
  for (int64_t k = 0; k < K; ++k) {
    v16 xv[RB];
#pragma GCC unroll 16
    for (int r = 0; r < RB; ++r) xv[r] = *(const v16u*)(xp + r * ps + k * kLanes);
#pragma GCC unroll 16
    for (int j = 0; j < NB; ++j) {
      const float wj = w[j * sn + k * sk];
#pragma GCC unroll 16
      for (int r = 0; r < RB; ++r) acc[r][j] = acc[r][j] + xv[r] * wj;  // a product, then a sum (no fma)
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < RB; ++r) {
#pragma GCC unroll 16
    for (int j = 0; j < NB; ++j) memcpy(st + (r * NB + j) * kLanes, &acc[r][j], sizeof(v16));
  }
}

// y[t0 + 16r + l, n0 + j] = rnd(st[(r*NB + j)*16 + l]) for the rows that exist.
template <class T, int RB, int NB>
__attribute__((always_inline)) inline void store(const float* st, const Ctx& c, int64_t t0, int64_t n0) {
  T* y = static_cast<T*>(c.y);
  for (int r = 0; r < RB; ++r) {
    for (int l = 0; l < kLanes; ++l) {
      const int64_t t = t0 + r * kLanes + l;
      if (t >= c.T) return;
      for (int j = 0; j < NB; ++j) y[t * c.ldy + n0 + j] = from_float<T>(st[(r * NB + j) * kLanes + l]);
    }
  }
}

// Panels p0 .. p0+RB-1 x columns [n0, n1): NB columns at a time, then one at a time.
template <class T, int RB, int NB>
__attribute__((always_inline)) inline void columns(const Ctx& c, int64_t p0, int64_t n0, int64_t n1) {
  float st[RB * NB * kLanes];
  const float* xp = c.xp + p0 * c.ps;
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) {
    tile<RB, NB>(xp, c.ps, c.w + n * c.sn, c.sn, c.sk, c.K, st);
    store<T, RB, NB>(st, c, p0 * kLanes, n);
  }
  for (; n < n1; ++n) {
    tile<RB, 1>(xp, c.ps, c.w + n * c.sn, c.sn, c.sk, c.K, st);
    store<T, RB, 1>(st, c, p0 * kLanes, n);
  }
}

// One work item: np (<= RB) panels from p0 x columns [n0, n1). A short last group runs panel by panel with
// RB*NB columns per tile (the same register budget); either way each element's k loop is the same.
template <class T, int RB, int NB>
__attribute__((always_inline)) inline void item(const Ctx& c, int64_t p0, int64_t np, int64_t n0, int64_t n1) {
  if (np == RB) {
    columns<T, RB, NB>(c, p0, n0, n1);
  } else {
    for (int64_t p = p0; p < p0 + np; ++p) columns<T, 1, RB * NB>(c, p, n0, n1);
  }
}

// Panels of RB rows-of-16 per work item and NB columns per tile, by code path: AVX-512 1 x 12 (12 zmm
// accumulators), AVX2 1 x 6 (each 16-lane vector is two ymm: 12 registers), baseline 1 x 3 (12 xmm). Only speed
// depends on the choice (2 x 6 on AVX-512 measured slower than 1 x 12 at the model's shapes).
int panels_per_item(int) { return 1; }

template <class T>
void run_items(const Ctx& c, int64_t panels, int64_t N) {
  const int level = cpu_level();
  const int64_t rb = panels_per_item(level);
  const int64_t groups = (panels + rb - 1) / rb, chunks = (N + kColChunk - 1) / kColChunk;
  const int64_t work = panels * kLanes * N * c.K;
  // below ~2M multiply-adds (a 16-row canvas at the small model's shapes) a fork/join costs more than it saves
#pragma omp parallel for schedule(static) if (work >= (1 << 21) && groups * chunks > 1)
  for (int64_t it = 0; it < groups * chunks; ++it) {
    const int64_t g = it / chunks, n0 = (it % chunks) * kColChunk;
    const int64_t n1 = n0 + kColChunk < N ? n0 + kColChunk : N;
    const int64_t p0 = g * rb, np = panels - p0 < rb ? panels - p0 : rb;
    run_vectorized([&]() DG_INLINE_LAMBDA {
      if (level == 2) {
        item<T, 1, 12>(c, p0, np, n0, n1);
      } else if (level == 1) {
        item<T, 1, 6>(c, p0, np, n0, n1);
      } else {
        item<T, 1, 3>(c, p0, np, n0, n1);
      }
      return 0;
    });
  }
}

// x [T, K] (row stride ldx) → xp [panels][K][16] fp32, rows past T zero (exact: bf16 widens exactly).
template <class T>
void pack_rows(const T* x, int64_t ldx, int64_t T_, int64_t K, int64_t panels, float* xp) {
#pragma omp parallel for schedule(static) if (panels * K >= 65536)
  for (int64_t p = 0; p < panels; ++p) {
    float* dst = xp + p * K * kLanes;
    for (int l = 0; l < kLanes; ++l) {
      const int64_t t = p * kLanes + l;
      for (int64_t k = 0; k < K; ++k) dst[k * kLanes + l] = t < T_ ? to_float(x[t * ldx + k]) : 0.0f;
    }
  }
}

template <class T>
void linear_typed(const LinearParams& p) {
  const int64_t T_ = p.rows, N = p.out_features, K = p.in_features;
  const int64_t panels = (T_ + kLanes - 1) / kLanes;
  std::vector<float> xp((size_t)(panels * K * kLanes));
  pack_rows<T>(static_cast<const T*>(p.x), p.x_row_stride, T_, K, panels, xp.data());
  std::vector<float> wide;  // bf16 weights widened once per call (exact), in their own layout
  const float* w = nullptr;
  int64_t sn = p.w_n_stride, sk = p.w_k_stride;
  if constexpr (sizeof(T) == sizeof(float)) {
    w = reinterpret_cast<const float*>(p.w);
  } else {
    wide.resize((size_t)(N * K));
    const T* wb = static_cast<const T*>(p.w);
    float* wd = wide.data();
    // widened with the same orientation: k-contiguous ([N, K]) unless the weight is n-contiguous ([K, N])
    const bool k_major = sn == 1 && sk != 1;
#pragma omp parallel for schedule(static) if (N * K >= 65536)
    for (int64_t a = 0; a < (k_major ? K : N); ++a) {
      for (int64_t b = 0; b < (k_major ? N : K); ++b) {
        const int64_t n = k_major ? b : a, k = k_major ? a : b;
        wd[a * (k_major ? N : K) + b] = to_float(wb[n * p.w_n_stride + k * p.w_k_stride]);
      }
    }
    w = wd;
    sn = k_major ? 1 : K;
    sk = k_major ? N : 1;
  }
  const Ctx c{xp.data(), K * kLanes, w, sn, sk, K, p.y, p.y_row_stride, T_};
  run_items<T>(c, panels, N);
}

}  // namespace

Status linear_cpu(const LinearParams& p) {
  DG_CHECK_ARG(p.rows >= 0 && p.out_features >= 0 && p.in_features >= 0,
               "linear: sizes must be >= 0, got T=%lld N=%lld K=%lld", (long long)p.rows, (long long)p.out_features,
               (long long)p.in_features);
  if (p.rows == 0 || p.out_features == 0) return Status::Ok();
  if (p.dtype == DType::kFloat32) {
    linear_typed<float>(p);
  } else {
    linear_typed<bf16>(p);
  }
  return Status::Ok();
}

}  // namespace dg
