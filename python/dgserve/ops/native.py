"""Native dispatch state of the ops: the compiled extension ``dgserve._C`` (optional), whether native paths are on
(``native_disabled``, ``switch_off_native``), what the build supports (``cuda_built``, ``build_info``, limits) and the
probes the CPU paths need (``sum_lanes``). Every op module (``dgserve.ops.<op>``) reads this module and calls
``_C.<op>`` through it; it imports only ``dgserve.ops.reference`` (no circle inside the ops package). Tests that
inject a fake extension patch ``dgserve.ops.native._C``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from . import reference

try:  # the extension is optional: `python build.py` builds it; the package works without it
    from dgserve import _C  # type: ignore[attr-defined,unused-ignore]  # absent (attr-defined) until build.py builds it
except ImportError:  # pragma: no cover - depends on the build
    _C = None

_lock = threading.Lock()
_disabled_depth = 0  # > 0 inside native_disabled(); process-wide, always restored by the context manager
_lanes: list[int | None] = []  # memo of sum_lanes(): [] = not probed yet
_info: list[dict] = []  # memo of build_info()
_switched_off: dict[str, str] = {}  # op -> why its native path is off for this process (switch_off_native)


@contextlib.contextmanager
def native_disabled() -> Iterator[None]:
    """Within the block every op uses ``dgserve.ops.reference`` (process-wide; nests; always restored)."""
    global _disabled_depth
    with _lock:
        _disabled_depth += 1
    try:
        yield
    finally:
        with _lock:
            _disabled_depth -= 1


def native_enabled() -> bool:
    """True when ``dgserve._C`` is importable and native dispatch is not disabled by ``native_disabled()``."""
    return _C is not None and _disabled_depth == 0


def has_native(op: str) -> bool:
    """True when ``dgserve._C`` is importable, provides ``op``, native dispatch is enabled and ``op`` was not
    switched off (``switch_off_native``)."""
    return native_enabled() and hasattr(_C, op) and op not in _switched_off


def switch_off_native(op: str, reason: str) -> None:
    """Use the reference for ``op`` for the rest of the process (``reason`` is reported by ``switched_off``)."""
    with _lock:
        _switched_off[op] = reason


def switched_off() -> dict[str, str]:
    """Ops whose native path was switched off in this process → why."""
    with _lock:
        return dict(_switched_off)


def switch_on_native(op: str | None = None) -> None:
    """Undo ``switch_off_native`` for ``op`` (all ops when None): tests only."""
    with _lock:
        if op is None:
            _switched_off.clear()
        else:
            _switched_off.pop(op, None)


# op -> devices its native path serves (dtype limits in each op's docstring). moe_experts on CPU runs native align,
# linear, gelu_tanh_mul and combine (see dgserve.ops.moe_experts). linear's CUDA kernel (_C.linear on CUDA tensors)
# is built and tested, but ops.linear serves CUDA tensors with cuBLAS (see dgserve.ops.linear).
NATIVE_OPS: dict[str, tuple[str, ...]] = {
    "rms_norm": ("cpu", "cuda"),
    "linear": ("cpu",),
    "gelu_tanh_mul": ("cpu",),
    "decode_attention": ("cpu",),
    "softcap": ("cpu",),
    "rope": ("cpu",),
    "rms_norm_add": ("cpu",),
    "rms_norm_rope": ("cpu",),
    "softmax_rows": ("cpu",),
    "canvas_noise": ("cpu", "cuda"),
    "gumbel_noise": ("cpu", "cuda"),
    "diffusion_step": ("cpu", "cuda"),
    "moe_route": ("cpu", "cuda"),
    "moe_align": ("cpu", "cuda"),
    "moe_experts": ("cuda",),
    "moe_combine": ("cpu", "cuda"),
    "nvfp4_repack": ("cpu", "cuda"),
    "nvfp4_moe_experts": ("cpu", "cuda"),
}


def fp32_weight(weight: torch.Tensor | None) -> torch.Tensor | None:
    """A norm's weight as the native cores take it: None, or fp32 and contiguous (itself when it already is: no
    call per op, which a profiled step would count)."""
    if weight is None or (weight.dtype == torch.float32 and weight.is_contiguous()):
        return weight
    return weight.to(torch.float32).contiguous()


def active_native_ops(device: torch.device | str) -> list[str]:
    """The ops of NATIVE_OPS whose native path serves ``device`` in this process (built, not switched off)."""
    kind = torch.device(device).type
    if kind == "cuda" and not cuda_built():
        return []
    return [op for op, kinds in NATIVE_OPS.items() if kind in kinds and has_native(op)]


def cuda_build_problem() -> str | None:
    """Why this process cannot run the CUDA kernels of ``dgserve._C`` (None when it can): the extension is not
    importable, or was built without CUDA (build.py falls back to a CPU-only build when torch is a CPU build or
    nvcc is missing). On a machine with a CUDA device such a build silently runs the references instead."""
    if _C is None:
        return "dgserve._C is not built (run `python build.py`)"
    if not cuda_built():
        return (
            "dgserve._C was built without CUDA (torch is a CPU build or nvcc was not found when `python build.py` ran)"
        )
    missing = missing_cuda_ops()
    if missing:
        return f"dgserve._C has no CUDA path for {', '.join(missing)} (build_info()['cuda_ops'])"
    return None


def extension_path() -> str | None:
    """The file ``dgserve._C`` was loaded from (None without the extension): which build a process runs."""
    return getattr(_C, "__file__", None) if _C is not None else None


def missing_cuda_ops() -> list[str]:
    """The ops that NATIVE_OPS serves on CUDA whose CUDA launcher this build does not link
    (``build_info()["cuda_ops"]``): all of them without the extension or in a build without CUDA."""
    linked = set(build_info().get("cuda_ops", ())) if cuda_built() else set()
    return [op for op, kinds in NATIVE_OPS.items() if "cuda" in kinds and op not in linked]


def cuda_built() -> bool:
    """True when ``dgserve._C`` is importable and was built with its CUDA kernels (``build_info()["cuda"]``)."""
    return _C is not None and bool(build_info().get("cuda", False))


def build_info() -> dict:
    """``_C.build_info()`` (what the build contains: cuda, openmp, cpu_level, limits), memoised: it does not change
    within a process; {} without the extension."""
    if not _info:
        _info.append(dict(_C.build_info()) if _C is not None else {})
    return _info[0]


def diffusion_step_max_canvas_cuda() -> int:
    """The longest canvas the CUDA ``diffusion_step`` serves: its accept kernel keeps the canvas in shared memory
    (csrc/ops/diffusion_step.h); longer canvases use the reference on CUDA. Older builds without the entry: their
    1024-thread limit."""
    return int(build_info().get("diffusion_step_max_canvas_cuda", 1024))


def native_device(device: torch.device) -> bool:
    """Whether the extension can run on ``device``: always the CPU, a CUDA device only in a CUDA build."""
    return device.type == "cpu" or (device.type == "cuda" and cuda_built())


def sum_lanes() -> int | None:
    """Vector width of torch's CPU float sum kernel (8 on AVX2/AVX-512 x86 builds), found by matching
    ``_C.rms_norm`` against ``reference.rms_norm`` bit for bit on a probe; None when neither width matches
    (then rms_norm stays on the reference and the native mean entropy is not bit-exact). Memoised per process;
    the CPU ops that reproduce torch's sum order (rms_norm, diffusion_step's mean, moe_route's renormalisation)
    pass it to ``_C``."""
    if _lanes:
        return _lanes[0]
    gen = torch.Generator().manual_seed(20240607)
    probes = [torch.randn(3, d, generator=gen) * 3 for d in (67, 300, 1031)]
    found = None
    for lanes in (8, 16):
        ok = True
        for x in probes:
            out = torch.empty_like(x)
            _C.rms_norm(x, None, 1e-6, out, lanes)
            ok = ok and torch.equal(out, reference.rms_norm(x, None, 1e-6))
        if ok:
            found = lanes
            break
    _lanes.append(found)
    return found


def wants_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd would record an op on ``tensors`` (grad mode on and one of them requires grad): the native
    paths have no backward, so such calls use the reference."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
