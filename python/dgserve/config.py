"""Model configuration read from a Hugging Face checkpoint directory (docs/generation.md, "Configuration").

`ModelConfig` is the text model as dgserve runs it: one head geometry per layer type (sliding / full), no
vision, every value resolved the way transformers 5.23 resolves it (`dgserve.text_config`); frozen and validated
on construction, a bad value raises `ConfigError` (a ValueError) whose message starts with the offending JSON
field. The checkpoint's `generation_config.json` is read by `dgserve.generation_config` (`read_generation_config`,
`generation_eos_token_ids`, importable from here too); its sampling defaults become a `SamplingParams`
(`SamplingParams.from_generation_config`, the one table of knobs).
"""

from __future__ import annotations

import os
import pathlib
from dataclasses import dataclass
from typing import Any

from dgserve.config_fields import ConfigError as ConfigError
from dgserve.config_fields import _float, _int, _is_int, _optional_id, _read_json
from dgserve.config_fields import merge_overrides as merge_overrides
from dgserve.config_fields import parse_hf_overrides as parse_hf_overrides
from dgserve.generation_config import generation_eos_token_ids as generation_eos_token_ids
from dgserve.generation_config import read_generation_config as read_generation_config
from dgserve.text_config import (
    _T,
    _TEXT_DEFAULTS,
    _head_geometry,
    _layer_types,
    _reject_unsupported,
    _rope,
    _split_top_level,
)
from dgserve.text_config import ACTIVATION as ACTIVATION
from dgserve.text_config import FULL as FULL
from dgserve.text_config import LAYER_TYPES as LAYER_TYPES
from dgserve.text_config import SLIDING as SLIDING

# Written by `to_dict`: a tiny Gemma 4 vision tower so transformers can build the model (dgserve ignores it).
# position_embedding_size is shrunk from 10240 so the placeholder table stays small (model/checkpoint_save.py
# writes it).
TINY_VISION_CONFIG: dict[str, Any] = dict(
    model_type="gemma4_vision",
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=8,
    patch_size=16,
    position_embedding_size=64,
    use_clipped_linears=False,
    standardize=False,
)


def read_config_json(path: pathlib.Path, hf_overrides: dict[str, Any] | str | None = None) -> dict[str, Any]:
    """`path/config.json` (or the file `path`) with ``hf_overrides`` deep-merged into it (``merge_overrides``)."""
    data = _read_json(path if path.is_file() else path / "config.json")
    return merge_overrides(data, parse_hf_overrides(hf_overrides))


# ------------------------------------------------------------------------------------------------------ ModelConfig

# dataclass field -> the JSON field named in error messages
_JSON_NAMES = {
    "sliding_head_dim": f"{_T}.head_dim",
    "sliding_num_kv_heads": f"{_T}.num_key_value_heads",
    "full_head_dim": f"{_T}.per_layer_config.head_dim (full layers; or global_head_dim)",
    "full_num_kv_heads": f"{_T}.per_layer_config.num_key_value_heads (full layers; or num_global_key_value_heads)",
    "rope_theta_sliding": f"{_T}.rope_parameters.{SLIDING}.rope_theta",
    "rope_theta_full": f"{_T}.rope_parameters.{FULL}.rope_theta",
    "partial_rotary_factor_full": f"{_T}.rope_parameters.{FULL}.partial_rotary_factor",
    "rope_factor_full": f"{_T}.rope_parameters.{FULL}.factor",
    "canvas_length": "canvas_length",
    "tie_word_embeddings": "tie_word_embeddings",
}
_POSITIVE_INTS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_experts",
    "top_k_experts",
    "num_hidden_layers",
    "num_attention_heads",
    "sliding_head_dim",
    "sliding_num_kv_heads",
    "full_head_dim",
    "full_num_kv_heads",
    "sliding_window",
    "canvas_length",
    "max_position_embeddings",
)


def _json_name(field: str) -> str:
    return _JSON_NAMES.get(field, f"{_T}.{field}")


@dataclass(frozen=True)
class ModelConfig:
    """The DiffusionGemma text model (docs/generation.md, "Notation" and "Configuration"). Symbols: V vocab,
    H hidden, D dense MLP width, E experts, K top-k, I expert width, L layers, nh query heads, W sliding window,
    C canvas length.

    `layer_types[i]` is "sliding_attention" or "full_attention"; the last layer is always full. Sliding layers
    have `sliding_head_dim` / `sliding_num_kv_heads`, full layers `full_head_dim` / `full_num_kv_heads` (K = V
    there). `eos_token_id` is an int, a tuple of ints (a JSON list) or None; generation stops on
    generation_config.json's ids (`generation_eos_token_ids`) and on these only when that file has none.
    Construction validates every cross-field rule.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_experts: int
    top_k_experts: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    sliding_head_dim: int
    sliding_num_kv_heads: int
    full_head_dim: int
    full_num_kv_heads: int
    sliding_window: int
    rope_theta_sliding: float
    rope_theta_full: float
    partial_rotary_factor_full: float
    rms_norm_eps: float
    final_logit_softcapping: float | None
    canvas_length: int
    tie_word_embeddings: bool
    pad_token_id: int | None
    eos_token_id: int | tuple[int, ...] | None
    bos_token_id: int | None
    max_position_embeddings: int
    rope_factor_full: float = 1.0  # full layers' RoPE scaling: inv_freq / factor (docs/generation.md, "RoPE")

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        for name in _POSITIVE_INTS:
            v = getattr(self, name)
            if not _is_int(v) or v <= 0:
                raise ConfigError(f"{_json_name(name)}: must be a positive integer, got {v!r}")
        self._validate_layers()
        self._validate_numbers()

    def _validate_layers(self) -> None:
        if self.top_k_experts > self.num_experts:
            raise ConfigError(f"{_T}.top_k_experts: {self.top_k_experts} exceeds num_experts {self.num_experts}")
        if len(self.layer_types) != self.num_hidden_layers or any(t not in LAYER_TYPES for t in self.layer_types):
            raise ConfigError(
                f"{_T}.layer_types: expected {self.num_hidden_layers} entries of {LAYER_TYPES}, "
                f"got {self.layer_types!r}"
            )
        if self.layer_types[-1] != FULL:
            raise ConfigError(f"{_T}.layer_types: the last layer must be {FULL!r}")
        for hd_name, kv_name in (("sliding_head_dim", "sliding_num_kv_heads"), ("full_head_dim", "full_num_kv_heads")):
            if getattr(self, hd_name) % 2:
                raise ConfigError(f"{_json_name(hd_name)}: must be even for RoPE, got {getattr(self, hd_name)}")
            if self.num_attention_heads % getattr(self, kv_name):
                raise ConfigError(
                    f"{_json_name(kv_name)}: {getattr(self, kv_name)} does not divide "
                    f"{_T}.num_attention_heads {self.num_attention_heads}"
                )

    def _validate_numbers(self) -> None:
        for name in ("rope_theta_sliding", "rope_theta_full", "rope_factor_full", "rms_norm_eps"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{_json_name(name)}: must be > 0, got {getattr(self, name)!r}")
        if not 0.0 < self.partial_rotary_factor_full <= 1.0:
            raise ConfigError(
                f"{_json_name('partial_rotary_factor_full')}: must be in (0, 1], "
                f"got {self.partial_rotary_factor_full!r}"
            )
        softcap = self.final_logit_softcapping
        if softcap is not None and not softcap > 0:
            raise ConfigError(f"{_T}.final_logit_softcapping: must be > 0 or null, got {softcap!r}")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ConfigError(f"tie_word_embeddings: expected true or false, got {self.tie_word_embeddings!r}")

    # -- per-layer geometry -------------------------------------------------------------------------------------
    def is_sliding(self, layer: int) -> bool:
        """True when `layer` uses sliding-window attention (window W, v_proj present)."""
        return self.layer_types[layer] == SLIDING

    def head_dim(self, layer: int) -> int:
        """Head dim of `layer` (hd_s or hd_f)."""
        return self.sliding_head_dim if self.is_sliding(layer) else self.full_head_dim

    def num_kv_heads(self, layer: int) -> int:
        """KV heads of `layer` (nkv_s or nkv_f)."""
        return self.sliding_num_kv_heads if self.is_sliding(layer) else self.full_num_kv_heads

    # -- JSON ---------------------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a top-level config.json dict (model_type diffusion_gemma, with text_config), or from a bare
        text_config dict that may also carry `canvas_length`. Absent keys take transformers 5.23's defaults;
        vision, bookkeeping and Gemma-4-only keys are ignored. Raises ConfigError naming the field."""
        if not isinstance(d, dict):
            raise ConfigError(f"config: expected a JSON object, got {type(d).__name__}")
        text, top = _split_top_level(d)
        _reject_unsupported(text)
        n_layers = _int(text, "num_hidden_layers", _T, _TEXT_DEFAULTS["num_hidden_layers"])
        if n_layers <= 0:
            raise ConfigError(f"{_T}.num_hidden_layers: must be a positive integer, got {n_layers}")
        types = _layer_types(text, n_layers)
        (s_hd, s_kv), (f_hd, f_kv) = _head_geometry(text, types)
        theta_s, theta_f, prf, factor = _rope(text)
        softcap = (
            None
            if text.get("final_logit_softcapping", 30.0) is None  # explicit null disables it
            else _float(text, "final_logit_softcapping", _T, 30.0)
        )
        ints = {
            k: _int(text, k, _T, _TEXT_DEFAULTS[k])
            for k in (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_attention_heads",
                "sliding_window",
                "max_position_embeddings",
            )
        }
        ints.update(
            {k: _int(text, k, _T, required=True) for k in ("num_experts", "top_k_experts", "moe_intermediate_size")}
        )
        ids = {
            k: _optional_id(text, k, _T, _TEXT_DEFAULTS[k]) for k in ("pad_token_id", "eos_token_id", "bos_token_id")
        }
        return cls(
            **ints,
            **ids,
            num_hidden_layers=n_layers,
            layer_types=types,
            sliding_head_dim=s_hd,
            sliding_num_kv_heads=s_kv,
            full_head_dim=f_hd,
            full_num_kv_heads=f_kv,
            rope_theta_sliding=theta_s,
            rope_theta_full=theta_f,
            partial_rotary_factor_full=prf,
            rope_factor_full=factor,
            rms_norm_eps=_float(text, "rms_norm_eps", _T, _TEXT_DEFAULTS["rms_norm_eps"]),
            final_logit_softcapping=softcap,
            canvas_length=_int(top, "canvas_length", "", 256),
            tie_word_embeddings=top.get("tie_word_embeddings", text.get("tie_word_embeddings", True)),
        )

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike[str], hf_overrides: dict[str, Any] | str | None = None
    ) -> ModelConfig:
        """Read `path/config.json` (or `path` itself when it is a file). Missing or unparsable file -> ConfigError
        naming the file. hf_overrides: a JSON object (or its text) deep-merged into the file first
        (``merge_overrides``; docs/generation.md, "Configuration")."""
        path = pathlib.Path(path)
        return cls.from_dict(read_config_json(path, hf_overrides))

    def to_dict(self) -> dict[str, Any]:
        """An HF-style top-level config.json dict that transformers' DiffusionGemmaConfig loads to the same model,
        with `from_dict(to_dict()) == self`. Full-layer geometry is written as `per_layer_config` (keys zero-padded
        like transformers writes them) and a tiny placeholder `vision_config` is included."""
        width = len(str(self.num_hidden_layers - 1))
        per_layer = {
            str(i).zfill(width): {"head_dim": self.full_head_dim, "num_key_value_heads": self.full_num_kv_heads}
            for i, t in enumerate(self.layer_types)
            if t == FULL
        }
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        text = {
            "model_type": "diffusion_gemma_text",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_experts": self.num_experts,
            "top_k_experts": self.top_k_experts,
            "num_hidden_layers": self.num_hidden_layers,
            "layer_types": list(self.layer_types),
            "num_attention_heads": self.num_attention_heads,
            "head_dim": self.sliding_head_dim,
            "num_key_value_heads": self.sliding_num_kv_heads,
            "per_layer_config": per_layer,
            "sliding_window": self.sliding_window,
            "rope_parameters": {
                SLIDING: {"rope_type": "default", "rope_theta": self.rope_theta_sliding},
                FULL: {
                    "rope_type": "proportional",
                    "partial_rotary_factor": self.partial_rotary_factor_full,
                    "rope_theta": self.rope_theta_full,
                    **({"factor": self.rope_factor_full} if self.rope_factor_full != 1.0 else {}),
                },
            },
            "rms_norm_eps": self.rms_norm_eps,
            "final_logit_softcapping": self.final_logit_softcapping,
            "hidden_activation": ACTIVATION,
            "attention_bias": False,
            "use_bidirectional_attention": "vision",
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "pad_token_id": self.pad_token_id,
            "eos_token_id": eos,
            "bos_token_id": self.bos_token_id,
        }
        return {
            "architectures": ["DiffusionGemmaForBlockDiffusion"],
            "model_type": "diffusion_gemma",
            "canvas_length": self.canvas_length,
            "tie_word_embeddings": self.tie_word_embeddings,
            "text_config": text,
            "vision_config": dict(TINY_VISION_CONFIG),
        }
