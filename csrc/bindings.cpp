// dgserve._C: the only translation unit that sees Python and torch. For every op it validates the tensors
// once (dtype, device, shape, contiguity; messages name the op and the argument), extracts pointers and
// sizes into the core's parameters, releases the GIL around CPU cores, runs the core on the current CUDA
// stream for CUDA tensors, and turns a non-Ok Status into ValueError (InvalidArgument) or RuntimeError.
// Outputs are allocated by the caller (dgserve.ops) and passed in.
#include <torch/extension.h>

#include <sstream>
#include <string>

#include "common/dtype.h"
#include "common/status.h"
#include "ops/canvas_noise.h"
#include "ops/diffusion_step.h"
#include "ops/gumbel_noise.h"
#include "ops/noise_hooks.h"
#include "ops/rms_norm.h"

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
    TORCH_CHECK_VALUE(t.is_contiguous(), op, ": `", name, "` must be contiguous (shape ", shape_str(t),
                      ", strides ", t.strides(), ")");
  }
}

void check_shape(const Tensor& t, const char* op, const char* name, at::IntArrayRef expected) {
  TORCH_CHECK_VALUE(t.sizes() == expected, op, ": `", name, "` must have shape ", expected, ", got ",
                    shape_str(t));
}

void check_same_device(const Tensor& ref, const Tensor& t, const char* op, const char* name) {
  TORCH_CHECK_VALUE(t.device() == ref.device(), op, ": `", name, "` is on ", t.device(), " but the inputs are on ",
                    ref.device());
}

// Runs `cpu()` without the GIL for CPU tensors, or `cuda(stream)` on the current stream of `ref`'s device.
template <class CpuFn, class CudaFn>
dg::Status run_on_device(const Tensor& ref, const char* op, CpuFn cpu, CudaFn cuda) {
  if (ref.device().is_cpu()) {
    py::gil_scoped_release no_gil;
    return cpu();
  }
#if defined(DG_WITH_CUDA)
  if (ref.device().is_cuda()) {
    const c10::cuda::CUDAGuard guard(ref.device());
    return cuda(static_cast<void*>(c10::cuda::getCurrentCUDAStream(ref.device().index()).stream()));
  }
#else
  (void)cuda;
#endif
  TORCH_CHECK_VALUE(false, op, ": tensors on ", ref.device(), " are not supported by this build of dgserve._C");
  return dg::Status::Ok();
}

dg::DType dg_dtype(const Tensor& t) {
  return t.scalar_type() == at::kBFloat16 ? dg::DType::kBFloat16 : dg::DType::kFloat32;
}

// ---- rms_norm --------------------------------------------------------------------------------------------

void rms_norm(const Tensor& x, const std::optional<Tensor>& weight, double eps, const Tensor& out,
              int64_t sum_lanes) {
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
  dg::RmsNormParams p{dg_dtype(x), x.data_ptr(), x.stride(0), w, out.data_ptr(), out.stride(0),
                      x.size(0), x.size(1), (float)eps, (int)sum_lanes};
  raise_if_error(run_on_device(x, op, [&] { return dg::rms_norm_cpu(p); },
                               [&](void* s) {
#if defined(DG_WITH_CUDA)
                                 return dg::rms_norm_cuda(p, s);
#else
                                 (void)s;
                                 return dg::Status::Ok();
#endif
                               }),
                 op);
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
  return dg::NoiseParams{seeds.data_ptr<int64_t>(), blocks.data_ptr<int64_t>(), steps.data_ptr<int64_t>(), B,
                         canvas_length, vocab_size};
}

void canvas_noise(const Tensor& seeds, const Tensor& blocks, const Tensor& steps, int64_t canvas_length,
                  int64_t vocab_size, const Tensor& out) {
  const char* op = "canvas_noise";
  const dg::NoiseParams p = noise_params(op, seeds, blocks, steps, canvas_length, vocab_size);
  check_arg(out, op, "out", {at::kLong}, 2);
  check_shape(out, op, "out", {p.batch, canvas_length});
  check_same_device(seeds, out, op, "out");
  int64_t* o = out.data_ptr<int64_t>();
  raise_if_error(run_on_device(seeds, op, [&] { return dg::canvas_noise_cpu(p, o); },
                               [&](void* s) {
#if defined(DG_WITH_CUDA)
                                 return dg::canvas_noise_cuda(p, o, s);
#else
                                 (void)s;
                                 return dg::Status::Ok();
#endif
                               }),
                 op);
}

void gumbel_noise(const Tensor& seeds, const Tensor& blocks, const Tensor& steps, int64_t canvas_length,
                  int64_t vocab_size, const Tensor& out) {
  const char* op = "gumbel_noise";
  const dg::NoiseParams p = noise_params(op, seeds, blocks, steps, canvas_length, vocab_size);
  check_arg(out, op, "out", {at::kFloat}, 3);
  check_shape(out, op, "out", {p.batch, canvas_length, vocab_size});
  check_same_device(seeds, out, op, "out");
  float* o = out.data_ptr<float>();
  raise_if_error(run_on_device(seeds, op, [&] { return dg::gumbel_noise_cpu(p, o); },
                               [&](void* s) {
#if defined(DG_WITH_CUDA)
                                 return dg::gumbel_noise_cuda(p, o, s);
#else
                                 (void)s;
                                 return dg::Status::Ok();
#endif
                               }),
                 op);
}

// ---- diffusion_step ---------------------------------------------------------------------------------------

void diffusion_step(const Tensor& logits, const Tensor& temperature, const Tensor& seeds, const Tensor& blocks,
                    const Tensor& steps, const Tensor& entropy_bound, const Tensor& canvas, const Tensor& argmax,
                    const Tensor& entropy, const Tensor& accepted, const Tensor& mean_entropy,
                    const Tensor& processed, int64_t sum_lanes) {
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
      {temperature, "temperature", at::kFloat, {B}},   {seeds, "seeds", at::kLong, {B}},
      {blocks, "blocks", at::kLong, {B}},              {steps, "steps", at::kLong, {B}},
      {entropy_bound, "entropy_bound", at::kFloat, {B}}, {canvas, "canvas", at::kLong, {B, C}},
      {argmax, "argmax", at::kLong, {B, C}},           {entropy, "entropy", at::kFloat, {B, C}},
      {accepted, "accepted", at::kBool, {B, C}},       {mean_entropy, "mean_entropy", at::kFloat, {B}},
      {processed, "processed", at::kFloat, {B, C, V}},
  };
  for (const auto& a : args) {
    check_arg(a.t, op, a.name, {a.dtype}, (int64_t)a.shape.size());
    check_shape(a.t, op, a.name, a.shape);
    check_same_device(logits, a.t, op, a.name);
  }
  dg::DiffusionStepParams p{};
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
  raise_if_error(run_on_device(logits, op, [&] { return dg::diffusion_step_cpu(p); },
                               [&](void* s) {
#if defined(DG_WITH_CUDA)
                                 return dg::diffusion_step_cuda(p, s);
#else
                                 (void)s;
                                 return dg::Status::Ok();
#endif
                               }),
                 op);
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
  raise_if_error(dg::philox_hook(ctr.data_ptr<int64_t>(), key.data_ptr<int64_t>(), out.data_ptr<int64_t>(),
                                 ctr.size(0)),
                 op);
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

void gumbel(const Tensor& r, const Tensor& out) {
  const char* op = "gumbel";
  check_arg(r, op, "r", {at::kLong}, 1);
  check_arg(out, op, "out", {at::kFloat}, 1);
  check_shape(out, op, "out", r.sizes());
  TORCH_CHECK_VALUE(r.device().is_cpu() && out.device().is_cpu(), op, ": test hook takes CPU tensors");
  raise_if_error(dg::gumbel_hook(r.data_ptr<int64_t>(), out.data_ptr<float>(), r.numel()), op);
}

py::dict build_info() {
  py::dict d;
  d["cpu_level"] = dg::get_cpu_level();
#if defined(DG_WITH_CUDA)
  d["cuda"] = true;
#else
  d["cuda"] = false;
#endif
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
  m.def("canvas_noise", &canvas_noise, "contract canvas tokens into out [B, C] int64 (spec §7.4)",
        py::arg("seeds"), py::arg("blocks"), py::arg("steps"), py::arg("canvas_length"), py::arg("vocab_size"),
        py::arg("out"));
  m.def("gumbel_noise", &gumbel_noise, "contract Gumbel noise into out [B, C, V] fp32 (spec §7.5, dg_logf)",
        py::arg("seeds"), py::arg("blocks"), py::arg("steps"), py::arg("canvas_length"), py::arg("vocab_size"),
        py::arg("out"));
  m.def("diffusion_step", &diffusion_step,
        "fused sampler step over logits [B, C, V] into preallocated canvas, argmax, entropy, accepted, "
        "mean_entropy, processed",
        py::arg("logits"), py::arg("temperature"), py::arg("seeds"), py::arg("blocks"), py::arg("steps"),
        py::arg("entropy_bound"), py::arg("canvas"), py::arg("argmax"), py::arg("entropy"), py::arg("accepted"),
        py::arg("mean_entropy"), py::arg("processed"), py::arg("sum_lanes") = 8);
  m.def("philox4x32_10", &philox4x32_10, "test hook: Philox4x32-10 of ctr [n, 4] and key [n, 2] into out [n, 4]",
        py::arg("ctr"), py::arg("key"), py::arg("out"));
  m.def("dg_logf", &dg_logf, "test hook: the contract's float32 log of x [n] into out [n]", py::arg("x"),
        py::arg("out"));
  m.def("gumbel", &gumbel, "test hook: Gumbel value of Philox words r [n] (int64) into out [n] fp32", py::arg("r"),
        py::arg("out"));
  m.def("build_info", &build_info,
        "what this build contains: {'cuda': bool, 'openmp': bool, 'cpu_level': 0 baseline | 1 AVX2 | 2 AVX-512}");
  m.def("_set_cpu_level", &dg::set_cpu_level,
        "test hook: force the CPU code path (0 baseline, 1 AVX2+FMA, 2 AVX-512; -1 automatic); returns the level "
        "in use",
        py::arg("level"));
}
