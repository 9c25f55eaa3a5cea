"""The vision tower's configuration: config.json's ``vision_config`` with the checkpoint's image preprocessing
(docs/images.md, "The vision path").

Contract: ``VisionConfig.from_dict(config_json)`` (or ``from_pretrained(path)``, which also reads the checkpoint's
image processor files: ``dgserve.media.processor``) is None when the checkpoint declares no vision tower, else a
frozen record of the tower's shape, the image token ids and the preprocessing settings; a setting the tower
cannot run raises `VisionConfigError` (a ValueError) naming the field. The tower itself is
`dgserve.model.vision.VisionTower`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dgserve.media.processor import DEFAULT_SOFT_TOKENS, SUPPORTED_SOFT_TOKENS, ImageProcessorConfig

DEFAULT_PROCESSOR = ImageProcessorConfig()  # transformers' Gemma 4 image processor defaults


class VisionConfigError(ValueError):
    """A vision_config dgserve cannot use; the message names the field."""


@dataclass(frozen=True)
class VisionConfig:
    """``vision_config`` (model_type gemma4_vision) plus the top-level image token ids of config.json."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    pooling_kernel_size: int
    patch_size: int
    position_embedding_size: int
    use_clipped_linears: bool
    standardize: bool
    output_proj_dims: int
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int
    max_soft_tokens: int = DEFAULT_SOFT_TOKENS  # soft tokens per image at most (``processor.max_soft_tokens``)
    # the checkpoint's image preprocessing (processor_config.json / preprocessor_config.json: docs/images.md)
    processor: ImageProcessorConfig = DEFAULT_PROCESSOR

    @classmethod
    def from_dict(cls, top: dict[str, Any], processor: ImageProcessorConfig | None = None) -> VisionConfig | None:
        """From a top-level config.json dict; None when it has no ``vision_config``. ``processor``: the
        checkpoint's image processor (``from_pretrained`` reads it); None: transformers' defaults with config.json's
        ``vision_soft_tokens_per_image``."""
        v = top.get("vision_config")
        if not isinstance(v, dict):
            return None
        act = v.get("hidden_activation", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise VisionConfigError(f"vision_config.hidden_activation: {act!r} is not supported")
        rope = v.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise VisionConfigError(f"vision_config.rope_parameters.rope_type: {rope.get('rope_type')!r}")
        if v.get("attention_bias"):
            raise VisionConfigError("vision_config.attention_bias: true is not supported")
        hidden = int(v.get("hidden_size", 768))
        heads = int(v.get("num_attention_heads", 12))
        patch, pooling = int(v.get("patch_size", 16)), int(v.get("pooling_kernel_size", 3))
        if processor is None:
            soft = top.get("vision_soft_tokens_per_image")
            if soft is not None and soft not in SUPPORTED_SOFT_TOKENS:
                raise VisionConfigError(f"vision_soft_tokens_per_image: {soft} is not one of {SUPPORTED_SOFT_TOKENS}")
            processor = ImageProcessorConfig.from_dict({}, "", soft, (patch, pooling))
        processor.check_tower(patch, pooling)
        return cls(
            hidden_size=hidden,
            intermediate_size=int(v.get("intermediate_size", 3072)),
            num_hidden_layers=int(v.get("num_hidden_layers", 16)),
            num_attention_heads=heads,
            num_key_value_heads=int(v.get("num_key_value_heads", 12)),
            head_dim=int(v.get("head_dim") or hidden // heads),
            rms_norm_eps=float(v.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", 100.0)),
            pooling_kernel_size=pooling,
            patch_size=patch,
            position_embedding_size=int(v.get("position_embedding_size", 10240)),
            use_clipped_linears=bool(v.get("use_clipped_linears", False)),
            standardize=bool(v.get("standardize", False)),
            output_proj_dims=int(v.get("output_proj_dims") or hidden),
            image_token_id=int(top.get("image_token_id", 258880)),
            boi_token_id=int(top.get("boi_token_id", 255999)),
            eoi_token_id=int(top.get("eoi_token_id", 258882)),
            max_soft_tokens=processor.max_soft_tokens,
            processor=processor,
        )

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> VisionConfig | None:
        """config.json's vision tower with the checkpoint's image processor files (ValueError naming the file and
        the key: media/processor.py)."""
        top = json.loads((Path(path) / "config.json").read_text())
        v = top.get("vision_config")
        if not isinstance(v, dict):
            return None
        tower = (int(v.get("patch_size", 16)), int(v.get("pooling_kernel_size", 3)))
        return cls.from_dict(top, ImageProcessorConfig.from_pretrained(path, top, tower))
