"""FP8 W8A8: compressed-tensors FP8 dynamic weights kept as E4M3 on the device, activations quantized per token at run
time, the products through ``torch._scaled_mm`` (docs/kernels.md, "FP8 checkpoints").

- ``quantize_rows`` is the activation quantizer (the PyTorch reference): per row ``s = max(amax(|x|) / 448, tiny)``
  in fp32, ``q = e4m3(clamp(x / s, ±448))``; a row of zeros gets ``s = tiny`` and codes 0.
- ``scaled_linear`` is ``y[t, n] = rnd_out(Σ_k f32(q[t, k])·f32(w[n, k]) · s_x[t] · s_w[n])``, out in the model dtype.
- ``Fp8Linear`` carries a Linear's codes and scales as a tensor of the model's dtype and shape: ``F.linear`` on it runs
  ``scaled_linear`` (every layer's call site stays ``F.linear``); any other op computes on the exactly dequantized
  weight and returns a plain tensor.
- ``Fp8Experts`` and ``moe_experts`` run the routed experts the same way, grouped per expert like
  ``ops.reference.moe_expert_outputs``, with the fp32 combine of ``ops.moe_combine``.
- ``decide`` is the one place that chooses the path (docs/exactness.md, "FP8 W8A8"): the CPU dequantizes at load
  (exact); CUDA with compute capability 8.9 or later runs W8A8 when ``torch._scaled_mm`` takes the model dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from dgserve import ops
from dgserve.model import fp8

E4M3_MAX = fp8.E4M3_MAX
TINY = torch.finfo(torch.float32).tiny
MIN_CAPABILITY = (8, 9)  # Ada / Hopper and later: FP8 tensor cores
CUDA_ALIGN = 16  # torch._scaled_mm on CUDA: both dimensions of the weight a multiple of 16
W8A8 = "w8a8"
DEQUANTIZED = "dequantized"


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (any float dtype) -> (float8_e4m3fn [M, K], fp32 scale [M, 1]); ``x ≈ f32(q) · scale``."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / E4M3_MAX).clamp(min=TINY)
    q = (xf / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def scaled_linear(x: torch.Tensor, weight: torch.Tensor, scale_row: torch.Tensor) -> torch.Tensor:
    """x [..., K] md; weight float8_e4m3fn [N, K] (row-major); scale_row fp32 [1, N] -> [..., N] in x's dtype."""
    lead = x.shape[:-1]
    q, s = quantize_rows(x.reshape(-1, x.shape[-1]))
    y = torch._scaled_mm(q, weight.t(), scale_a=s, scale_b=scale_row, out_dtype=x.dtype)
    return y.reshape(*lead, weight.shape[0])


class Fp8Linear(torch.Tensor):
    """A Linear weight [N, K] of dtype ``dtype`` held as E4M3 codes ``qweight`` and fp32 ``scale_row`` [1, N]."""

    qweight: torch.Tensor
    scale_row: torch.Tensor

    @staticmethod
    def __new__(cls, qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> Fp8Linear:
        self = torch.Tensor._make_wrapper_subclass(cls, qweight.shape, dtype=dtype, device=qweight.device)
        self.qweight = qweight.contiguous()
        self.scale_row = scale.float().reshape(1, -1).contiguous()
        return self

    def dequantize(self) -> torch.Tensor:
        return fp8.dequantize(self.qweight, self.scale_row).to(self.dtype)

    def __repr__(self, **_: Any) -> str:  # type: ignore[override]  # the wrapper has no storage to print
        return f"Fp8Linear({list(self.shape)}, dtype={self.dtype}, device={self.device})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and isinstance(args[1], Fp8Linear) and not isinstance(args[0], Fp8Linear):
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            y = scaled_linear(args[0], args[1].qweight, args[1].scale_row)
            return y if bias is None else y + bias
        with torch.DisableTorchFunctionSubclass():  # metadata reads stay cheap; ops reach __torch_dispatch__
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        def plain(a: Any) -> Any:
            return a.dequantize() if isinstance(a, Fp8Linear) else a

        return func(*[plain(a) for a in args], **{k: plain(v) for k, v in (kwargs or {}).items()})


@dataclass
class Fp8Experts:
    """One layer's routed experts as E4M3 codes with per-output-channel fp32 scales."""

    gate_up: torch.Tensor  # float8_e4m3fn [E, 2I, H]: rows 0..I-1 gate, I..2I-1 up
    gate_up_scale: torch.Tensor  # fp32 [E, 2I]
    down: torch.Tensor  # float8_e4m3fn [E, H, I]
    down_scale: torch.Tensor  # fp32 [E, H]


def moe_experts(x: torch.Tensor, ex: Fp8Experts, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``ops.moe_experts`` with W8A8 expert GEMMs: x [T, H] md, weights [T, K] fp32, ids [T, K] -> [T, H] md.
    Each token is quantized once (its rows are the same for every expert it visits); the GELU-tanh product is
    quantized per row before the down projection."""
    T, K = ids.shape
    E, inter = ex.gate_up.shape[0], ex.gate_up.shape[1] // 2
    align = ops.moe_align(ids, E, 1)
    q, s = quantize_rows(x)
    offsets, counts = align.offsets.tolist(), align.counts.tolist()
    pairs = align.sorted_pairs[: offsets[-1]].long()
    y = torch.empty(T * K, x.shape[-1], dtype=torch.float32, device=x.device)
    for e, n in enumerate(counts):
        if not n:
            continue
        group = pairs[offsets[e] : offsets[e] + n]
        rows = group // K
        gu = torch._scaled_mm(
            q[rows], ex.gate_up[e].t(), scale_a=s[rows], scale_b=ex.gate_up_scale[e : e + 1], out_dtype=x.dtype
        )
        h = F.gelu(gu[:, :inter], approximate="tanh") * gu[:, inter:]
        hq, hs = quantize_rows(h)
        out = torch._scaled_mm(hq, ex.down[e].t(), scale_a=hs, scale_b=ex.down_scale[e : e + 1], out_dtype=x.dtype)
        y[group] = out.float()
    return ops.moe_combine(y.view(T, K, -1), weights, x.dtype)


# ------------------------------------------------------------------------------------------------ the decision


def _scaled_mm_takes(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._scaled_mm`` with per-row scales and ``dtype`` out runs on ``device`` (one 16×16 product)."""
    try:
        a = torch.zeros(CUDA_ALIGN, CUDA_ALIGN, device=device).to(torch.float8_e4m3fn)
        one = torch.ones(CUDA_ALIGN, 1, device=device)
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one.t().contiguous(), out_dtype=dtype)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


def decide(device: torch.device | str, dtype: torch.dtype, request: bool | None = None) -> tuple[str, str]:
    """(W8A8 or DEQUANTIZED, why) for an FP8 checkpoint served on ``device`` in ``dtype``. ``request`` True/False
    forces the path (tests; True still needs ``torch._scaled_mm`` to take the dtype); None decides."""
    dev = torch.device(device)
    if request is False:
        return DEQUANTIZED, "requested"
    if request is None and dev.type != "cuda":
        return DEQUANTIZED, f"{dev.type}: dequantized exactly at load"
    if request is None:
        if not torch.cuda.is_available():
            return DEQUANTIZED, "no CUDA device"
        cap = torch.cuda.get_device_capability(dev)
        if cap < MIN_CAPABILITY:
            return DEQUANTIZED, f"sm_{cap[0]}{cap[1]} has no FP8 tensor cores (W8A8 needs sm_89 or later)"
    if not _scaled_mm_takes(dev, dtype):
        return DEQUANTIZED, f"torch._scaled_mm does not take {str(dtype).removeprefix('torch.')} out on {dev}"
    return W8A8, f"{dev.type}: E4M3 weights, per-token E4M3 activations, torch._scaled_mm"


def keeps_codes(canonical: str, shape: tuple[int, ...], device: torch.device | str) -> bool:
    """Whether the FP8 weight ``canonical`` stays E4M3 under W8A8: the layers' and self-conditioning's projections
    (embeddings and lm_head are dequantized); on CUDA both dimensions a multiple of 16."""
    linear = canonical.endswith("_proj.weight") and canonical.startswith(("layers.", "self_conditioning."))
    return linear and "router" not in canonical and aligned(shape, device)


def aligned(dims: tuple[int, ...], device: torch.device | str) -> bool:
    """Whether ``torch._scaled_mm`` takes weights with these dimensions on ``device`` (CUDA: multiples of 16)."""
    return torch.device(device).type != "cuda" or all(d % CUDA_ALIGN == 0 for d in dims)
