// decode_attention on the CPU (contract: decode_attention.h). One work item per canvas and KV head: its keys (the
// cached ones, then the canvas's) are transposed once into [hd][S] fp32 (so a query's scores are 16-key vectors, one
// lane per key, each lane's sum over d the contract's serial sequence), then per query row of the head group: the
// scores, the softmax (one fixed sequence) and y = Σ_j p_j·v_j with the vectors across d (each lane's sum over j in
// order). No fused multiply-add (build.py: -ffp-contract=off), the same lane arithmetic in every ISA build (cpu_vec.h):
// a canvas's result does not depend on the other canvases, the thread count or the code path. Items run in parallel
// (OpenMP); buffers are per thread.
#include <string.h>

#include <vector>

#include "../common/check.h"
#include "../common/entropy.h"
#include "cpu_vec.h"
#include "decode_attention.h"

namespace dg {
namespace {

constexpr int kLanes = 16;
constexpr int kRows = 4;  // query rows interleaved per pass
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));

struct Scratch {
  std::vector<float> kt;  // [hd][S padded to 16]: the KV head's keys, transposed
  std::vector<float> v;  // [S][hd padded to 16]: its values, fp32
  std::vector<float> p;  // [kRows][S padded]: the rows' scores, then probabilities
  void fit(int64_t S, int64_t hd) {
    const size_t sp = (size_t)((S + kLanes - 1) / kLanes * kLanes), hp = (size_t)((hd + kLanes - 1) / kLanes * kLanes);
    if (kt.size() < hd * sp) kt.resize(hd * sp);
    if (v.size() < (size_t)S * hp) v.resize((size_t)S * hp);
    if (p.size() < kRows * sp) p.resize(kRows * sp);
  }
};

// Query rows r0 .. r0+nr-1 of the (canvas, KV head) item (row r: head g*group + r / C, query r % C), nr <= kRows,
// interleaved so that kRows independent accumulator chains hide the add latency; each row's arithmetic is its own.
template <class T>
__attribute__((always_inline)) inline void rows(const DecodeAttentionParams& pr, int64_t b, int64_t g, int64_t r0,
                                                int64_t nr, int64_t S, int64_t Sp, int64_t Hp, Scratch& s) {
  const int64_t C = pr.canvas_length, hd = pr.head_dim, group = pr.heads / pr.kv_heads;
  const float* kt = s.kt.data();
  const float* vv = s.v.data();
  const T* qsrc[kRows];
  int64_t hs[kRows], ts[kRows];
  for (int r = 0; r < kRows; ++r) {
    const int64_t rr = r0 + (r < nr ? r : 0);  // missing rows repeat the first (computed, never stored)
    hs[r] = g * group + rr / C;
    ts[r] = b * C + rr % C;
    qsrc[r] = static_cast<const T*>(pr.q) + hs[r] * pr.q_head_stride + ts[r] * pr.q_row_stride;
  }
  float* p = s.p.data();  // [kRows][Sp]
  // scores: lane j of a block sums q_d·k_jd for d in order
  for (int64_t j0 = 0; j0 < Sp; j0 += kLanes) {
    v16 a[kRows];
    for (int r = 0; r < kRows; ++r) a[r] = (v16){};
    for (int64_t d = 0; d < hd; ++d) {
      const v16 k = *(const v16u*)(kt + d * Sp + j0);
      for (int r = 0; r < kRows; ++r) a[r] = a[r] + k * to_float(qsrc[r][d]);
    }
    for (int r = 0; r < kRows; ++r) memcpy(p + r * Sp + j0, &a[r], sizeof(v16));
  }
  for (int r = 0; r < kRows; ++r) {
    float* pr_ = p + r * Sp;
    float m = round_to<T>(pr_[0]);
    for (int64_t j = 0; j < S; ++j) {
      pr_[j] = round_to<T>(pr_[j]);  // s_j = rnd(Σ_d q·k)
      m = (pr_[j] > m || pr_[j] != pr_[j]) ? pr_[j] : m;
    }
    for (int64_t j = 0; j < S; ++j) pr_[j] = exp_nonpositive(pr_[j] - m);  // vectorises
    float z = 0.0f;
    for (int64_t j = 0; j < S; ++j) z = z + pr_[j];  // in order
    for (int64_t j = 0; j < S; ++j) pr_[j] = round_to<T>(pr_[j] / z);
  }
  // y: lane d of a block sums p_j·v_jd for j in order
  for (int64_t d0 = 0; d0 < Hp; d0 += kLanes) {
    v16 a[kRows];
    for (int r = 0; r < kRows; ++r) a[r] = (v16){};
    for (int64_t j = 0; j < S; ++j) {
      const v16 v = *(const v16u*)(vv + j * Hp + d0);
      for (int r = 0; r < kRows; ++r) a[r] = a[r] + v * p[r * Sp + j];
    }
    for (int r = 0; r < nr; ++r) {
      T* y = static_cast<T*>(pr.y) + ts[r] * pr.y_row_stride + hs[r] * hd;
      float out[kLanes];
      memcpy(out, &a[r], sizeof(v16));
      for (int64_t d = d0; d < d0 + kLanes && d < hd; ++d) y[d] = from_float<T>(out[d - d0]);
    }
  }
}

// One (canvas, KV head): its `group` query heads x C queries.
template <class T>
__attribute__((always_inline)) inline void item(const DecodeAttentionParams& pr, int64_t b, int64_t g, Scratch& s) {
  const int64_t C = pr.canvas_length, hd = pr.head_dim, group = pr.heads / pr.kv_heads;
  const int64_t* sp = pr.spans + b * kDecodeAttentionSpanFields;
  const int64_t P = sp[2], S = P + C;  // the cached positions, then the canvas's
  const int64_t Sp = (S + kLanes - 1) / kLanes * kLanes, Hp = (hd + kLanes - 1) / kLanes * kLanes;
  const T* keys = reinterpret_cast<const T*>(sp[0]) + g * sp[3];
  const T* values = reinterpret_cast<const T*>(sp[1]) + g * sp[5];
  const T* ck = static_cast<const T*>(pr.canvas_keys) + g * pr.ck_head_stride + b * C * pr.ck_row_stride;
  const T* cv = static_cast<const T*>(pr.canvas_values) + g * pr.cv_head_stride + b * C * pr.cv_row_stride;
  float* kt = s.kt.data();
  float* vv = s.v.data();
  for (int64_t d = 0; d < hd; ++d) {  // exact widening; padded keys are zero (their scores are never read)
    float* row = kt + d * Sp;
    for (int64_t j = 0; j < P; ++j) row[j] = to_float(keys[j * sp[4] + d]);
    for (int64_t j = 0; j < C; ++j) row[P + j] = to_float(ck[j * pr.ck_row_stride + d]);
    for (int64_t j = S; j < Sp; ++j) row[j] = 0.0f;
  }
  for (int64_t j = 0; j < S; ++j) {
    const T* src = j < P ? values + j * sp[6] : cv + (j - P) * pr.cv_row_stride;
    float* row = vv + j * Hp;
    for (int64_t d = 0; d < hd; ++d) row[d] = to_float(src[d]);
    for (int64_t d = hd; d < Hp; ++d) row[d] = 0.0f;
  }
  for (int64_t r0 = 0; r0 < group * C; r0 += kRows) {
    const int64_t nr = group * C - r0 < kRows ? group * C - r0 : kRows;
    rows<T>(pr, b, g, r0, nr, S, Sp, Hp, s);
  }
}

template <class T>
void run(const DecodeAttentionParams& p) {
  const int64_t B = p.canvases, nkv = p.kv_heads;
  int64_t max_s = 1;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t S = p.spans[b * kDecodeAttentionSpanFields + 2] + p.canvas_length;
    max_s = S > max_s ? S : max_s;
  }
  const int64_t work = B * p.heads * p.canvas_length * max_s * p.head_dim;
  // below ~1M multiply-adds a fork/join costs more than it saves
#pragma omp parallel if (work >= (1 << 20) && B * nkv > 1)
  {
    Scratch s;
    s.fit(max_s, p.head_dim);
#pragma omp for schedule(dynamic, 1)
    for (int64_t bg = 0; bg < B * nkv; ++bg) {
      run_vectorized([&]() DG_INLINE_LAMBDA {
        item<T>(p, bg / nkv, bg % nkv, s);
        return 0;
      });
    }
  }
}

}  // namespace

Status decode_attention_cpu(const DecodeAttentionParams& p) {
  DG_CHECK_ARG(p.canvases >= 0 && p.canvas_length >= 0 && p.heads >= 1 && p.kv_heads >= 1 && p.head_dim >= 1,
               "decode_attention: bad sizes B=%lld C=%lld nh=%lld nkv=%lld hd=%lld", (long long)p.canvases,
               (long long)p.canvas_length, (long long)p.heads, (long long)p.kv_heads, (long long)p.head_dim);
  DG_CHECK_ARG(p.heads % p.kv_heads == 0, "decode_attention: %lld query heads are not a multiple of %lld KV heads",
               (long long)p.heads, (long long)p.kv_heads);
  for (int64_t b = 0; b < p.canvases; ++b) {
    DG_CHECK_ARG(p.spans[b * kDecodeAttentionSpanFields + 2] >= 0,
                 "decode_attention: canvas %lld has a negative number of cached keys", (long long)b);
  }
  if (p.canvases == 0 || p.canvas_length == 0) return Status::Ok();
  if (p.dtype == DType::kFloat32) {
    run<float>(p);
  } else {
    run<bf16>(p);
  }
  return Status::Ok();
}

}  // namespace dg
