"""Where and how a checkpoint is served: device, dtype, expert format and native ops.

Safe defaults: ``dtype="auto"`` is bfloat16 on CUDA and float32 on the CPU. float32 on a GPU is allowed only when
the weights fit (estimated from the safetensors headers, before anything is loaded): otherwise ``plan_runtime``
reports a problem and ``check_plan`` raises ConfigError naming the sizes and the fix. The 26B checkpoint in
float32 is ≈104 GB: it does not fit an 80 GB H100, and on an H200 the CUDA expert GEMMs (bf16 only) would fall
back to a Python loop per layer.

``describe`` gives the plan as a dict for ``--dry-run``, the start-up log and GetModelInfo.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from dataclasses import dataclass

import torch

from dgserve.config import ConfigError

DTYPES = ("auto", "float32", "bfloat16")
# Besides the weights a GPU needs room for activations, logits of a batch of canvases and the KV cache: the
# weights must fit in the free memory less this headroom (a fraction plus a constant).
HEADROOM_FRACTION = 0.10
HEADROOM_BYTES = 2 << 30
_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "U8": 1, "I8": 1, "F8_E4M3": 1, "I32": 4, "I64": 8}


@dataclass(frozen=True)
class RuntimePlan:
    device: str
    dtype: str  # "float32" | "bfloat16"
    dtype_reason: str
    # "dense <dtype>" | "nvfp4 (W4A16 packed)" | "nvfp4 (dequantized to <dtype>)" | "fp8 (dequantized to <dtype>)"
    # | "fp8 (W8A8 scaled_mm, <dtype> out)"
    expert_format: str
    native_ops_mode: str  # auto | off | strict
    native_ops: tuple[str, ...]  # native ops serving the device in this process (before the self-check)
    weight_bytes: int | None  # estimated bytes of the weights as served (None: no checkpoint found)
    device_free_bytes: int | None  # free bytes on a CUDA device (None: CPU or no device)
    problem: str | None = None  # why this plan cannot be served (raised by check_plan)
    fp8_path: str | None = None  # FP8 checkpoints: why W8A8 or dequantized (fp8_w8a8.decide); None otherwise

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


def resolve_dtype(device: str, dtype: str | torch.dtype | None) -> tuple[str, str]:
    """(dtype name, reason): auto/None → bfloat16 on CUDA, float32 elsewhere."""
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    if dtype in (None, "auto"):
        if torch.device(device).type == "cuda":
            return "bfloat16", "auto: bfloat16 on CUDA (the CUDA expert GEMMs take bf16; fp32 26B needs ~104 GB)"
        return "float32", "auto: float32 on the CPU (exact parity with transformers)"
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return dtype, "requested"


def _headers(path: pathlib.Path) -> dict[str, tuple[str, tuple[int, ...]]] | None:
    from dgserve.model.checkpoint import _is_vision, _scan

    try:
        return {n: (s.dtype, s.shape) for n, s in _scan(path).items() if not _is_vision(n)}
    except Exception:  # noqa: BLE001 - no or unreadable checkpoint: the loader reports it properly
        return None


def has_nvfp4_experts(path: str | os.PathLike[str]) -> bool:
    from dgserve.model import nvfp4

    headers = _headers(pathlib.Path(path))
    return headers is not None and any(nvfp4.EXPERT_NAME.match(n) for n in headers)


def estimate_weight_bytes(
    headers: dict[str, tuple[str, tuple[int, ...]]], dtype: str, packed_nvfp4: bool, fp8_codes: bool = False
) -> int:
    """Bytes of the weights once loaded: floating tensors in ``dtype``; NVFP4 experts as stored when packed (codes,
    scales, fp32 globals), else dequantized to ``dtype`` (two weights per code byte); FP8 weights one byte each when
    kept as codes (W8A8), else in ``dtype``."""
    from dgserve.model import nvfp4

    size = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    total = 0
    for name, (st, shape) in headers.items():
        n = 1
        for d in shape:
            n *= d
        m = nvfp4.EXPERT_NAME.match(name)
        if m is not None:
            if m["part"] == "input_scale":
                continue
            if packed_nvfp4:
                total += n * _BYTES.get(st, 4)
            elif m["part"] == "weight":
                total += 2 * n * size
            continue
        if st == "F8_E4M3" and fp8_codes:
            total += n
            continue
        total += n * size if st.startswith(("F", "BF")) else n * _BYTES.get(st, 4)
    return total


def _free_bytes(device: str) -> int | None:
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    try:
        free, _ = torch.cuda.mem_get_info(dev)
    except Exception:  # noqa: BLE001 - no usable device: reported by the loader
        return None
    return int(free)


def plan_runtime(
    path: str | os.PathLike[str],
    device: str = "cpu",
    dtype: str | torch.dtype | None = "auto",
    native_ops: str = "auto",
    packed_nvfp4: bool | None = None,
) -> RuntimePlan:
    """The plan for serving the checkpoint at ``path``; never raises for a fitting problem (see ``problem``).

    packed_nvfp4: serve NVFP4 experts in the packed W4A16 layout (default: on CUDA, when the checkpoint has them).
    """
    from dgserve import ops

    name, reason = resolve_dtype(device, dtype)
    kind = torch.device(device).type
    if kind == "cuda" and name == "float32":
        reason += "; the CUDA expert GEMMs take bf16: in float32 the experts run their torch reference (slow)"
    headers = _headers(pathlib.Path(path))
    nvfp4_ckpt = bool(headers) and has_nvfp4_experts(path)
    packed = (kind == "cuda") if packed_nvfp4 is None else packed_nvfp4
    quant, problem = _quant_format(path)
    fp8_why = None
    if quant == "fp8":  # compressed-tensors FP8 dynamic (docs/kernels.md, "FP8 checkpoints")
        from dgserve.model import fp8_w8a8

        path_kind, fp8_why = fp8_w8a8.decide(device, getattr(torch, name))
        w8a8 = path_kind == fp8_w8a8.W8A8
        fmt = f"fp8 (W8A8 scaled_mm, {name} out)" if w8a8 else f"fp8 (dequantized to {name})"
        nvfp4_ckpt = False
    elif nvfp4_ckpt:
        fmt = "nvfp4 (W4A16 packed)" if packed else f"nvfp4 (dequantized to {name})"
    else:
        fmt = f"dense {name}"
    fp8_codes = quant == "fp8" and fmt.startswith("fp8 (W8A8")
    weight_bytes = estimate_weight_bytes(headers, name, nvfp4_ckpt and packed, fp8_codes) if headers else None
    free = _free_bytes(device)
    if problem is None and kind == "cuda" and free is not None and weight_bytes is not None:
        budget = int(free * (1 - HEADROOM_FRACTION)) - HEADROOM_BYTES
        if weight_bytes > budget:
            problem = (
                f"dtype {name}: the weights need {weight_bytes / 1e9:.1f} GB but {device} has "
                f"{free / 1e9:.1f} GB free ({budget / 1e9:.1f} GB after headroom for activations and the "
                "KV cache)" + ("; use --dtype bfloat16 (the default on CUDA)" if name == "float32" else "")
            )
    return RuntimePlan(
        str(device),
        name,
        reason,
        fmt,
        native_ops,
        tuple(ops.active_native_ops(device)),
        weight_bytes,
        free,
        problem,
        fp8_why,
    )


def _quant_format(path: str | os.PathLike[str]) -> tuple[str | None, str | None]:
    """(the format config.json / hf_quant_config.json declare, or None; why it cannot be served, or None)."""
    from dgserve.model.quant_format import detect_format

    try:
        return detect_format(pathlib.Path(path)), None
    except ValueError as e:
        return None, str(e)


def check_plan(plan: RuntimePlan) -> None:
    """ConfigError when the plan cannot be served (before any weight is loaded)."""
    if plan.problem is not None:
        raise ConfigError(plan.problem)


def describe(plan: RuntimePlan) -> dict:
    d = dataclasses.asdict(plan)
    d["native_ops"] = list(plan.native_ops)
    return d
