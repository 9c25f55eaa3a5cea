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

#include <memory>

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

// One work item: np (<= RB) panels from p0 x columns [n0, n1). A short last group (a one-canvas call's only panel)
// runs panel by panel with NB columns per tile: one panel's vector against twice the columns would need a broadcast
// load per multiply-add pair, and loads, not the arithmetic, would set the pace. Either way each element's k loop
// is the same.
template <class T, int RB, int NB>
__attribute__((always_inline)) inline void item(const Ctx& c, int64_t p0, int64_t np, int64_t n0, int64_t n1) {
  if (np == RB) {
    columns<T, RB, NB>(c, p0, n0, n1);
  } else {
    for (int64_t p = p0; p < p0 + np; ++p) columns<T, 1, NB>(c, p, n0, n1);
  }
}

// Panels of RB rows-of-16 per work item and NB columns per tile, by code path: AVX-512 2 x 12 (24 of the 32 zmm
// registers accumulate: per k, two panel vectors and 12 broadcasts feed 24 products and 24 sums, so the multiply
// and add pipes rather than the loads set the pace: ~200 against ~175 GFLOP/s for 1 x 12 on a Zen 5 at the model's
// 512-row shapes; 2 x 6 measured slower than 1 x 12), AVX2 1 x 6 (each 16-lane vector is two ymm: 12 of 16
// registers), baseline 1 x 3 (12 xmm). Only speed depends on the choice.
int panels_per_item(int level) { return level == 2 ? 2 : 1; }

template <class T>
void run_items(const Ctx& c, int64_t panels, int64_t N) {
  const int level = cpu_level();
  const int64_t rb = panels_per_item(level);
  const int64_t groups = (panels + rb - 1) / rb, chunks = (N + kColChunk - 1) / kColChunk;
  const int64_t work = panels * kLanes * N * c.K;
  // below ~2M multiply-adds (a 16-row canvas at the small model's shapes) a fork/join costs more than it saves.
  // Items are handed out one at a time: on a shared VM a thread whose core another guest holds takes fewer, where a
  // static split would leave the others waiting for its half (32 canvases on 2 threads with the second core busy:
  // 540 -> 840 tok/s; the same on quiet cores).
#pragma omp parallel for schedule(dynamic, 1) if (work >= (1 << 21) && groups * chunks > 1)
  for (int64_t it = 0; it < groups * chunks; ++it) {
    const int64_t g = it % groups, n0 = (it / groups) * kColChunk;
    const int64_t n1 = n0 + kColChunk < N ? n0 + kColChunk : N;
    const int64_t p0 = g * rb, np = panels - p0 < rb ? panels - p0 : rb;
    run_vectorized([&]() DG_INLINE_LAMBDA {
      if (level == 2) {
        item<T, 2, 12>(c, p0, np, n0, n1);
      } else if (level == 1) {
        item<T, 1, 6>(c, p0, np, n0, n1);
      } else {
        item<T, 1, 3>(c, p0, np, n0, n1);
      }
      return 0;
    });
  }
}

// A 16 x 16 block transposed: dst[k * ldd + l] = src[l * ldx + k] for l < rows (0 for the rest), k < 16: 16 row
// loads, a register transpose, 16 stores (data movement only).
// Stage m: rows i and i + 2^m (bit m of i clear) trade the elements whose column has bit m set in row i / clear in
// row i + 2^m; after stages 0..3 row i holds column i.
__attribute__((always_inline)) inline void transpose16(const float* src, int64_t ldx, int64_t rows, float* dst,
                                                       int64_t ldd) {
  v16 r[kLanes];
  for (int l = 0; l < kLanes; ++l) r[l] = l < rows ? *(const v16u*)(src + l * ldx) : (v16){};  // rows past T: 0
  for (int i = 0; i < kLanes; ++i) {
    if (i & 1) continue;
    const v16 a = r[i], b = r[i | 1];
    r[i] = __builtin_shufflevector(a, b, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
    r[i | 1] = __builtin_shufflevector(a, b, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  }
  for (int i = 0; i < kLanes; ++i) {
    if (i & 2) continue;
    const v16 a = r[i], b = r[i | 2];
    r[i] = __builtin_shufflevector(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
    r[i | 2] = __builtin_shufflevector(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  }
  for (int i = 0; i < kLanes; ++i) {
    if (i & 4) continue;
    const v16 a = r[i], b = r[i | 4];
    r[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
    r[i | 4] = __builtin_shufflevector(a, b, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  }
  for (int i = 0; i < kLanes; ++i) {
    if (i & 8) continue;
    const v16 a = r[i], b = r[i | 8];
    r[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    r[i | 8] = __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  for (int k = 0; k < kLanes; ++k) *(v16u*)(dst + k * ldd) = r[k];
}

// x [T, K] (row stride ldx) → xp [panels][K][16] fp32, rows past T zero (exact: bf16 widens exactly).
template <class T>
void pack_rows(const T* x, int64_t ldx, int64_t T_, int64_t K, int64_t panels, float* xp) {
#pragma omp parallel for schedule(static) if (panels * K >= 65536)
  for (int64_t p = 0; p < panels; ++p) {
    float* dst = xp + p * K * kLanes;
    const int64_t rows = T_ - p * kLanes < kLanes ? T_ - p * kLanes : kLanes;
    const T* src = x + p * kLanes * ldx;
    int64_t k0 = 0;
    if constexpr (sizeof(T) == sizeof(float)) {  // fp32: 16 x 16 blocks transposed in registers
      run_vectorized([&]() DG_INLINE_LAMBDA {
        for (; k0 + kLanes <= K; k0 += kLanes) transpose16(src + k0, ldx, rows, dst + k0 * kLanes, kLanes);
        return 0;
      });
    }
    // the rest element by element, k outer: 16 sequential read streams, one sequential write stream
    for (int64_t k = k0; k < K; ++k) {
      for (int64_t l = 0; l < rows; ++l) dst[k * kLanes + l] = to_float(src[l * ldx + k]);
      for (int64_t l = rows; l < kLanes; ++l) dst[k * kLanes + l] = 0.0f;
    }
  }
}

// Scratch of the calling thread, reused from call to call up to kKeepFloats per buffer (8 MiB): a fresh buffer of
// that size is a new mapping that page-faults and zero-fills on every call. Larger requests live for the call only.
constexpr size_t kKeepFloats = (size_t(8) << 20) / sizeof(float);

float* thread_scratch(int which, size_t n, std::unique_ptr<float[]>& call_only) {
  thread_local std::unique_ptr<float[]> kept[2];
  thread_local size_t capacity[2] = {0, 0};
  if (n > kKeepFloats) {
    call_only.reset(new float[n]);
    return call_only.get();
  }
  if (capacity[which] < n) {
    kept[which].reset(new float[n]);
    capacity[which] = n;
  }
  return kept[which].get();
}

// An n-contiguous fp32 weight (element (n, k) at w[n + k * sk], the transpose of a [K, N] such as the embedding in
// x · E) → wd [N, K] k-contiguous: 16 x 16 blocks transposed in registers, the edges element by element (data
// movement only). A tile reads such a weight as one new cache line per k (12 floats of a row sk floats long); laid
// out [N, K] its 12 columns are 12 sequential streams.
void relayout_n_contiguous(const float* w, int64_t sk, int64_t N, int64_t K, float* wd) {
  const int64_t nb = N / kLanes, kb = K / kLanes;
#pragma omp parallel for schedule(static) if (N * K >= 65536)
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t n0 = b * kLanes;
    run_vectorized([&]() DG_INLINE_LAMBDA {
      for (int64_t k0 = 0; k0 < kb * kLanes; k0 += kLanes)
        transpose16(w + k0 * sk + n0, sk, kLanes, wd + n0 * K + k0, K);
      return 0;
    });
    for (int64_t k = kb * kLanes; k < K; ++k) {
      for (int64_t n = n0; n < n0 + kLanes; ++n) wd[n * K + k] = w[k * sk + n];
    }
  }
  for (int64_t n = nb * kLanes; n < N; ++n) {
    for (int64_t k = 0; k < K; ++k) wd[n * K + k] = w[k * sk + n];
  }
}

// Panels from which an n-contiguous fp32 weight is laid out [N, K] first: the relayout costs about as much as one
// panel's pass over the weight, and a one-canvas call (one panel) keeps reading it in place. Only a weight that fits
// the kept scratch buffer (8 MiB) is laid out: a larger one (the real vocabulary's embedding) is read in place
// rather than copied on every call.
constexpr int64_t kRelayoutPanels = 4;

template <class T>
void linear_typed(const LinearParams& p) {
  const int64_t T_ = p.rows, N = p.out_features, K = p.in_features;
  const int64_t panels = (T_ + kLanes - 1) / kLanes;
  std::unique_ptr<float[]> xp_call, wide_call;
  float* xp = thread_scratch(0, (size_t)(panels * K * kLanes), xp_call);
  pack_rows<T>(static_cast<const T*>(p.x), p.x_row_stride, T_, K, panels, xp);
  const float* w = nullptr;
  int64_t sn = p.w_n_stride, sk = p.w_k_stride;
  if constexpr (sizeof(T) == sizeof(float)) {
    w = reinterpret_cast<const float*>(p.w);
    if (sn == 1 && sk != 1 && panels >= kRelayoutPanels && (size_t)(N * K) <= kKeepFloats) {
      float* wd = thread_scratch(1, (size_t)(N * K), wide_call);
      relayout_n_contiguous(w, sk, N, K, wd);
      w = wd;
      sn = K;
      sk = 1;
    }
  } else {  // bf16 weights widened once per call (exact), in their own layout
    const T* wb = static_cast<const T*>(p.w);
    float* wd = thread_scratch(1, (size_t)(N * K), wide_call);
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
  const Ctx c{xp, K * kLanes, w, sn, sk, K, p.y, p.y_row_stride, T_};
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
