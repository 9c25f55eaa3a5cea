"""The names and shapes of a DiffusionGemma checkpoint's text tensors (docs/generation.md, "Checkpoint tensors").

Contract: `expected_shapes(config)` maps every canonical name the model needs to its shape; `hf_names(canonical)`
gives the Hugging Face names it may be stored under, preferred first (``model.decoder.`` before
``model.encoder.language_model.``); `_is_vision(name)` tells the vision tensors the text loader ignores. The file
names (``model.safetensors``, its index) and `CheckpointError` (a ValueError naming the file or tensor) are shared
by the reader (`dgserve.model.checkpoint`) and the writer (`dgserve.model.checkpoint_save`).
"""

from __future__ import annotations

from dgserve.config import ModelConfig

DECODER = "model.decoder."
ENCODER = "model.encoder.language_model."
LM_HEAD = "lm_head.weight"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_ENCODER_SCALAR = ".encoder_layer_scalar"


class CheckpointError(ValueError):
    """A checkpoint dgserve cannot load; the message names the file or tensor."""


# ------------------------------------------------------------------------------------------------------------ names


def _layer_shapes(config: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape for layer i (docs/generation.md, "Checkpoint tensors")."""
    H, D, E, I = config.hidden_size, config.intermediate_size, config.num_experts, config.moe_intermediate_size
    nh, hd, nkv = config.num_attention_heads, config.head_dim(i), config.num_kv_heads(i)
    shapes = {
        "input_layernorm.weight": (H,),
        "self_attn.q_proj.weight": (nh * hd, H),
        "self_attn.k_proj.weight": (nkv * hd, H),
        "self_attn.v_proj.weight": (nkv * hd, H),  # sliding layers only (deleted below for full ones)
        "self_attn.o_proj.weight": (H, nh * hd),
        "self_attn.q_norm.weight": (hd,),
        "self_attn.k_norm.weight": (hd,),
        "post_attention_layernorm.weight": (H,),
        "pre_feedforward_layernorm.weight": (H,),
        "mlp.gate_proj.weight": (D, H),
        "mlp.up_proj.weight": (D, H),
        "mlp.down_proj.weight": (H, D),
        "post_feedforward_layernorm_1.weight": (H,),
        "router.proj.weight": (E, H),
        "router.scale": (H,),
        "router.per_expert_scale": (E,),
        "pre_feedforward_layernorm_2.weight": (H,),
        "experts.gate_up_proj": (E, 2 * I, H),  # rows [0, I) gate, [I, 2I) up
        "experts.down_proj": (E, H, I),
        "post_feedforward_layernorm_2.weight": (H,),
        "post_feedforward_layernorm.weight": (H,),
        "layer_scalar": (1,),
        "encoder_layer_scalar": (1,),
    }
    if not config.is_sliding(i):
        del shapes["self_attn.v_proj.weight"]
    return {f"layers.{i}.{k}": v for k, v in shapes.items()}


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape of every tensor the model needs (`lm_head.weight`, optional, is not listed)."""
    V, H, D = config.vocab_size, config.hidden_size, config.intermediate_size
    shapes = {
        "embed_tokens.weight": (V, H),
        "norm.weight": (H,),
        "self_conditioning.pre_norm.weight": (H,),
        "self_conditioning.gate_proj.weight": (D, H),
        "self_conditioning.up_proj.weight": (D, H),
        "self_conditioning.down_proj.weight": (H, D),
    }
    for i in range(config.num_hidden_layers):
        shapes.update(_layer_shapes(config, i))
    return shapes


def hf_names(canonical: str) -> tuple[str, ...]:
    """HF names a canonical tensor may be stored under, preferred first."""
    if canonical == LM_HEAD:
        return (LM_HEAD,)
    if canonical.endswith(_ENCODER_SCALAR):
        return (ENCODER + canonical[: -len(_ENCODER_SCALAR)] + ".layer_scalar",)
    if canonical.startswith("self_conditioning.") or canonical.endswith(".layer_scalar"):
        return (DECODER + canonical,)  # decoder-only: never tied to the encoder
    return (DECODER + canonical, ENCODER + canonical)


def _is_vision(name: str) -> bool:
    """Vision tower / projector tensors (ignored): outside the language model, with 'vision' in a component."""
    if name == LM_HEAD or name.startswith((DECODER, ENCODER)):
        return False
    return any("vision" in part for part in name.split("."))
