"""FP8 (compressed-tensors "FP8 dynamic") weights: the per-channel E4M3 format, its exact dequantization and a
quantizer with compressed-tensors' rounding rules (docs/kernels.md, "FP8 checkpoints").

A quantized Linear stores ``weight`` float8_e4m3fn [N, K] and ``weight_scale`` [N, 1] (float32, bfloat16 or float16;
one scale per output channel); activations are quantized per token at run time, so nothing is stored for them.
``W[n, k] = f32(weight[n, k]) × f32(weight_scale[n])``, rounded once to the model's dtype.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
SCALE_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
WEIGHT_DTYPE = "F8_E4M3"  # safetensors' code for torch.float8_e4m3fn


def quantize(w: torch.Tensor, scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (float8_e4m3fn [N, K], scale [N, 1] in ``scale_dtype``), as compressed-tensors' minmax observer and
    float quantizer do: ``scale = max(amax(|w[n]|) / 448, eps)``, ``q = e4m3(clamp(w / scale, ±448))`` (round to
    nearest even)."""
    w = w.float()
    amax = w.abs().amax(dim=1, keepdim=True)
    scale = (amax / E4M3_MAX).clamp(min=torch.finfo(scale_dtype).eps).to(scale_dtype)
    q = (w / scale.float()).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn [N, K] × scale [N, 1] or [N] -> fp32 [N, K] (the product in fp32)."""
    return weight.float() * scale.float().reshape(-1, 1)


def check_scale(scale: torch.Tensor, rows: int, name: str) -> None:
    """ValueError naming ``name`` unless ``scale`` is [rows, 1] or [rows] with every value finite and > 0."""
    if tuple(scale.shape) not in ((rows, 1), (rows,)):
        raise ValueError(f"{name}: expected a per-channel scale of shape [{rows}, 1], got {list(scale.shape)}")
    s = scale.float()
    bad = ~torch.isfinite(s) | (s <= 0)
    if bool(bad.any()):
        row = int(bad.reshape(-1).nonzero()[0])
        raise ValueError(f"{name}: scales must be finite and > 0, got {s.reshape(-1)[row].item()} at channel {row}")
