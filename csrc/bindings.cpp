// dgserve._C: the only translation unit that sees Python and torch. For every op it validates the tensors
// once (dtype, device, shape, contiguity; messages name the op and the argument), extracts pointers and
// sizes into the core's parameters, releases the GIL around CPU cores, runs the core on the current CUDA
// stream for CUDA tensors, and turns a non-Ok Status into ValueError (InvalidArgument) or RuntimeError.
// Outputs are allocated by the caller (dgserve.ops) and passed in.
#include <torch/extension.h>

#include <array>
#include <sstream>
#include <string>

#include "common/dtype.h"
#include "common/status.h"
#include "ops/canvas_noise.h"
#include "ops/decode_attention.h"
#include "ops/diffusion_step.h"
#include "ops/gelu_tanh_mul.h"
#include "ops/gumbel_noise.h"
#include "ops/linear.h"
#include "ops/moe_align.h"
#include "ops/moe_combine.h"
#include "ops/moe_experts.h"
#include "ops/moe_route.h"
#include "ops/noise_hooks.h"
#include "ops/nvfp4_moe_experts.h"
#include "ops/nvfp4_repack.h"
#include "ops/rms_norm.h"
#include "ops/rms_norm_add.h"
#include "ops/rms_norm_rope.h"
#include "ops/rope.h"
#include "ops/softcap.h"
#include "ops/softmax_rows.h"

#if defined(DG_WITH_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace py = pybind11;

namespace {

using at::Tensor;

std::string shape_str(const Tensor& t) {
  std::ostringstream os;
  os << t.sizes();
  return os.str();
}

void raise_if_error(const dg::Status& s, const char* op) {
  if (s.ok()) return;
  const std::string msg = std::string(op) + ": " + s.message;
  if (s.code == dg::StatusCode::kInvalidArgument) throw py::value_error(msg);
  throw std::runtime_error(msg);
}

// dtype / rank / contiguity of one argument.
void check_arg(const Tensor& t, const char* op, const char* name, std::initializer_list<at::ScalarType> dtypes,
               int64_t ndim, bool contiguous = true) {
  bool dtype_ok = false;
  for (auto d : dtypes) dtype_ok = dtype_ok || t.scalar_type() == d;
  if (!dtype_ok) {
    std::ostringstream os;
    os << "(";
    for (auto d : dtypes) os << c10::toString(d) << (d == *(dtypes.end() - 1) ? "" : " or ");
    os << ")";
    TORCH_CHECK_VALUE(false, op, ": `", name, "` must have dtype ", os.str(), ", got ", t.scalar_type());
  }
  TORCH_CHECK_VALUE(t.dim() == ndim, op, ": `", name, "` must have ", ndim, " dims, got shape ", shape_str(t));
  if (contiguous) {
    TORCH_CHECK_VALUE(t.is_contiguous(), op, ": `", name, "` must be contiguous (shape ", shape_str(t), ", strides ",
                      t.strides(), ")");
  }
}

void check_shape(const Tensor& t, const char* op, const char* name, at::IntArrayRef expected) {
  TORCH_CHECK_VALUE(t.sizes() == expected, op, ": `", name, "` must have shape ", expected, ", got ", shape_str(t));
}

void check_same_device(const Tensor& ref, const Tensor& t, const char* op, const char* name) {
  TORCH_CHECK_VALUE(t.device() == ref.device(), op, ": `", name, "` is on ", t.device(), " but the inputs are on ",
                    ref.device());
}

// The one spelling of device dispatch, used by every op: `dispatch(op, ref, cpu_core, DG_CUDA(cuda_launcher),
// args...)` runs `cpu_core(args...)` without the GIL when `ref` is a CPU tensor, or `cuda_launcher(args..., stream)`
// on the current stream of `ref`'s device when it is a CUDA tensor and this build has CUDA (a build without CUDA
// never names the launchers: DG_CUDA makes them nullptr); any other device is a ValueError. A non-Ok Status
// becomes a Python exception (raise_if_error).
#if defined(DG_WITH_CUDA)
#define DG_CUDA(launcher) (launcher)
#else
#define DG_CUDA(launcher) nullptr
#endif

template <class CpuCore, class CudaLauncher, class... Args>
void dispatch(const char* op, const Tensor& ref, CpuCore cpu_core, [[maybe_unused]] CudaLauncher cuda_launcher,
              const Args&... args) {
  if (ref.device().is_cpu()) {
    dg::Status status;
    {
      py::gil_scoped_release no_gil;
      status = cpu_core(args...);
    }
    raise_if_error(status, op);
    return;
  }
#if defined(DG_WITH_CUDA)
  if (ref.device().is_cuda()) {
    const c10::cuda::CUDAGuard guard(ref.device());
    void* stream = static_cast<void*>(c10::cuda::getCurrentCUDAStream(ref.device().index()).stream());
    raise_if_error(cuda_launcher(args..., stream), op);
    return;
  }
#endif
  TORCH_CHECK_VALUE(false, op, ": tensors on ", ref.device(), " are not supported by this build of dgserve._C");
}

dg::DType dg_dtype(const Tensor& t) {
  return t.scalar_type() == at::kBFloat16 ? dg::DType::kBFloat16 : dg::DType::kFloat32;
}

// ---- rms_norm --------------------------------------------------------------------------------------------

void rms_norm(const Tensor& x, const std::optional<Tensor>& weight, double eps, const Tensor& out, int64_t sum_lanes) {
  const char* op = "rms_norm";
  check_arg(x, op, "x", {at::kFloat, at::kBFloat16}, 2, /*contiguous=*/false);
  TORCH_CHECK_VALUE(x.size(1) >= 1 && x.stride(1) == 1, op, ": `x` needs a contiguous last dim, got shape ",
                    shape_str(x), " strides ", x.strides());
  check_arg(out, op, "out", {x.scalar_type()}, 2, /*contiguous=*/false);
  check_shape(out, op, "out", x.sizes());
  TORCH_CHECK_VALUE(out.stride(1) == 1, op, ": `out` needs a contiguous last dim");
  check_same_device(x, out, op, "out");
  const float* w = nullptr;
  if (weight.has_value()) {
    check_arg(*weight, op, "weight", {at::kFloat}, 1);
    check_shape(*weight, op, "weight", {x.size(1)});
    check_same_device(x, *weight, op, "weight");
    w = weight->data_ptr<float>();
  }
  dg::RmsNormParams p{dg_dtype(x),   x.data_ptr(), x.stride(0), w,          out.data_ptr(),
                      out.stride(0), x.size(0),    x.size(1),   (float)eps, (int)sum_lanes};
  dispatch(op, x, dg::rms_norm_cpu, DG_CUDA(dg::rms_norm_cuda), p);
}

// ---- rms_norm_add / rms_norm_rope (contracts: ops/rms_norm_add.h, ops/rms_norm_rope.h) -----------------------

// rope's and rms_norm_rope's cos, sin [T, hd] and out [T, heads, hd]: x's dtype, on the CPU (x is [T, heads, hd]).
void check_rope_tables(const char* op, const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& out) {
  const int64_t T = x.size(0), H = x.size(1), hd = x.size(2);
  check_arg(cos, op, "cos", {x.scalar_type()}, 2);
  check_shape(cos, op, "cos", {T, hd});
  check_arg(sin, op, "sin", {x.scalar_type()}, 2);
  check_shape(sin, op, "sin", {T, hd});
  check_arg(out, op, "out", {x.scalar_type()}, 3);
  check_shape(out, op, "out", {T, H, hd});
  TORCH_CHECK_VALUE(cos.device().is_cpu() && sin.device().is_cpu() && out.device().is_cpu(), op,
                    ": every tensor must be on the CPU");
}

// weight: None or [dim] fp32 on the CPU → its pointer (nullptr for None).
const float* norm_weight(const std::optional<Tensor>& weight, int64_t dim, const char* op) {
  if (!weight.has_value()) return nullptr;
  check_arg(*weight, op, "weight", {at::kFloat}, 1);
  check_shape(*weight, op, "weight", {dim});
  TORCH_CHECK_VALUE(weight->device().is_cpu(), op, ": `weight` must be a CPU tensor");
  return weight->data_ptr<float>();
}

void rms_norm_add(const Tensor& residual, const Tensor& x, const std::optional<Tensor>& weight, double eps,
                  std::optional<double> scale, const Tensor& out, int64_t sum_lanes) {
  const char* op = "rms_norm_add";
  check_arg(x, op, "x", {at::kFloat, at::kBFloat16}, 2, /*contiguous=*/false);
  TORCH_CHECK_VALUE(x.device().is_cpu(), op, ": `x` must be a CPU tensor (the op has no CUDA path)");
  TORCH_CHECK_VALUE(x.size(1) >= 1 && x.stride(1) == 1, op, ": `x` needs a contiguous last dim, got shape ",
                    shape_str(x), " strides ", x.strides());
  for (const auto& [t, name] : {std::pair<const Tensor&, const char*>{residual, "residual"}, {out, "out"}}) {
    check_arg(t, op, name, {x.scalar_type()}, 2, /*contiguous=*/false);
    check_shape(t, op, name, x.sizes());
    TORCH_CHECK_VALUE(t.stride(1) == 1 && t.device().is_cpu(), op, ": `", name,
                      "` needs a contiguous last dim on the CPU");
  }
  const float* w = norm_weight(weight, x.size(1), op);
  dg::RmsNormAddParams p{dg_dtype(x),
                         residual.data_ptr(),
                         residual.stride(0),
                         x.data_ptr(),
                         x.stride(0),
                         w,
                         out.data_ptr(),
                         out.stride(0),
                         x.size(0),
                         x.size(1),
                         (float)eps,
                         scale.has_value(),
                         (float)scale.value_or(1.0),
                         (int)sum_lanes};
  dg::Status status;
  {
    py::gil_scoped_release no_gil;
    status = dg::rms_norm_add_cpu(p);
  }
  raise_if_error(status, op);
}

void rms_norm_rope(const Tensor& x, const std::optional<Tensor>& weight, double eps, const Tensor& cos,
                   const Tensor& sin, const Tensor& out, int64_t sum_lanes) {
  const char* op = "rms_norm_rope";
  check_arg(x, op, "x", {at::kFloat, at::kBFloat16}, 3, /*contiguous=*/false);
  TORCH_CHECK_VALUE(x.device().is_cpu(), op, ": `x` must be a CPU tensor (the op has no CUDA path)");
  const int64_t T = x.size(0), H = x.size(1), hd = x.size(2);
  TORCH_CHECK_VALUE(hd >= 2 && hd % 2 == 0 && hd <= dg::kRmsNormRopeMaxHeadDim, op,
                    ": the head dim must be even and in [2, ", dg::kRmsNormRopeMaxHeadDim, "], got ", hd);
  TORCH_CHECK_VALUE(x.stride(2) == 1, op, ": `x` needs a contiguous last dim");
  check_rope_tables(op, x, cos, sin, out);
  const float* w = norm_weight(weight, hd, op);
  dg::RmsNormRopeParams p{dg_dtype(x),    x.data_ptr(),   x.stride(0), x.stride(1), w,  cos.data_ptr(),
                          sin.data_ptr(), out.data_ptr(), T,           H,           hd, (float)eps,
                          (int)sum_lanes};
  dg::Status status;
  {
    py::gil_scoped_release no_gil;
    status = dg::rms_norm_rope_cpu(p);
  }
  raise_if_error(status, op);
}

// ---- linear / gelu_tanh_mul (contracts: ops/linear.h, ops/gelu_tanh_mul.h) ----------------------------------

void linear(const Tensor& x, const Tensor& weight, const Tensor& out) {
  const char* op = "linear";
  check_arg(x, op, "x", {at::kFloat, at::kBFloat16}, 2, /*contiguous=*/false);
  TORCH_CHECK_VALUE(x.size(1) == 0 || x.stride(1) == 1, op, ": `x` needs a contiguous last dim, got shape ",
                    shape_str(x), " strides ", x.strides());
  check_arg(weight, op, "weight", {x.scalar_type()}, 2, /*contiguous=*/false);  // any strides (linear.h)
  TORCH_CHECK_VALUE(weight.size(1) == x.size(1), op, ": `weight` must have shape [N, ", x.size(1), "], got ",
                    shape_str(weight));
  check_arg(out, op, "out", {x.scalar_type()}, 2, /*contiguous=*/false);
  check_shape(out, op, "out", {x.size(0), weight.size(0)});
  TORCH_CHECK_VALUE(out.size(1) == 0 || out.stride(1) == 1, op, ": `out` needs a contiguous last dim");
  check_same_device(x, weight, op, "weight");
  check_same_device(x, out, op, "out");
  dg::LinearParams p{dg_dtype(x), x.data_ptr(),   x.stride(0), weight.data_ptr(), out.data_ptr(),  out.stride(0),
                     x.size(0),   weight.size(0), x.size(1),   weight.stride(0),  weight.stride(1)};
  dispatch(op, x, dg::linear_cpu, DG_CUDA(dg::linear_cuda), p);
}

void gelu_tanh_mul(const Tensor& gate, const Tensor& up, const Tensor& out) {
  const char* op = "gelu_tanh_mul";
  check_arg(gate, op, "gate", {at::kFloat, at::kBFloat16}, 2, /*contiguous=*/false);
  const auto check = [&](const Tensor& t, const char* name) {
    check_arg(t, op, name, {gate.scalar_type()}, 2, /*contiguous=*/false);
    check_shape(t, op, name, gate.sizes());
    TORCH_CHECK_VALUE(t.size(1) <= 1 || t.stride(1) == 1, op, ": `", name, "` needs a contiguous last dim");
    TORCH_CHECK_VALUE(t.device().is_cpu(), op, ": `", name, "` must be a CPU tensor (the op has no CUDA path)");
  };
  check(gate, "gate");
  check(up, "up");
  check(out, "out");
  dg::GeluTanhMulParams p{dg_dtype(gate), gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0),
                          out.data_ptr(), out.stride(0),   gate.size(0),   gate.size(1)};
  dg::Status status;
  {
    py::gil_scoped_release no_gil;
    status = dg::gelu_tanh_mul_cpu(p);
  }
  raise_if_error(status, op);
}

// ---- decode_attention (contract: ops/decode_attention.h) ----------------------------------------------------

// Canvas b's cached keys and values as one span record (ops/decode_attention.h).
void put_span(int64_t* sp, const Tensor& k, const Tensor& v) {
  sp[0] = (int64_t)(intptr_t)k.data_ptr();
  sp[1] = (int64_t)(intptr_t)v.data_ptr();
  sp[2] = k.size(1);
  sp[3] = k.stride(0);
  sp[4] = k.stride(1);
  sp[5] = v.stride(0);
  sp[6] = v.stride(1);
}

// The checks on q, the canvas keys and values and out, then the core over `spans`.
void run_decode_attention(const char* op, const Tensor& q, int64_t B, const std::vector<int64_t>& spans,
                          const Tensor& canvas_keys, const Tensor& canvas_values, int64_t canvas_length,
                          const Tensor& out) {
  const int64_t nh = q.size(0), T = q.size(1), hd = q.size(2), nkv = canvas_keys.size(0);
  check_arg(out, op, "out", {q.scalar_type()}, 2, /*contiguous=*/false);
  check_shape(out, op, "out", {T, nh * hd});
  TORCH_CHECK_VALUE(out.stride(1) == 1 && out.device().is_cpu(), op, ": `out` needs a contiguous last dim (CPU)");
  dg::DecodeAttentionParams p{};
  p.dtype = dg_dtype(q);
  p.q = q.data_ptr();
  p.q_head_stride = q.stride(0);
  p.q_row_stride = q.stride(1);
  p.spans = spans.data();
  p.canvas_keys = canvas_keys.data_ptr();
  p.canvas_values = canvas_values.data_ptr();
  p.ck_head_stride = canvas_keys.stride(0);
  p.ck_row_stride = canvas_keys.stride(1);
  p.cv_head_stride = canvas_values.stride(0);
  p.cv_row_stride = canvas_values.stride(1);
  p.y = out.data_ptr();
  p.y_row_stride = out.stride(0);
  p.canvases = B;
  p.canvas_length = canvas_length;
  p.heads = nh;
  p.kv_heads = nkv;
  p.head_dim = hd;
  dg::Status status;
  {
    py::gil_scoped_release no_gil;
    status = dg::decode_attention_cpu(p);
  }
  raise_if_error(status, op);
}

// q [nh, B*C, hd] and the canvas keys/values [nkv, B*C, hd]: dtype, device, shapes; returns nkv.
int64_t check_decode_queries(const char* op, const Tensor& q, int64_t B, const Tensor& canvas_keys,
                             const Tensor& canvas_values, int64_t canvas_length) {
  check_arg(q, op, "q", {at::kFloat, at::kBFloat16}, 3, /*contiguous=*/false);
  TORCH_CHECK_VALUE(q.device().is_cpu(), op, ": `q` must be a CPU tensor (the op has no CUDA path)");
  TORCH_CHECK_VALUE(q.stride(2) == 1, op, ": `q` [nh, T, hd] needs a contiguous last dim");
  const int64_t nh = q.size(0), T = q.size(1), hd = q.size(2);
  TORCH_CHECK_VALUE(canvas_length >= 1 && T == B * canvas_length, op, ": `q` has ", T, " rows, not ", B,
                    " canvases of ", canvas_length);
  check_arg(canvas_keys, op, "canvas_keys", {q.scalar_type()}, 3, /*contiguous=*/false);
  check_arg(canvas_values, op, "canvas_values", {q.scalar_type()}, 3, /*contiguous=*/false);
  const int64_t nkv = canvas_keys.size(0);
  for (const Tensor* c : {&canvas_keys, &canvas_values}) {
    TORCH_CHECK_VALUE(
        c->size(0) == nkv && c->size(1) == T && c->size(2) == hd && c->stride(2) == 1 && c->device().is_cpu(), op,
        ": canvas keys and values must be CPU [", nkv, ", ", T, ", ", hd, "] with a contiguous last dim, got ",
        shape_str(*c));
  }
  TORCH_CHECK_VALUE(nkv >= 1 && nh % nkv == 0, op, ": ", nh, " query heads are not a multiple of ", nkv, " KV heads");
  return nkv;
}

// Cached keys and values given per canvas, as views [nkv, P_b, hd].
void decode_attention(const Tensor& q, const std::vector<Tensor>& keys, const std::vector<Tensor>& values,
                      const Tensor& canvas_keys, const Tensor& canvas_values, int64_t canvas_length,
                      const Tensor& out) {
  const char* op = "decode_attention";
  const int64_t B = (int64_t)keys.size();
  TORCH_CHECK_VALUE(values.size() == keys.size(), op, ": ", keys.size(), " key tensors but ", values.size(),
                    " value tensors");
  const int64_t nkv = check_decode_queries(op, q, B, canvas_keys, canvas_values, canvas_length);
  const int64_t hd = q.size(2);
  std::vector<int64_t> spans((size_t)(B * dg::kDecodeAttentionSpanFields));
  for (int64_t b = 0; b < B; ++b) {
    const Tensor& k = keys[b];
    const Tensor& v = values[b];
    check_arg(k, op, "keys", {q.scalar_type()}, 3, /*contiguous=*/false);
    check_arg(v, op, "values", {q.scalar_type()}, 3, /*contiguous=*/false);
    TORCH_CHECK_VALUE(k.device().is_cpu() && v.device().is_cpu(), op, ": keys and values must be CPU tensors");
    TORCH_CHECK_VALUE(k.sizes() == v.sizes() && k.size(0) == nkv && k.size(2) == hd, op, ": canvas ", b,
                      "'s cached keys and values must be [", nkv, ", P, ", hd, "], got ", shape_str(k), " and ",
                      shape_str(v));
    TORCH_CHECK_VALUE(k.size(1) == 0 || (k.stride(2) == 1 && v.stride(2) == 1), op,
                      ": keys and values need a contiguous last dim");
    put_span(spans.data() + b * dg::kDecodeAttentionSpanFields, k, v);
  }
  run_decode_attention(op, q, B, spans, canvas_keys, canvas_values, canvas_length, out);
}

// Cached keys and values given as the cache's buffers [slots, nkv, cap, hd] and per canvas (slot, start, count):
// canvas b's are positions start .. start+count-1 of slot `slot` (no view made per canvas).
void decode_attention_slots(const Tensor& q, const Tensor& key_cache, const Tensor& value_cache,
                            const std::vector<std::array<int64_t, 3>>& slots, const Tensor& canvas_keys,
                            const Tensor& canvas_values, int64_t canvas_length, const Tensor& out) {
  const char* op = "decode_attention";
  const int64_t B = (int64_t)slots.size();
  const int64_t nkv = check_decode_queries(op, q, B, canvas_keys, canvas_values, canvas_length);
  check_arg(key_cache, op, "keys", {q.scalar_type()}, 4);
  check_arg(value_cache, op, "values", {q.scalar_type()}, 4);
  TORCH_CHECK_VALUE(key_cache.sizes() == value_cache.sizes() && key_cache.size(1) == nkv &&
                        key_cache.size(3) == q.size(2) && key_cache.device().is_cpu() && value_cache.device().is_cpu(),
                    op, ": the key and value caches must be CPU [slots, ", nkv, ", cap, ", q.size(2), "], got ",
                    shape_str(key_cache), " and ", shape_str(value_cache));
  std::vector<int64_t> spans((size_t)(B * dg::kDecodeAttentionSpanFields));
  // each span is what put_span records of key_cache.select(0, slot).narrow(1, start, count), computed from the
  // strides: no tensor view per canvas (a step asks for B of them per layer)
  const int64_t es = key_cache.element_size();
  const char* kbase = static_cast<const char*>(key_cache.data_ptr());
  const char* vbase = static_cast<const char*>(value_cache.data_ptr());
  for (int64_t b = 0; b < B; ++b) {
    const int64_t slot = slots[b][0], start = slots[b][1], count = slots[b][2];
    TORCH_CHECK_VALUE(
        slot >= 0 && slot < key_cache.size(0) && start >= 0 && count >= 0 && start + count <= key_cache.size(2), op,
        ": canvas ", b, "'s span (slot ", slot, ", start ", start, ", count ", count, ") lies outside the cache ",
        shape_str(key_cache));
    int64_t* sp = spans.data() + b * dg::kDecodeAttentionSpanFields;
    sp[0] = (int64_t)(intptr_t)(kbase + (slot * key_cache.stride(0) + start * key_cache.stride(2)) * es);
    sp[1] = (int64_t)(intptr_t)(vbase + (slot * value_cache.stride(0) + start * value_cache.stride(2)) * es);
    sp[2] = count;
    sp[3] = key_cache.stride(1);
    sp[4] = key_cache.stride(2);
    sp[5] = value_cache.stride(1);
    sp[6] = value_cache.stride(2);
  }
  run_decode_attention(op, q, B, spans, canvas_keys, canvas_values, canvas_length, out);
}

// ---- rope (contract: ops/rope.h) ------------------------------------------------------------------------------

void rope(const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& out) {
  const char* op = "rope";
  check_arg(x, op, "x", {at::kFloat, at::kBFloat16}, 3, /*contiguous=*/false);
  TORCH_CHECK_VALUE(x.device().is_cpu(), op, ": `x` must be a CPU tensor (the op has no CUDA path)");
  const int64_t T = x.size(0), H = x.size(1), hd = x.size(2);
  TORCH_CHECK_VALUE(hd % 2 == 0, op, ": the head dim must be even, got ", hd);
  TORCH_CHECK_VALUE(hd <= 1 || x.stride(2) == 1, op, ": `x` needs a contiguous last dim");
  check_rope_tables(op, x, cos, sin, out);
  dg::RopeParams p{dg_dtype(x),    x.data_ptr(),   x.stride(0), x.stride(1), cos.data_ptr(),
                   sin.data_ptr(), out.data_ptr(), T,           H,           hd};
  dg::Status status;
  {
    py::gil_scoped_release no_gil;
    status = dg::rope_cpu(p);
  }
  raise_if_error(status, op);
}

// ---- softmax_rows (contract: ops/softmax_rows.h) --------------------------------------------------------------

void softmax_rows(const Tensor& x, const Tensor& out) {
  const char* op = "softmax_rows";
  check_arg(x, op, "x", {at::kFloat, at::kBFloat16}, 2, /*contiguous=*/false);
  TORCH_CHECK_VALUE(x.size(1) >= 1 && x.stride(1) == 1, op,
                    ": `x` needs at least one column and a contiguous "
                    "last dim, got shape ",
                    shape_str(x));
  TORCH_CHECK_VALUE(x.device().is_cpu(), op, ": `x` must be a CPU tensor (the op has no CUDA path)");
  check_arg(out, op, "out", {at::kFloat}, 2, /*contiguous=*/false);
  check_shape(out, op, "out", x.sizes());
  TORCH_CHECK_VALUE(out.stride(1) == 1 && out.device().is_cpu(), op, ": `out` needs a contiguous last dim (CPU)");
  dg::SoftmaxRowsParams p{dg_dtype(x),   x.data_ptr(), x.stride(0), out.data_ptr<float>(),
                          out.stride(0), x.size(0),    x.size(1)};
  dg::Status status;
  {
    py::gil_scoped_release no_gil;
    status = dg::softmax_rows_cpu(p);
  }
  raise_if_error(status, op);
}

// ---- softcap (contract: ops/softcap.h) ------------------------------------------------------------------------

void softcap(const Tensor& x, double cap) {
  const char* op = "softcap";
  TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat, op, ": `x` must have dtype float32, got ", x.scalar_type());
  TORCH_CHECK_VALUE(x.is_contiguous(), op, ": `x` must be contiguous, got strides ", x.strides());
  TORCH_CHECK_VALUE(x.device().is_cpu(), op, ": `x` must be a CPU tensor (the op has no CUDA path)");
  dg::SoftcapParams p{x.data_ptr<float>(), x.numel(), (float)cap};
  dg::Status status;
  {
    py::gil_scoped_release no_gil;
    status = dg::softcap_cpu(p);
  }
  raise_if_error(status, op);
}

// ---- canvas_noise / gumbel_noise -----------------------------------------------------------------------------

dg::NoiseParams noise_params(const char* op, const Tensor& seeds, const Tensor& blocks, const Tensor& steps,
                             int64_t canvas_length, int64_t vocab_size) {
  check_arg(seeds, op, "seeds", {at::kLong}, 1);
  const int64_t B = seeds.size(0);
  check_arg(blocks, op, "blocks", {at::kLong}, 1);
  check_shape(blocks, op, "blocks", {B});
  check_arg(steps, op, "steps", {at::kLong}, 1);
  check_shape(steps, op, "steps", {B});
  check_same_device(seeds, blocks, op, "blocks");
  check_same_device(seeds, steps, op, "steps");
  TORCH_CHECK_VALUE(canvas_length >= 0, op, ": `canvas_length` must be >= 0, got ", canvas_length);
  TORCH_CHECK_VALUE(vocab_size >= 1, op, ": `vocab_size` must be >= 1, got ", vocab_size);
  return dg::NoiseParams{
      seeds.data_ptr<int64_t>(), blocks.data_ptr<int64_t>(), steps.data_ptr<int64_t>(), B, canvas_length, vocab_size};
}

void canvas_noise(const Tensor& seeds, const Tensor& blocks, const Tensor& steps, int64_t canvas_length,
                  int64_t vocab_size, const Tensor& out) {
  const char* op = "canvas_noise";
  const dg::NoiseParams p = noise_params(op, seeds, blocks, steps, canvas_length, vocab_size);
  check_arg(out, op, "out", {at::kLong}, 2);
  check_shape(out, op, "out", {p.batch, canvas_length});
  check_same_device(seeds, out, op, "out");
  int64_t* o = out.data_ptr<int64_t>();
  dispatch(op, seeds, dg::canvas_noise_cpu, DG_CUDA(dg::canvas_noise_cuda), p, o);
}

void gumbel_noise(const Tensor& seeds, const Tensor& blocks, const Tensor& steps, int64_t canvas_length,
                  int64_t vocab_size, const Tensor& out) {
  const char* op = "gumbel_noise";
  const dg::NoiseParams p = noise_params(op, seeds, blocks, steps, canvas_length, vocab_size);
  check_arg(out, op, "out", {at::kFloat}, 3);
  check_shape(out, op, "out", {p.batch, canvas_length, vocab_size});
  check_same_device(seeds, out, op, "out");
  float* o = out.data_ptr<float>();
  dispatch(op, seeds, dg::gumbel_noise_cpu, DG_CUDA(dg::gumbel_noise_cuda), p, o);
}

// ---- diffusion_step ---------------------------------------------------------------------------------------

void diffusion_step(const Tensor& logits, const Tensor& temperature, const Tensor& seeds, const Tensor& blocks,
                    const Tensor& steps, const Tensor& entropy_bound, const Tensor& canvas, const Tensor& argmax,
                    const Tensor& entropy, const Tensor& accepted, const Tensor& mean_entropy, const Tensor& processed,
                    int64_t sum_lanes, const std::optional<Tensor>& bitmask) {
  const char* op = "diffusion_step";
  check_arg(logits, op, "logits", {at::kFloat, at::kBFloat16}, 3, /*contiguous=*/false);
  const int64_t B = logits.size(0), C = logits.size(1), V = logits.size(2);
  TORCH_CHECK_VALUE(C >= 1 && V >= 1, op, ": `logits` must have C >= 1 and V >= 1, got shape ", shape_str(logits));
  TORCH_CHECK_VALUE(logits.stride(2) == 1, op, ": `logits` needs a contiguous vocabulary dim, got strides ",
                    logits.strides());
  const struct {
    const Tensor& t;
    const char* name;
    at::ScalarType dtype;
    std::vector<int64_t> shape;
  } args[] = {
      {temperature, "temperature", at::kFloat, {B}},
      {seeds, "seeds", at::kLong, {B}},
      {blocks, "blocks", at::kLong, {B}},
      {steps, "steps", at::kLong, {B}},
      {entropy_bound, "entropy_bound", at::kFloat, {B}},
      {canvas, "canvas", at::kLong, {B, C}},
      {argmax, "argmax", at::kLong, {B, C}},
      {entropy, "entropy", at::kFloat, {B, C}},
      {accepted, "accepted", at::kBool, {B, C}},
      {mean_entropy, "mean_entropy", at::kFloat, {B}},
      {processed, "processed", at::kFloat, {B, C, V}},
  };
  for (const auto& a : args) {
    check_arg(a.t, op, a.name, {a.dtype}, (int64_t)a.shape.size());
    check_shape(a.t, op, a.name, a.shape);
    check_same_device(logits, a.t, op, a.name);
  }
  if (bitmask.has_value()) {
    const Tensor& m = *bitmask;
    check_arg(m, op, "bitmask", {at::kInt}, 3);
    check_shape(m, op, "bitmask", {B, C, dg::bitmask_words(V)});
    check_same_device(logits, m, op, "bitmask");
  }
  dg::DiffusionStepParams p{};
  p.bitmask = bitmask.has_value() ? bitmask->data_ptr<int32_t>() : nullptr;
  p.logits_dtype = dg_dtype(logits);
  p.logits = logits.data_ptr();
  p.logits_stride_b = logits.stride(0);
  p.logits_stride_c = logits.stride(1);
  p.temperature = temperature.data_ptr<float>();
  p.seeds = seeds.data_ptr<int64_t>();
  p.blocks = blocks.data_ptr<int64_t>();
  p.steps = steps.data_ptr<int64_t>();
  p.entropy_bound = entropy_bound.data_ptr<float>();
  p.canvas = canvas.data_ptr<int64_t>();
  p.argmax = argmax.data_ptr<int64_t>();
  p.entropy = entropy.data_ptr<float>();
  p.accepted = reinterpret_cast<uint8_t*>(accepted.data_ptr<bool>());
  p.mean_entropy = mean_entropy.data_ptr<float>();
  p.processed = processed.data_ptr<float>();
  p.batch = B;
  p.canvas_length = C;
  p.vocab_size = V;
  p.sum_lanes = (int)sum_lanes;
  dispatch(op, logits, dg::diffusion_step_cpu, DG_CUDA(dg::diffusion_step_cuda), p);
}

// ---- moe_route / moe_align / moe_experts / moe_combine (contracts: ops/moe_*.h) --------------------------------

void moe_route(const Tensor& scores, const Tensor& per_expert_scale, int64_t top_k, bool from_logits,
               const Tensor& weights, const Tensor& ids, int64_t sum_lanes) {
  const char* op = "moe_route";
  check_arg(scores, op, "scores", {at::kFloat, at::kBFloat16}, 2, /*contiguous=*/false);
  TORCH_CHECK_VALUE(scores.stride(1) == 1, op, ": `scores` needs a contiguous expert dim, got strides ",
                    scores.strides());
  const int64_t T = scores.size(0), E = scores.size(1);
  TORCH_CHECK_VALUE(E >= 1 && top_k >= 1 && top_k <= E, op, ": `top_k` must be in [1, experts=", E, "], got ", top_k);
  check_arg(per_expert_scale, op, "per_expert_scale", {at::kFloat}, 1);
  check_shape(per_expert_scale, op, "per_expert_scale", {E});
  check_arg(weights, op, "weights", {at::kFloat}, 2);
  check_shape(weights, op, "weights", {T, top_k});
  check_arg(ids, op, "ids", {at::kLong}, 2);
  check_shape(ids, op, "ids", {T, top_k});
  for (const Tensor* t : {&per_expert_scale, &weights, &ids}) check_same_device(scores, *t, op, "outputs/scale");
  const dg::MoeRouteParams p{dg_dtype(scores),
                             scores.data_ptr(),
                             scores.stride(0),
                             from_logits,
                             per_expert_scale.data_ptr<float>(),
                             weights.data_ptr<float>(),
                             ids.data_ptr<int64_t>(),
                             T,
                             E,
                             top_k,
                             (int)sum_lanes};
  dispatch(op, scores, dg::moe_route_cpu, DG_CUDA(dg::moe_route_cuda), p);
}

void moe_align(const Tensor& ids, int64_t experts, int64_t block_size, const Tensor& counts, const Tensor& offsets,
               const Tensor& sorted_pairs, const Tensor& block_expert) {
  const char* op = "moe_align";
  check_arg(ids, op, "ids", {at::kLong}, 2);
  TORCH_CHECK_VALUE(experts >= 1 && block_size >= 1, op, ": `experts` and `block_size` must be >= 1, got ", experts,
                    ", ", block_size);
  const int64_t P = ids.numel(), cap = dg::moe_align_capacity(P, experts, block_size);
  const struct {
    const Tensor& t;
    const char* name;
    int64_t size;
  } outs[] = {{counts, "counts", experts},
              {offsets, "offsets", experts + 1},
              {sorted_pairs, "sorted_pairs", cap},
              {block_expert, "block_expert", cap / block_size}};
  for (const auto& o : outs) {
    check_arg(o.t, op, o.name, {at::kInt}, 1);
    check_shape(o.t, op, o.name, {o.size});
    check_same_device(ids, o.t, op, o.name);
  }
  const dg::MoeAlignParams p{ids.data_ptr<int64_t>(),
                             counts.data_ptr<int32_t>(),
                             offsets.data_ptr<int32_t>(),
                             sorted_pairs.data_ptr<int32_t>(),
                             block_expert.data_ptr<int32_t>(),
                             P,
                             experts,
                             block_size};
  dispatch(op, ids, dg::moe_align_cpu, DG_CUDA(dg::moe_align_cuda), p);
}

void moe_experts(const Tensor& x, const Tensor& gate_up, const Tensor& down, const Tensor& weights,
                 const Tensor& counts, const Tensor& offsets, const Tensor& sorted_pairs, const Tensor& act,
                 const Tensor& y) {
  const char* op = "moe_experts";
  check_arg(x, op, "x", {at::kFloat, at::kBFloat16}, 2);
  const int64_t T = x.size(0), H = x.size(1);
  check_arg(gate_up, op, "gate_up", {x.scalar_type()}, 3);
  const int64_t E = gate_up.size(0), I = gate_up.size(1) / 2;
  TORCH_CHECK_VALUE(I >= 1 && gate_up.size(1) == 2 * I && gate_up.size(2) == H, op,
                    ": `gate_up` must have shape [E, 2I, ", H, "], got ", shape_str(gate_up));
  check_arg(down, op, "down", {x.scalar_type()}, 3);
  check_shape(down, op, "down", {E, H, I});
  check_arg(weights, op, "weights", {at::kFloat}, 2);
  TORCH_CHECK_VALUE(weights.size(0) == T && weights.size(1) >= 1, op, ": `weights` must have shape [", T, ", K], got ",
                    shape_str(weights));
  const int64_t K = weights.size(1);
  check_arg(counts, op, "counts", {at::kInt}, 1);
  check_shape(counts, op, "counts", {E});
  check_arg(offsets, op, "offsets", {at::kInt}, 1);
  check_shape(offsets, op, "offsets", {E + 1});
  check_arg(sorted_pairs, op, "sorted_pairs", {at::kInt}, 1);
  const int64_t cap = sorted_pairs.size(0);
  check_arg(act, op, "act", {x.scalar_type()}, 2);
  check_shape(act, op, "act", {cap, I});
  check_arg(y, op, "y", {at::kFloat}, 2);
  check_shape(y, op, "y", {T * K, H});
  const struct {
    const Tensor& t;
    const char* name;
  } same[] = {{gate_up, "gate_up"}, {down, "down"},
              {weights, "weights"}, {counts, "counts"},
              {offsets, "offsets"}, {sorted_pairs, "sorted_pairs"},
              {act, "act"},         {y, "y"}};
  for (const auto& a : same) check_same_device(x, a.t, op, a.name);
  const dg::MoeExpertsParams p{dg_dtype(x),
                               x.data_ptr(),
                               gate_up.data_ptr(),
                               down.data_ptr(),
                               weights.data_ptr<float>(),
                               counts.data_ptr<int32_t>(),
                               offsets.data_ptr<int32_t>(),
                               sorted_pairs.data_ptr<int32_t>(),
                               act.data_ptr(),
                               y.data_ptr<float>(),
                               T,
                               K,
                               E,
                               H,
                               I,
                               cap};
  dispatch(op, x, dg::moe_experts_cpu, DG_CUDA(dg::moe_experts_cuda), p);
}

void moe_combine(const Tensor& y, const std::optional<Tensor>& weights, const Tensor& out) {
  const char* op = "moe_combine";
  check_arg(y, op, "y", {at::kFloat}, 3);
  const int64_t T = y.size(0), K = y.size(1), H = y.size(2);
  TORCH_CHECK_VALUE(K >= 1, op, ": `y` must have K >= 1, got shape ", shape_str(y));
  const float* w = nullptr;
  if (weights.has_value()) {
    check_arg(*weights, op, "weights", {at::kFloat}, 2);
    check_shape(*weights, op, "weights", {T, K});
    check_same_device(y, *weights, op, "weights");
    w = weights->data_ptr<float>();
  }
  check_arg(out, op, "out", {at::kFloat, at::kBFloat16}, 2);
  check_shape(out, op, "out", {T, H});
  check_same_device(y, out, op, "out");
  const dg::MoeCombineParams p{y.data_ptr<float>(), w, dg_dtype(out), out.data_ptr(), T, K, H};
  dispatch(op, y, dg::moe_combine_cpu, DG_CUDA(dg::moe_combine_cuda), p);
}

// ---- nvfp4_repack / nvfp4_decode / nvfp4_moe_experts (contracts: ops/nvfp4_*.h) ---------------------------

void nvfp4_repack(const Tensor& weight, const Tensor& scale, int64_t interleave_half, const Tensor& words,
                  const Tensor& scales) {
  const char* op = "nvfp4_repack";
  check_arg(weight, op, "weight", {at::kByte}, 3);
  const int64_t E = weight.size(0), N = weight.size(1), kp = 2 * weight.size(2), kc = (kp + 63) / 64;
  TORCH_CHECK_VALUE(N % 16 == 0 && kp % 16 == 0, op, ": `weight` must be [E, N, Kp/2] with N and Kp multiples of ",
                    "16, got ", shape_str(weight));
  check_arg(scale, op, "scale", {at::kByte}, 3);
  check_shape(scale, op, "scale", {E, N, kp / 16});
  check_arg(words, op, "words", {at::kInt}, 4);
  check_shape(words, op, "words", {E, N / 16, kc, 128});
  check_arg(scales, op, "scales", {at::kByte}, 4);
  check_shape(scales, op, "scales", {E, N / 16, kc, 64});
  check_same_device(weight, scale, op, "scale");
  check_same_device(weight, words, op, "words");
  check_same_device(weight, scales, op, "scales");
  const dg::Nvfp4RepackParams p{weight.data_ptr<uint8_t>(),
                                scale.data_ptr<uint8_t>(),
                                reinterpret_cast<uint32_t*>(words.data_ptr<int32_t>()),
                                scales.data_ptr<uint8_t>(),
                                E,
                                N,
                                kp,
                                interleave_half};
  dispatch(op, weight, dg::nvfp4_repack_cpu, DG_CUDA(dg::nvfp4_repack_cuda), p);
}

void nvfp4_decode(const Tensor& words, const Tensor& scales, const Tensor& out) {
  const char* op = "nvfp4_decode";
  check_arg(words, op, "words", {at::kInt}, 4);
  const int64_t E = words.size(0), RT = words.size(1), KC = words.size(2);
  check_shape(words, op, "words", {E, RT, KC, 128});
  check_arg(scales, op, "scales", {at::kByte}, 4);
  check_shape(scales, op, "scales", {E, RT, KC, 64});
  check_arg(out, op, "out", {at::kBFloat16}, 3);
  check_shape(out, op, "out", {E, RT * 16, KC * 64});
  check_same_device(words, scales, op, "scales");
  check_same_device(words, out, op, "out");
  const dg::Nvfp4DecodeParams p{reinterpret_cast<const uint32_t*>(words.data_ptr<int32_t>()),
                                scales.data_ptr<uint8_t>(),
                                reinterpret_cast<dg::bf16*>(out.data_ptr()),
                                E,
                                RT * 16,
                                KC};
  dispatch(op, words, dg::nvfp4_decode_cpu, DG_CUDA(dg::nvfp4_decode_cuda), p);
}

void nvfp4_moe_experts(const Tensor& x, const Tensor& w13, const Tensor& s13, const Tensor& w2, const Tensor& s2,
                       const Tensor& gs, const Tensor& weights, const Tensor& offsets, const Tensor& sorted_pairs,
                       const Tensor& act, const Tensor& y) {
  const char* op = "nvfp4_moe_experts";
  check_arg(x, op, "x", {at::kBFloat16, at::kFloat}, 2, /*contiguous=*/false);
  TORCH_CHECK_VALUE(x.stride(1) == 1, op, ": `x` needs a contiguous last dim, got strides ", x.strides());
  const int64_t T = x.size(0), H = x.size(1);
  check_arg(w13, op, "w13", {at::kInt}, 4);
  const int64_t E = w13.size(0), I = w13.size(1) * 8;
  TORCH_CHECK_VALUE(E >= 1 && I >= 8 && H % 16 == 0, op, ": need E >= 1 experts, I >= 8 and hidden % 16 == 0, got ",
                    "w13 ", shape_str(w13), ", x ", shape_str(x));
  const int64_t kc1 = dg::nvfp4_chunks(H), kc2 = dg::nvfp4_chunks(I);
  check_shape(w13, op, "w13", {E, 2 * I / 16, kc1, 128});
  check_arg(s13, op, "s13", {at::kByte}, 4);
  check_shape(s13, op, "s13", {E, 2 * I / 16, kc1, 64});
  check_arg(w2, op, "w2", {at::kInt}, 4);
  check_shape(w2, op, "w2", {E, H / 16, kc2, 128});
  check_arg(s2, op, "s2", {at::kByte}, 4);
  check_shape(s2, op, "s2", {E, H / 16, kc2, 64});
  check_arg(gs, op, "gs", {at::kFloat}, 2);
  check_shape(gs, op, "gs", {E, 3});
  check_arg(weights, op, "weights", {at::kFloat}, 2);
  TORCH_CHECK_VALUE(weights.size(0) == T && weights.size(1) >= 1, op, ": `weights` must have shape [", T, ", K], got ",
                    shape_str(weights));
  const int64_t K = weights.size(1);
  check_arg(offsets, op, "offsets", {at::kInt}, 1);
  check_shape(offsets, op, "offsets", {E + 1});
  check_arg(sorted_pairs, op, "sorted_pairs", {at::kInt}, 1);
  const int64_t P = sorted_pairs.size(0);
  check_arg(act, op, "act", {at::kBFloat16}, 2);
  check_shape(act, op, "act", {P, I});
  check_arg(y, op, "y", {at::kFloat}, 2);
  check_shape(y, op, "y", {T * K, H});
  const struct {
    const Tensor& t;
    const char* name;
  } same[] = {{w13, "w13"},         {s13, "s13"},
              {w2, "w2"},           {s2, "s2"},
              {gs, "gs"},           {weights, "weights"},
              {offsets, "offsets"}, {sorted_pairs, "sorted_pairs"},
              {act, "act"},         {y, "y"}};
  for (const auto& a : same) check_same_device(x, a.t, op, a.name);
  const dg::Nvfp4MoeParams p{dg_dtype(x),
                             x.data_ptr(),
                             x.stride(0),
                             reinterpret_cast<const uint32_t*>(w13.data_ptr<int32_t>()),
                             s13.data_ptr<uint8_t>(),
                             reinterpret_cast<const uint32_t*>(w2.data_ptr<int32_t>()),
                             s2.data_ptr<uint8_t>(),
                             gs.data_ptr<float>(),
                             weights.data_ptr<float>(),
                             sorted_pairs.data_ptr<int32_t>(),
                             offsets.data_ptr<int32_t>(),
                             reinterpret_cast<dg::bf16*>(act.data_ptr()),
                             y.data_ptr<float>(),
                             T,
                             K,
                             E,
                             H,
                             I,
                             P};
  dispatch(op, x, dg::nvfp4_moe_experts_cpu, DG_CUDA(dg::nvfp4_moe_experts_cuda), p);
}

// ---- test hooks (CPU) ----------------------------------------------------------------------------------------

void philox4x32_10(const Tensor& ctr, const Tensor& key, const Tensor& out) {
  const char* op = "philox4x32_10";
  check_arg(ctr, op, "ctr", {at::kLong}, 2);
  TORCH_CHECK_VALUE(ctr.size(1) == 4, op, ": `ctr` must have shape [n, 4], got ", shape_str(ctr));
  check_arg(key, op, "key", {at::kLong}, 2);
  check_shape(key, op, "key", {ctr.size(0), 2});
  check_arg(out, op, "out", {at::kLong}, 2);
  check_shape(out, op, "out", {ctr.size(0), 4});
  TORCH_CHECK_VALUE(ctr.device().is_cpu() && key.device().is_cpu() && out.device().is_cpu(), op,
                    ": test hook takes CPU tensors");
  raise_if_error(
      dg::philox_hook(ctr.data_ptr<int64_t>(), key.data_ptr<int64_t>(), out.data_ptr<int64_t>(), ctr.size(0)), op);
}

void dg_logf(const Tensor& x, const Tensor& out) {
  const char* op = "dg_logf";
  check_arg(x, op, "x", {at::kFloat}, 1);
  check_arg(out, op, "out", {at::kFloat}, 1);
  check_shape(out, op, "out", x.sizes());
  TORCH_CHECK_VALUE(x.device().is_cpu() && out.device().is_cpu(), op, ": test hook takes CPU tensors");
  py::gil_scoped_release no_gil;
  (void)dg::dg_logf_hook(x.data_ptr<float>(), out.data_ptr<float>(), x.numel());
}

// the gumbel and gumbel_bound test hooks: out [n] fp32 = hook(r [n] int64)
void noise_of_words(const char* op, const Tensor& r, const Tensor& out,
                    dg::Status (*hook)(const int64_t*, float*, int64_t)) {
  check_arg(r, op, "r", {at::kLong}, 1);
  check_arg(out, op, "out", {at::kFloat}, 1);
  check_shape(out, op, "out", r.sizes());
  TORCH_CHECK_VALUE(r.device().is_cpu() && out.device().is_cpu(), op, ": test hook takes CPU tensors");
  raise_if_error(hook(r.data_ptr<int64_t>(), out.data_ptr<float>(), r.numel()), op);
}

void gumbel(const Tensor& r, const Tensor& out) { noise_of_words("gumbel", r, out, dg::gumbel_hook); }

void gumbel_bound(const Tensor& r, const Tensor& out) { noise_of_words("gumbel_bound", r, out, dg::gumbel_bound_hook); }

// The ops whose CUDA launcher this build links, as build_info()["cuda_ops"]: one entry per op whose dispatch above
// names DG_CUDA(dg::<op>_cuda) (tests/ops/test_op_surface.py checks the two agree). Taking each launcher's address
// makes a missing definition a link error; CI builds the CUDA extension and compares this list with
// dgserve.ops.NATIVE_OPS (dgserve.ops.native.missing_cuda_ops), so an op without its CUDA path fails there.
#if defined(DG_WITH_CUDA)
struct CudaOp {
  const char* name;
  const void* launcher;
};
const CudaOp kCudaOps[] = {
    {"rms_norm", reinterpret_cast<const void*>(&dg::rms_norm_cuda)},
    {"canvas_noise", reinterpret_cast<const void*>(&dg::canvas_noise_cuda)},
    {"gumbel_noise", reinterpret_cast<const void*>(&dg::gumbel_noise_cuda)},
    {"diffusion_step", reinterpret_cast<const void*>(&dg::diffusion_step_cuda)},
    {"moe_route", reinterpret_cast<const void*>(&dg::moe_route_cuda)},
    {"moe_align", reinterpret_cast<const void*>(&dg::moe_align_cuda)},
    {"moe_experts", reinterpret_cast<const void*>(&dg::moe_experts_cuda)},
    {"moe_combine", reinterpret_cast<const void*>(&dg::moe_combine_cuda)},
    {"nvfp4_repack", reinterpret_cast<const void*>(&dg::nvfp4_repack_cuda)},
    {"nvfp4_moe_experts", reinterpret_cast<const void*>(&dg::nvfp4_moe_experts_cuda)},
};
#endif

py::dict build_info() {
  py::dict d;
  d["cpu_level"] = dg::get_cpu_level();
  py::list cuda_ops;
#if defined(DG_WITH_CUDA)
  d["cuda"] = true;
  for (const CudaOp& op : kCudaOps) {
    if (op.launcher != nullptr) cuda_ops.append(op.name);
  }
#else
  d["cuda"] = false;
#endif
  d["cuda_ops"] = cuda_ops;
  d["gumbel_max"] = dg::kGumbelMax;
  d["diffusion_step_max_canvas_cuda"] = dg::kDiffusionStepMaxCanvasCuda;
#if defined(_OPENMP)
  d["openmp"] = true;
#else
  d["openmp"] = false;
#endif
  return d;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "dgserve native ops (see csrc/ops/*.h for each contract); call through dgserve.ops";
  m.def("rms_norm", &rms_norm, "RMSNorm x [rows, D] (fp32|bf16) with weight [D] fp32 or None into out [rows, D]",
        py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("out"), py::arg("sum_lanes") = 8);
  m.def("canvas_noise", &canvas_noise, "contract canvas tokens into out [B, C] int64 (docs/seeded-noise.md)",
        py::arg("seeds"), py::arg("blocks"), py::arg("steps"), py::arg("canvas_length"), py::arg("vocab_size"),
        py::arg("out"));
  m.def("gumbel_noise", &gumbel_noise, "contract Gumbel noise into out [B, C, V] fp32 (docs/seeded-noise.md, dg_logf)",
        py::arg("seeds"), py::arg("blocks"), py::arg("steps"), py::arg("canvas_length"), py::arg("vocab_size"),
        py::arg("out"));
  m.def("diffusion_step", &diffusion_step,
        "fused sampler step over logits [B, C, V] into preallocated canvas, argmax, entropy, accepted, "
        "mean_entropy, processed; optional token bitmask [B, C, ceil(V/32)] int32 (bit set = allowed)",
        py::arg("logits"), py::arg("temperature"), py::arg("seeds"), py::arg("blocks"), py::arg("steps"),
        py::arg("entropy_bound"), py::arg("canvas"), py::arg("argmax"), py::arg("entropy"), py::arg("accepted"),
        py::arg("mean_entropy"), py::arg("processed"), py::arg("sum_lanes") = 8, py::arg("bitmask") = py::none());
  m.def("linear", &linear,
        "batch-invariant y [T, N] = x [T, K] · weight [N, K]^T (fp32|bf16, fp32 accumulation in k order, one "
        "rounding) into out",
        py::arg("x"), py::arg("weight"), py::arg("out"));
  m.def("decode_attention", &decode_attention,
        "the decoder's attention of B canvases (q [nh, B*C, hd]) each over its cached keys/values [nkv, P_b, hd] "
        "then its canvas's (rows of canvas_keys/values [nkv, B*C, hd]) into out [B*C, nh*hd]; a fixed order per "
        "element, batch-invariant (CPU)",
        py::arg("q"), py::arg("keys"), py::arg("values"), py::arg("canvas_keys"), py::arg("canvas_values"),
        py::arg("canvas_length"), py::arg("out"));
  m.def("decode_attention", &decode_attention_slots,
        "the same with the cached keys/values as the cache's buffers [slots, nkv, cap, hd] and per canvas its "
        "(slot, start, count)",
        py::arg("q"), py::arg("keys"), py::arg("values"), py::arg("slots"), py::arg("canvas_keys"),
        py::arg("canvas_values"), py::arg("canvas_length"), py::arg("out"));
  m.def("rms_norm_add", &rms_norm_add,
        "out [rows, dim] = rnd(residual + rms_norm(x; weight)), then rnd(out * scale) with a scale: one pass, "
        "bit-identical to the reference (CPU)",
        py::arg("residual"), py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("scale"), py::arg("out"),
        py::arg("sum_lanes"));
  m.def("rms_norm_rope", &rms_norm_rope,
        "out [T, heads, hd] = rope(rms_norm(x[t, h]; weight), cos, sin): one pass, bit-identical to the reference "
        "(CPU)",
        py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("cos"), py::arg("sin"), py::arg("out"),
        py::arg("sum_lanes"));
  m.def("rope", &rope,
        "out [T, heads, hd] = rotate-half RoPE of x with cos, sin [T, hd], rounded to the dtype after each product "
        "and the sum (CPU)",
        py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("out"));
  m.def("softmax_rows", &softmax_rows,
        "out [rows, V] fp32 = softmax of each row of x (fp32|bf16), one fixed sequence per row (CPU)", py::arg("x"),
        py::arg("out"));
  m.def("softcap", &softcap, "x = tanh(x / cap) * cap in place over fp32 x, one fixed tanh formula (CPU)", py::arg("x"),
        py::arg("cap"));
  m.def("gelu_tanh_mul", &gelu_tanh_mul,
        "out [rows, cols] = rnd(rnd(gelu_tanh(gate)) * up), one fixed scalar GELU-tanh formula (CPU)", py::arg("gate"),
        py::arg("up"), py::arg("out"));
  m.def("moe_route", &moe_route,
        "router top-k from scores [T, E] (fp32 probabilities, or logits with from_logits) into weights [T, K] "
        "fp32 and ids [T, K] int64",
        py::arg("scores"), py::arg("per_expert_scale"), py::arg("top_k"), py::arg("from_logits"), py::arg("weights"),
        py::arg("ids"), py::arg("sum_lanes") = 8);
  m.def("moe_align", &moe_align,
        "group the pairs of ids [T, K] by expert into counts [E], offsets [E+1], sorted_pairs [cap], "
        "block_expert [cap / block_size] (int32)",
        py::arg("ids"), py::arg("experts"), py::arg("block_size"), py::arg("counts"), py::arg("offsets"),
        py::arg("sorted_pairs"), py::arg("block_expert"));
  m.def("moe_experts", &moe_experts,
        "grouped expert GEMMs: act [cap, I] md and weighted expert outputs y [T*K, H] fp32 for moe_align's groups",
        py::arg("x"), py::arg("gate_up"), py::arg("down"), py::arg("weights"), py::arg("counts"), py::arg("offsets"),
        py::arg("sorted_pairs"), py::arg("act"), py::arg("y"));
  m.def("moe_combine", &moe_combine,
        "out [T, H] = rnd(sum_k y[:, k] * weights[:, k]) in slot order (weights None: y already weighted)",
        py::arg("y"), py::arg("weights"), py::arg("out"));
  m.def("philox4x32_10", &philox4x32_10, "test hook: Philox4x32-10 of ctr [n, 4] and key [n, 2] into out [n, 4]",
        py::arg("ctr"), py::arg("key"), py::arg("out"));
  m.def("dg_logf", &dg_logf, "test hook: the contract's float32 log of x [n] into out [n]", py::arg("x"),
        py::arg("out"));
  m.def("gumbel", &gumbel, "test hook: Gumbel value of Philox words r [n] (int64) into out [n] fp32", py::arg("r"),
        py::arg("out"));
  m.def("gumbel_bound", &gumbel_bound,
        "test hook: the log-free upper bound of the Gumbel value of Philox words r [n] (int64) into out [n] fp32",
        py::arg("r"), py::arg("out"));
  m.def("nvfp4_repack", &nvfp4_repack,
        "ModelOpt NVFP4 weight [E, N, Kp/2] u8 + scale [E, N, Kp/16] u8 (E4M3 bytes) -> kernel layout words "
        "[E, N/16, KC, 128] i32 + scales [E, N/16, KC, 64] u8 (interleave_half = N/2 for gate/up, else 0)",
        py::arg("weight"), py::arg("scale"), py::arg("interleave_half"), py::arg("words"), py::arg("scales"));
  m.def("nvfp4_decode", &nvfp4_decode,
        "test hook: the kernels' bf16 MMA operands E2M1*s*2^-7 of words/scales into out [E, N, 64*KC] bf16",
        py::arg("words"), py::arg("scales"), py::arg("out"));
  m.def("nvfp4_moe_experts", &nvfp4_moe_experts,
        "grouped W4A16 expert MLP on repacked NVFP4 weights: act [P, I] bf16 workspace, y [T*K, H] fp32 by pair "
        "(weighted by the routing weight)",
        py::arg("x"), py::arg("w13"), py::arg("s13"), py::arg("w2"), py::arg("s2"), py::arg("gs"), py::arg("weights"),
        py::arg("offsets"), py::arg("sorted_pairs"), py::arg("act"), py::arg("y"));
  m.def("build_info", &build_info,
        "what this build contains: {'cuda': bool, 'cuda_ops': [ops whose CUDA launcher is linked], 'openmp': bool, "
        "'cpu_level': 0 baseline | 1 AVX2 | 2 AVX-512, 'gumbel_max': float, 'diffusion_step_max_canvas_cuda': int}");
  m.def("_set_cpu_level", &dg::set_cpu_level,
        "test hook: force the CPU code path (0 baseline, 1 AVX2+FMA, 2 AVX-512; -1 automatic); returns the level "
        "in use",
        py::arg("level"));
}
