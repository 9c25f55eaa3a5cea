"""Random DiffusionGemma checkpoints the package can make itself (demo, benchmarks, tests).

``PRESETS`` are named shapes: ``tiny`` is spec §1.4's test model, ``mid`` a CPU benchmark size.
Weights are drawn like transformers' init (normal, std 0.02) except that norms, router scales and layer
scalars are perturbed around 1 so every parameter matters (spec §1.4).
"""
from __future__ import annotations

import dataclasses
import os

import torch

from dgserve.checkpoint import expected_shapes, save_weights
from dgserve.config import FULL, SLIDING, ModelConfig

_BASE = dict(
    vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
    top_k_experts=2, num_hidden_layers=3, layer_types=(SLIDING, SLIDING, FULL), num_attention_heads=4,
    sliding_head_dim=16, sliding_num_kv_heads=2, full_head_dim=32, full_num_kv_heads=1, sliding_window=8,
    rope_theta_sliding=10_000.0, rope_theta_full=1_000_000.0, partial_rotary_factor_full=0.25,
    rms_norm_eps=1e-6, final_logit_softcapping=30.0, canvas_length=16, tie_word_embeddings=True,
    pad_token_id=0, eos_token_id=1, bos_token_id=2, max_position_embeddings=4096,
)

PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(**_BASE),
    # a CPU benchmark shape: 26B-A4B's structure (5 sliding + 1 full, top-8 of many experts) scaled down
    "mid": ModelConfig(**{**_BASE, **dict(
        vocab_size=8192, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_experts=16,
        top_k_experts=4, num_hidden_layers=6, layer_types=(SLIDING,) * 5 + (FULL,), num_attention_heads=4,
        sliding_head_dim=64, sliding_num_kv_heads=2, full_head_dim=128, full_num_kv_heads=1,
        sliding_window=128, canvas_length=64, max_position_embeddings=8192)}),
}


def preset(name: str, **overrides) -> ModelConfig:
    """A named shape, optionally with fields replaced."""
    if name not in PRESETS:
        raise ValueError(f"preset: unknown {name!r}; choose one of {sorted(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)


def random_weights(config: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                   device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Canonical-name weights (see ``dgserve.checkpoint.expected_shapes``) drawn from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in expected_shapes(config).items():
        if name.endswith("layer_scalar"):
            t = 0.5 + torch.rand(shape, generator=g)
        elif name.endswith(("norm.weight", "router.scale", "per_expert_scale")):
            t = 1 + 0.3 * torch.randn(shape, generator=g)
        else:
            t = 0.02 * torch.randn(shape, generator=g)
        out[name] = t.to(device=device, dtype=dtype)
    return out


def make_random_checkpoint(path: str | os.PathLike, config: ModelConfig | str = "tiny", seed: int = 0,
                           dtype: torch.dtype = torch.float32) -> str:
    """Write a random checkpoint (config.json + model.safetensors) to ``path``; returns the path."""
    config = preset(config) if isinstance(config, str) else config
    save_weights(path, config, random_weights(config, seed), dtype=dtype)
    return str(path)
