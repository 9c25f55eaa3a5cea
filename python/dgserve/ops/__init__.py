"""dgserve ops: the public op surface used by the model and the sampler.

Each op dispatches to the compiled extension ``dgserve._C`` when it is built and supports the
inputs, and otherwise to the readable PyTorch formula in ``dgserve.ops.reference`` (the oracle).
Layers call these functions, never ``_C`` directly (one name per op, end to end).
"""
from __future__ import annotations

import torch

from . import reference
from .reference import DiffusionStepOut, entropy_bound_accept, gated_mlp, step_temperature

try:  # the extension is optional: `python build.py` builds it; the package works without it
    from dgserve import _C  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - depends on the build
    _C = None

__all__ = [
    "DiffusionStepOut", "canvas_noise", "diffusion_step", "entropy_bound_accept", "gated_mlp",
    "gumbel_noise", "has_native", "moe_experts", "moe_route", "rms_norm", "step_temperature",
]


def has_native(op: str) -> bool:
    """True when ``dgserve._C`` is importable and provides ``op``."""
    return _C is not None and hasattr(_C, op)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., D] with optional scale weight [D]; see reference.rms_norm."""
    return reference.rms_norm(x, weight, eps)


def moe_route(residual, router_scale, proj_w, per_expert_scale, top_k: int, eps: float):
    """Router → (weights [T, K] fp32, ids [T, K] int64); see reference.moe_route."""
    return reference.moe_route(residual, router_scale, proj_w, per_expert_scale, top_k, eps)


def moe_experts(x, gate_up, down, weights, ids):
    """Grouped expert MLP with fp32 combine → [T, H] md; see reference.moe_experts."""
    return reference.moe_experts(x, gate_up, down, weights, ids)


def canvas_noise(seeds, blocks, steps, canvas_length: int, vocab_size: int) -> torch.Tensor:
    """Contract canvas tokens [B, C] int64 (spec §7.4); see reference.canvas_noise."""
    return reference.canvas_noise(seeds, blocks, steps, canvas_length, vocab_size)


def gumbel_noise(seeds, blocks, steps, canvas_length: int, vocab_size: int) -> torch.Tensor:
    """Contract Gumbel noise [B, C, V] fp32 (spec §7.5); see reference.gumbel_noise."""
    return reference.gumbel_noise(seeds, blocks, steps, canvas_length, vocab_size)


def diffusion_step(logits, temperature, seeds, blocks, steps, entropy_bound) -> DiffusionStepOut:
    """One denoising step for B rows (sample, argmax, entropy, acceptance, renoise); see reference.diffusion_step."""
    return reference.diffusion_step(logits, temperature, seeds, blocks, steps, entropy_bound)
