"""Random DiffusionGemma checkpoints the package can make itself (demo, benchmarks, tests).

``PRESETS`` are named shapes: ``tiny`` is the parity tests' model (docs/exactness.md, "Test models"), ``mid`` a
CPU benchmark size. Weights are drawn like transformers' init (normal, std 0.02) except that norms, router scales
and layer scalars are perturbed around 1 so every parameter matters.
"""

from __future__ import annotations

import dataclasses
import os
import zlib

import torch

from dgserve.config import FULL, SLIDING, ModelConfig
from dgserve.model.checkpoint import expected_shapes, save_weights

_BASE = ModelConfig(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_experts=4,
    top_k_experts=2,
    num_hidden_layers=3,
    layer_types=(SLIDING, SLIDING, FULL),
    num_attention_heads=4,
    sliding_head_dim=16,
    sliding_num_kv_heads=2,
    full_head_dim=32,
    full_num_kv_heads=1,
    sliding_window=8,
    rope_theta_sliding=10_000.0,
    rope_theta_full=1_000_000.0,
    partial_rotary_factor_full=0.25,
    rms_norm_eps=1e-6,
    final_logit_softcapping=30.0,
    canvas_length=16,
    tie_word_embeddings=True,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
    max_position_embeddings=4096,
)

PRESETS: dict[str, ModelConfig] = {
    "tiny": _BASE,
    # a CPU benchmark shape: 26B-A4B's structure (5 sliding + 1 full, top-8 of many experts) scaled down
    "mid": dataclasses.replace(
        _BASE,
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_experts=16,
        top_k_experts=4,
        num_hidden_layers=6,
        layer_types=(SLIDING,) * 5 + (FULL,),
        num_attention_heads=4,
        sliding_head_dim=64,
        sliding_num_kv_heads=2,
        full_head_dim=128,
        full_num_kv_heads=1,
        sliding_window=128,
        canvas_length=64,
        max_position_embeddings=8192,
    ),
    # the real DiffusionGemma 26B-A4B shape (docs/generation.md, "Notation"): 5 × (5 sliding + 1 full), 128
    # experts top-8
    "26b-a4b": dataclasses.replace(
        _BASE,
        vocab_size=262_144,
        hidden_size=2816,
        intermediate_size=2112,
        moe_intermediate_size=704,
        num_experts=128,
        top_k_experts=8,
        num_hidden_layers=30,
        layer_types=((SLIDING,) * 5 + (FULL,)) * 5,
        num_attention_heads=16,
        sliding_head_dim=256,
        sliding_num_kv_heads=8,
        full_head_dim=512,
        full_num_kv_heads=2,
        sliding_window=1024,
        canvas_length=256,
        max_position_embeddings=262_144,
        eos_token_id=(1, 106, 50),
    ),
}


def preset(name: str, **overrides) -> ModelConfig:
    """A named shape, optionally with fields replaced."""
    if name not in PRESETS:
        raise ValueError(f"preset: unknown {name!r}; choose one of {sorted(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)


def random_weights(
    config: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """Canonical-name weights (see ``dgserve.model.checkpoint_layout.expected_shapes``) drawn from ``seed``.

    Each tensor has its own generator seeded by (seed, name), and is drawn directly on ``device``, so one
    tensor can be regenerated alone (``random_tensor``) and no CPU copy of a large model is ever made.
    """
    return {name: random_tensor(name, shape, seed, dtype, device) for name, shape in expected_shapes(config).items()}


def random_tensor(
    name: str,
    shape: tuple[int, ...],
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """The tensor ``random_weights`` gives for ``name`` (same device kind → same values)."""
    g = torch.Generator(device=device).manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 63))
    if name.endswith("layer_scalar"):
        t = 0.5 + torch.rand(shape, generator=g, device=device)
    elif name.endswith(("norm.weight", "router.scale", "per_expert_scale")):
        t = 1 + 0.3 * torch.randn(shape, generator=g, device=device)
    else:
        t = 0.02 * torch.randn(shape, generator=g, device=device)
    return t.to(dtype)


def make_random_checkpoint(
    path: str | os.PathLike[str], config: ModelConfig | str = "tiny", seed: int = 0, dtype: torch.dtype = torch.float32
) -> str:
    """Write a random checkpoint (config.json + model.safetensors) to ``path``; returns the path."""
    config = preset(config) if isinstance(config, str) else config
    save_weights(path, config, random_weights(config, seed), dtype=dtype)
    return str(path)
