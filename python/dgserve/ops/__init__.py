"""dgserve ops: the public op surface used by the model and the sampler.

Each op dispatches to the compiled extension ``dgserve._C`` when it is built and supports the
inputs, and otherwise to the readable PyTorch formula in ``dgserve.ops.reference`` (the oracle).
Layers call these functions, never ``_C`` directly (one name per op, end to end).

Native paths (``python build.py`` builds ``_C``; contracts in ``csrc/ops/<op>.h``):

- ``rms_norm``: CPU, fp32/bf16, last dim contiguous → bit-identical to the reference (torch's CPU sum
  order is reproduced; verified once per process, else the reference is used). CUDA: one fused kernel per
  row (a block-wide tree sum: within an ulp or so of the reference, not bit-identical; the start-up
  self-check holds it to its tolerance) instead of torch's five kernels.
- ``canvas_noise``: bit-identical everywhere (integer only).
- ``gumbel_noise`` and the Gumbel draw inside ``diffusion_step``: the contract's float32 log ``dg_logf``
  shared by the CPU and CUDA code, within 1 ulp of max(|g|, 1) of the reference's ``torch.log`` noise
  (spec §7.6); the native ``gumbel_noise`` is exactly the noise the native ``diffusion_step`` adds.
- ``diffusion_step``: processed logits, argmax and renoise bit-identical to the reference; sampled tokens
  equal except at near-ties of the Gumbel race; entropy accumulated in double (a few fp32 ulp from the
  reference's fp32 formula); acceptance and the mean bit-exact given the entropies.

- ``moe_route``, ``moe_align``, ``moe_experts``, ``moe_combine``: see ``dgserve.ops.moe`` (CPU: bit-identical;
  CUDA: fused route, device-side align, bf16 grouped expert GEMMs, exact combine).
- ``nvfp4_repack``, ``nvfp4_moe_experts``: see ``dgserve.ops.nvfp4_experts`` (NVFP4 W4A16 experts: exact
  in-register decode, grouped GEMMs on CUDA; CPU: torch GEMMs on exactly decoded weights).

``native_disabled()`` forces the reference path (tests); ``native_enabled()`` says whether native
dispatch is on. ``switch_off_native(op, reason)`` turns one op's native path off for the process (the start-up
self-check, ``dgserve.native_check``, does it for an op that disagrees with its reference); ``active_native_ops``
lists what runs natively on a device.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from . import reference
from .moe import MoeAlignOut, moe_align, moe_combine, moe_experts, moe_route  # MoE dispatch (see moe.py)
from .nvfp4_experts import nvfp4_decode, nvfp4_moe_experts, nvfp4_repack  # W4A16 experts (see nvfp4_experts.py)
from .reference import DiffusionStepOut, entropy_bound_accept, gated_mlp, step_temperature

try:  # the extension is optional: `python build.py` builds it; the package works without it
    from dgserve import _C  # type: ignore[attr-defined,unused-ignore]  # absent (attr-defined) until build.py builds it
except ImportError:  # pragma: no cover - depends on the build
    _C = None

__all__ = [
    "NATIVE_OPS",
    "DiffusionStepOut",
    "MoeAlignOut",
    "active_native_ops",
    "canvas_noise",
    "cuda_build_problem",
    "diffusion_step",
    "entropy_bound_accept",
    "gated_mlp",
    "gumbel_noise",
    "has_native",
    "moe_align",
    "moe_combine",
    "moe_experts",
    "moe_route",
    "native_disabled",
    "native_enabled",
    "nvfp4_decode",
    "nvfp4_moe_experts",
    "nvfp4_repack",
    "rms_norm",
    "step_temperature",
    "switch_off_native",
    "switch_on_native",
    "switched_off",
]

_lock = threading.Lock()
_disabled_depth = 0  # > 0 inside native_disabled(); process-wide, always restored by the context manager
_lanes: list[int | None] = []  # memo of _sum_lanes(): [] = not probed yet
_info: list[dict] = []  # memo of _build_info()
_switched_off: dict[str, str] = {}  # op -> why its native path is off for this process (switch_off_native)

# torch splits a single-output CPU reduction across threads (a different sum order) from this many elements.
_TORCH_TWO_PASS_NUMEL = 32768


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


# op -> devices its native path serves (dtype limits in each op's docstring). The GEMMs of moe_experts on CPU
# stay torch ops on purpose (bit-identity with torch; see dgserve.ops.moe).
NATIVE_OPS: dict[str, tuple[str, ...]] = {
    "rms_norm": ("cpu", "cuda"),
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


def active_native_ops(device: torch.device | str) -> list[str]:
    """The ops of NATIVE_OPS whose native path serves ``device`` in this process (built, not switched off)."""
    kind = torch.device(device).type
    if kind == "cuda" and not _cuda_built():
        return []
    return [op for op, kinds in NATIVE_OPS.items() if kind in kinds and has_native(op)]


def cuda_build_problem() -> str | None:
    """Why this process cannot run the CUDA kernels of ``dgserve._C`` (None when it can): the extension is not
    importable, or was built without CUDA (build.py falls back to a CPU-only build when torch is a CPU build or
    nvcc is missing). On a machine with a CUDA device such a build silently runs the references instead."""
    if _C is None:
        return "dgserve._C is not built (run `python build.py`)"
    if not _cuda_built():
        return (
            "dgserve._C was built without CUDA (torch is a CPU build or nvcc was not found when `python build.py` ran)"
        )
    return None


def _cuda_built() -> bool:
    return _C is not None and bool(_build_info().get("cuda", False))


def _build_info() -> dict:
    """``_C.build_info()``, memoised (it does not change within a process); {} without the extension."""
    if not _info:
        _info.append(dict(_C.build_info()) if _C is not None else {})
    return _info[0]


# The CUDA diffusion_step's accept kernel keeps the canvas in shared memory (csrc/ops/diffusion_step.h);
# longer canvases use the reference on CUDA. Older builds without the entry: their 1024-thread limit.
def _diffusion_step_max_canvas_cuda() -> int:
    return int(_build_info().get("diffusion_step_max_canvas_cuda", 1024))


def _native_device(device: torch.device) -> bool:
    return device.type == "cpu" or (device.type == "cuda" and _cuda_built())


def _sum_lanes() -> int | None:
    """Vector width of torch's CPU float sum kernel (8 on AVX2/AVX-512 x86 builds), found by matching
    ``_C.rms_norm`` against ``reference.rms_norm`` bit for bit on a probe; None when neither width matches
    (then rms_norm stays on the reference and the native mean entropy is not bit-exact)."""
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


def _wants_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., D] with optional scale weight [D]; see reference.rms_norm."""
    if _rms_norm_native_ok(x, weight):
        lanes = _sum_lanes() if x.device.type == "cpu" else 8  # the lanes only order the CPU sum
        if lanes is not None:
            D = x.shape[-1]
            x2 = x.reshape(-1, D)  # [rows, D]
            out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
            w = None if weight is None else weight.to(torch.float32).contiguous()  # exact, as weight.float()
            _C.rms_norm(x2, w, float(eps), out, lanes)
            return out.view(x.shape)
    return reference.rms_norm(x, weight, eps)


def _rms_norm_native_ok(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    if not (has_native("rms_norm") and _native_device(x.device) and x.dtype in (torch.float32, torch.bfloat16)):
        return False
    if x.dim() == 0 or x.shape[-1] == 0 or x.numel() == 0 or x.stride(-1) != 1 or _wants_grad(x, weight):
        return False  # a strided last dim changes torch's sum order; autograd needs the reference
    if weight is not None and (
        weight.device != x.device
        or weight.shape != (x.shape[-1],)
        or weight.dtype not in (torch.float32, torch.bfloat16)
    ):
        return False
    one_row = x.numel() == x.shape[-1]
    return not (one_row and x.numel() >= _TORCH_TWO_PASS_NUMEL and torch.get_num_threads() > 1)


def _noise_inputs(seeds, blocks, steps) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """[B] int64 tensors on one device the extension supports, else None (→ reference)."""
    if not all(isinstance(t, torch.Tensor) for t in (seeds, blocks, steps)):
        return None
    if seeds.dim() != 1 or blocks.shape != seeds.shape or steps.shape != seeds.shape:
        return None
    if not (seeds.device == blocks.device == steps.device and _native_device(seeds.device)):
        return None
    if any(t.dtype != torch.int64 for t in (seeds, blocks, steps)):
        return None
    return seeds.contiguous(), blocks.contiguous(), steps.contiguous()


def canvas_noise(seeds, blocks, steps, canvas_length: int, vocab_size: int) -> torch.Tensor:
    """Contract canvas tokens [B, C] int64 (spec §7.4); see reference.canvas_noise.

    seeds, blocks, steps: [B] int64 (blocks in [0, 2^32), steps in [0, 2^31)) → new tensor [B, C] int64.
    Bit-identical on every path.
    """
    args = _noise_inputs(seeds, blocks, steps) if has_native("canvas_noise") else None
    if args is None or vocab_size < 1 or canvas_length < 0:
        return reference.canvas_noise(seeds, blocks, steps, canvas_length, vocab_size)
    out = torch.empty(args[0].shape[0], canvas_length, dtype=torch.int64, device=args[0].device)
    _C.canvas_noise(*args, int(canvas_length), int(vocab_size), out)
    return out


def gumbel_noise(seeds, blocks, steps, canvas_length: int, vocab_size: int) -> torch.Tensor:
    """Contract Gumbel noise [B, C, V] fp32 (spec §7.5); see reference.gumbel_noise.

    seeds, blocks, steps: [B] int64 → new tensor [B, C, V] fp32. The native path computes the logs with the
    contract's shared ``dg_logf`` (the noise the native ``diffusion_step`` adds, bit for bit); it differs
    from the reference's ``torch.log`` by at most 1 ulp of max(|g|, 1) (spec §7.6).
    """
    args = _noise_inputs(seeds, blocks, steps) if has_native("gumbel_noise") else None
    if args is None or vocab_size < 1 or canvas_length < 0:
        return reference.gumbel_noise(seeds, blocks, steps, canvas_length, vocab_size)
    out = torch.empty(args[0].shape[0], canvas_length, vocab_size, dtype=torch.float32, device=args[0].device)
    _C.gumbel_noise(*args, int(canvas_length), int(vocab_size), out)
    return out


def diffusion_step(logits, temperature, seeds, blocks, steps, entropy_bound, bitmask=None) -> DiffusionStepOut:
    """One denoising step for B rows (sample, argmax, entropy, acceptance, renoise); see reference.diffusion_step.

    Parameters
    ----------
    logits : [B, C, V] fp32 or bf16 (softcapped decoder logits); not modified
    temperature : [B] (rounded to fp32)
    seeds, blocks, steps : [B] int64 (steps = remaining-steps counter k >= 1)
    entropy_bound : [B] (rounded to fp32)
    bitmask : None (unconstrained: today's results bit for bit) or [B, C, ceil(V/32)] int32, the layout of
        llguidance / xgrammar: bit v % 32 of word v // 32 set = token v allowed; bits >= V ignored. A disallowed
        token's processed logit is -inf: probability 0 in the argmax, the Gumbel draw, the entropy (so the
        acceptance rule sees the masked distribution) and the processed logits fed back as self-conditioning.
        A fully masked position is left unmasked (defined, tested; the structured sampler never sends one).

    Returns
    -------
    DiffusionStepOut of new tensors: canvas [B, C] int64, argmax [B, C] int64, entropy [B, C] fp32,
    accepted [B, C] bool, mean_entropy [B] fp32, processed [B, C, V] fp32.
    """
    if not _diffusion_step_native_ok(logits, temperature, seeds, blocks, steps, entropy_bound, bitmask):
        return reference.diffusion_step(logits, temperature, seeds, blocks, steps, entropy_bound, bitmask)
    B, C, V = logits.shape
    dev = logits.device
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    out = DiffusionStepOut(
        canvas=torch.empty(B, C, dtype=torch.int64, device=dev),
        argmax=torch.empty(B, C, dtype=torch.int64, device=dev),
        entropy=torch.empty(B, C, dtype=torch.float32, device=dev),
        accepted=torch.empty(B, C, dtype=torch.bool, device=dev),
        mean_entropy=torch.empty(B, dtype=torch.float32, device=dev),
        processed=torch.empty(B, C, V, dtype=torch.float32, device=dev),
    )
    _C.diffusion_step(
        logits,
        temperature.to(torch.float32).contiguous(),
        seeds.contiguous(),
        blocks.contiguous(),
        steps.contiguous(),
        entropy_bound.to(torch.float32).contiguous(),
        out.canvas,
        out.argmax,
        out.entropy,
        out.accepted,
        out.mean_entropy,
        out.processed,
        _sum_lanes() or 8,
        None if bitmask is None else bitmask.contiguous(),
    )
    return out


def _diffusion_step_native_ok(logits, temperature, seeds, blocks, steps, entropy_bound, bitmask=None) -> bool:
    if not (has_native("diffusion_step") and isinstance(logits, torch.Tensor) and logits.dim() == 3):
        return False
    B, C, V = logits.shape
    if B == 0 or C == 0 or V == 0 or logits.dtype not in (torch.float32, torch.bfloat16):
        return False
    if not _native_device(logits.device) or _wants_grad(logits):
        return False
    if logits.device.type == "cuda" and C > _diffusion_step_max_canvas_cuda():
        return False  # a long canvas falls back instead of raising
    if _noise_inputs(seeds, blocks, steps) is None or seeds.shape != (B,) or seeds.device != logits.device:
        return False
    for t in (temperature, entropy_bound):
        if not (
            isinstance(t, torch.Tensor) and t.shape == (B,) and t.device == logits.device and t.is_floating_point()
        ):
            return False
    if bitmask is not None and not (
        isinstance(bitmask, torch.Tensor)
        and bitmask.dtype == torch.int32
        and bitmask.shape == (B, C, (V + 31) // 32)
        and bitmask.device == logits.device
    ):
        return False  # the reference raises with torch's own message on a wrong shape
    return True
