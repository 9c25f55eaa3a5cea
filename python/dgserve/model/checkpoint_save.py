"""Writing a DiffusionGemma checkpoint in Hugging Face layout: the inverse of `dgserve.model.checkpoint`'s loader.

Contract: `save_weights(path, config, weights, dtype)` writes ``config.json`` and ``model.safetensors`` under the HF
names (`dgserve.model.checkpoint_layout`) so that transformers' ``DiffusionGemmaForBlockDiffusion.from_pretrained``
loads it with no missing or unexpected keys, adding zero placeholders for the tiny vision tower that
``ModelConfig.to_dict`` declares. A missing, unexpected or misshapen tensor raises `CheckpointError`.
"""

from __future__ import annotations

import json
import os
import pathlib

import torch
from safetensors.torch import save_file

from dgserve.config import TINY_VISION_CONFIG, ModelConfig
from dgserve.model.checkpoint_layout import LM_HEAD, SINGLE_FILE, CheckpointError, expected_shapes, hf_names


def _vision_placeholders(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of the tiny vision tower that `config.to_dict()` declares (zeros; dgserve never runs it)."""
    v = TINY_VISION_CONFIG
    h, hd, inner = v["hidden_size"], v["head_dim"], v["intermediate_size"]
    q, kv = v["num_attention_heads"] * hd, v["num_key_value_heads"] * hd
    tower = "model.encoder.vision_tower."
    shapes = {
        tower + "patch_embedder.position_embedding_table": (2, v["position_embedding_size"], h),
        tower + "patch_embedder.input_proj.weight": (h, 3 * v["patch_size"] ** 2),
        "model.encoder.embed_vision.embedding_projection.weight": (config.hidden_size, h),
    }
    for layer in range(v["num_hidden_layers"]):
        p = f"{tower}encoder.layers.{layer}."
        shapes.update(
            {
                p + "self_attn.q_proj.linear.weight": (q, h),
                p + "self_attn.k_proj.linear.weight": (kv, h),
                p + "self_attn.v_proj.linear.weight": (kv, h),
                p + "self_attn.o_proj.linear.weight": (h, q),
                p + "self_attn.q_norm.weight": (hd,),
                p + "self_attn.k_norm.weight": (hd,),
                p + "mlp.gate_proj.linear.weight": (inner, h),
                p + "mlp.up_proj.linear.weight": (inner, h),
                p + "mlp.down_proj.linear.weight": (h, inner),
            }
        )
        for norm in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
            shapes[f"{p}{norm}_layernorm.weight"] = (h,)
    return shapes


def _check_for_save(config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    expected = expected_shapes(config)
    for name, t in weights.items():
        shape: tuple[int, ...]
        if name == LM_HEAD:
            shape = (config.vocab_size, config.hidden_size)
        elif name in expected:
            shape = expected[name]
        else:
            raise CheckpointError(f"unexpected tensor {name}: not a canonical DiffusionGemma name for this config")
        if tuple(t.shape) != shape:
            raise CheckpointError(f"{name}: shape mismatch, expected {list(shape)}, got {list(t.shape)}")
    missing = [name for name in expected if name not in weights]
    if missing:
        raise CheckpointError(
            f"missing tensor {missing[0]}" + (f" (and {len(missing) - 1} more)" if missing[1:] else "")
        )


def save_weights(
    path: str | os.PathLike[str],
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    dtype: torch.dtype = torch.float32,
) -> None:
    """Write `path/config.json` (`config.to_dict()` plus `dtype`) and `path/model.safetensors` in HF names:
    the inverse of `load_weights`, loadable by transformers' `DiffusionGemmaForBlockDiffusion.from_pretrained`
    with no missing or unexpected keys (zero placeholders for the tiny vision tower are added).

    Shared and decoder weights go under `model.decoder.`, `layers.{i}.encoder_layer_scalar` under
    `model.encoder.language_model.layers.{i}.layer_scalar`; `lm_head.weight` only when given and different
    from the embedding. Floating tensors are cast to `dtype`. Meant for small checkpoints: it builds the whole
    state dict in memory. Raises CheckpointError on a missing, unexpected or misshapen tensor.
    """
    _check_for_save(config, weights)
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        if name == LM_HEAD and torch.equal(t.to(weights["embed_tokens.weight"]), weights["embed_tokens.weight"]):
            continue
        t = t.detach().to(device="cpu", dtype=dtype if t.is_floating_point() else t.dtype, copy=True)
        tensors[hf_names(name)[0]] = t.contiguous()
    for name, shape in _vision_placeholders(config).items():
        tensors[name] = torch.zeros(shape, dtype=dtype)
    save_file(tensors, str(path / SINGLE_FILE), metadata={"format": "pt"})
    cfg = config.to_dict()
    cfg["dtype"] = str(dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
