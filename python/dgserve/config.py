"""Model and generation configuration read from a Hugging Face checkpoint directory (docs/generation.md,
"Configuration").

`ModelConfig` is the text model as dgserve runs it: one head geometry per layer type (sliding / full), no
vision, every value resolved the way transformers 5.23 resolves it; frozen and validated on construction, a bad
value raises `ConfigError` (a ValueError) whose message starts with the offending JSON field. The checkpoint's
`generation_config.json` is read here (`read_generation_config`, `generation_eos_token_ids`); its sampling
defaults become a `SamplingParams` (`SamplingParams.from_generation_config`, the one table of knobs).
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from dataclasses import dataclass
from typing import Any

SLIDING = "sliding_attention"
FULL = "full_attention"
LAYER_TYPES = (SLIDING, FULL)
ACTIVATION = "gelu_pytorch_tanh"

# transformers 5.23 DiffusionGemmaTextConfig defaults for the keys dgserve reads (docs/generation.md, "Configuration").
_TEXT_DEFAULTS: dict[str, Any] = dict(
    vocab_size=262_144,
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=30,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    global_head_dim=512,
    sliding_window=512,
    rms_norm_eps=1e-6,
    max_position_embeddings=131_072,
    final_logit_softcapping=30.0,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)
_DEFAULT_ROPE: dict[str, dict[str, Any]] = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
_PER_LAYER_KEYS = ("head_dim", "num_key_value_heads")

# Written by `to_dict`: a tiny Gemma 4 vision tower so transformers can build the model (dgserve ignores it).
# position_embedding_size is shrunk from 10240 so the placeholder table stays small (checkpoint.py writes it).
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

_T = "text_config"


class ConfigError(ValueError):
    """A configuration value dgserve cannot use; the message starts with the field (e.g. `text_config.head_dim`)."""


# ---------------------------------------------------------------------------------------------------- parsing helpers


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _name(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _int(d: dict[str, Any], key: str, where: str, default: Any = None, *, required: bool = False) -> Any:
    """d[key] as an int; absent -> default (or ConfigError if required). Null counts as absent only if required.
    Typed Any: the default is returned as given, None included."""
    if key not in d or (required and d[key] is None):
        if required:
            raise ConfigError(f"{_name(where, key)}: is required")
        return default
    v = d[key]
    if not _is_int(v):
        raise ConfigError(f"{_name(where, key)}: expected an integer, got {v!r}")
    return v


def _float(d: dict[str, Any], key: str, where: str, default: Any = None) -> Any:
    """d[key] as a finite float (ints accepted); absent -> default (returned as given, hence Any)."""
    if key not in d:
        return default
    v = d[key]
    if not (_is_int(v) or isinstance(v, float)) or not math.isfinite(v):
        raise ConfigError(f"{where}.{key}: expected a number, got {v!r}")
    return float(v)


def _optional_id(d: dict[str, Any], key: str, where: str, default: Any) -> Any:
    """A token id field: int, list of ints (eos only) or null. Lists become tuples."""
    if key not in d:
        return default
    v = d[key]
    if v is None or _is_int(v):
        return v
    if key == "eos_token_id" and isinstance(v, (list, tuple)) and all(_is_int(x) for x in v):
        return tuple(v)
    raise ConfigError(f"{where}.{key}: expected an integer or null, got {v!r}")


def _read_json(file: pathlib.Path) -> dict[str, Any]:
    """Parse a JSON object from `file`; any failure -> ConfigError naming the file."""
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{file}: file not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{file}: cannot parse JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


# ------------------------------------------------------------------------------------------------ text_config parts


def _split_top_level(d: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(text_config dict, top-level dict). Accepts the full config.json or a bare text_config."""
    model_type = d.get("model_type")
    if "text_config" not in d and model_type != "diffusion_gemma":  # a bare text_config
        if model_type not in (None, "diffusion_gemma_text"):
            raise ConfigError(f"model_type: {model_type!r} is not supported (expected 'diffusion_gemma')")
        return d, d
    if model_type not in (None, "diffusion_gemma"):
        raise ConfigError(f"model_type: {model_type!r} is not supported (expected 'diffusion_gemma')")
    text = d.get("text_config") or {}  # absent or null: transformers' defaults for the text model
    if not isinstance(text, dict):
        raise ConfigError(f"text_config: expected an object, got {type(text).__name__}")
    if text.get("model_type") not in (None, "diffusion_gemma_text"):
        raise ConfigError(
            f"text_config.model_type: {text['model_type']!r} is not supported (expected 'diffusion_gemma_text')"
        )
    return text, d


def _reject_unsupported(text: dict[str, Any]) -> None:
    """Features of the config class that the dgserve model does not implement."""
    if text.get("attention_bias"):
        raise ConfigError(
            f"{_T}.attention_bias: {json.dumps(text['attention_bias'])} is not supported "
            "(dgserve has no attention biases)"
        )
    bidir = text.get("use_bidirectional_attention")
    if bidir == "all":
        raise ConfigError(
            f"{_T}.use_bidirectional_attention: 'all' is not supported (the encoder must be causal "
            "for text; 'all' also changes the sliding window)"
        )
    if bidir not in (None, "vision"):
        raise ConfigError(f"{_T}.use_bidirectional_attention: {bidir!r} is not supported (expected null or 'vision')")
    act = text.get("hidden_activation", ACTIVATION)
    if act != ACTIVATION:
        raise ConfigError(f"{_T}.hidden_activation: {act!r} is not supported (only {ACTIVATION!r})")


def _layer_types(text: dict[str, Any], n_layers: int) -> tuple[str, ...]:
    """Explicit list, or layer i full iff (i+1) % 6 == 0; the last layer is always forced to full."""
    given = text.get("layer_types")
    if given is None:
        types = [SLIDING if (i + 1) % 6 else FULL for i in range(n_layers)]
    else:
        if not isinstance(given, (list, tuple)) or any(t not in LAYER_TYPES for t in given):
            raise ConfigError(f"{_T}.layer_types: expected a list of {LAYER_TYPES}, got {given!r}")
        if len(given) != n_layers:
            raise ConfigError(f"{_T}.layer_types: has {len(given)} entries but num_hidden_layers is {n_layers}")
        types = list(given)
    if types:
        types[-1] = FULL  # transformers forces this (with a warning)
    return tuple(types)


def _per_layer_overrides(plc: Any, n_layers: int) -> dict[int, dict[str, Any]]:
    """per_layer_config {"05": {"head_dim": 512, "num_key_value_heads": 2}} -> {5: {...}}, validated."""
    where = f"{_T}.per_layer_config"
    if not isinstance(plc, dict):
        raise ConfigError(f"{where}: expected an object keyed by layer index, got {plc!r}")
    out: dict[int, dict[str, Any]] = {}
    for key, overrides in plc.items():
        try:
            layer = int(key)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}.{key}: key is not a layer index") from None
        if not 0 <= layer < n_layers:
            raise ConfigError(f"{where}.{key}: layer index out of range [0, {n_layers})")
        if not isinstance(overrides, dict):
            raise ConfigError(f"{where}.{key}: expected an object, got {overrides!r}")
        for name in overrides:
            if name not in _PER_LAYER_KEYS:
                raise ConfigError(
                    f"{where}.{key}.{name}: per-layer override not supported (only {', '.join(_PER_LAYER_KEYS)})"
                )
            _int(overrides, name, f"{where}.{key}", required=True)
        out[layer] = overrides
    return out


def _head_geometry(text: dict[str, Any], types: tuple[str, ...]) -> tuple[tuple[int, int], tuple[int, int]]:
    """((sliding head_dim, kv heads), (full head_dim, kv heads)), resolved as docs/generation.md, "Configuration" says.

    per_layer_config, when present, overrides head_dim / num_key_value_heads per layer and the init-only
    global_head_dim / num_global_key_value_heads are ignored; otherwise full layers take those two
    (defaults 512 and num_key_value_heads). dgserve needs one geometry per layer type.
    """
    hd = _int(text, "head_dim", _T, _TEXT_DEFAULTS["head_dim"])
    nkv = _int(text, "num_key_value_heads", _T, _TEXT_DEFAULTS["num_key_value_heads"])
    plc = text.get("per_layer_config")
    if plc is None:
        g_hd = _int(text, "global_head_dim", _T, _TEXT_DEFAULTS["global_head_dim"])
        g_kv = _int(text, "num_global_key_value_heads", _T, None)
        g_kv = nkv if g_kv is None else g_kv
        per_layer = [(g_hd, g_kv) if t == FULL else (hd, nkv) for t in types]
    else:
        overrides = _per_layer_overrides(plc, len(types))
        per_layer = [
            (o.get("head_dim", hd), o.get("num_key_value_heads", nkv))
            for o in (overrides.get(i, {}) for i in range(len(types)))
        ]
    geometry = []
    for kind in (SLIDING, FULL):
        found = {g for g, t in zip(per_layer, types, strict=True) if t == kind}
        if len(found) > 1:
            raise ConfigError(
                f"{_T}.per_layer_config: {kind} layers have different (head_dim, num_key_value_heads) "
                f"{sorted(found)}; dgserve supports one geometry per layer type"
            )
        geometry.append(found.pop() if found else (hd, nkv))
    return geometry[0], geometry[1]


def _rope(text: dict[str, Any]) -> tuple[float, float, float]:
    """(theta_sliding, theta_full, partial_rotary_factor_full) from rope_parameters (docs/generation.md, "RoPE")."""
    where = f"{_T}.rope_parameters"
    rp = text.get("rope_parameters")
    rp = _DEFAULT_ROPE if rp is None else rp
    if not isinstance(rp, dict):
        raise ConfigError(f"{where}: expected an object keyed by layer type, got {rp!r}")
    for kind in LAYER_TYPES:
        if not isinstance(rp.get(kind), dict):
            raise ConfigError(f"{where}.{kind}: missing (expected {{'rope_type', 'rope_theta', ...}})")
    s, f = rp[SLIDING], rp[FULL]
    s_type = s.get("rope_type", s.get("type", "default"))
    if s_type != "default":
        raise ConfigError(f"{where}.{SLIDING}.rope_type: {s_type!r} is not supported (only 'default')")
    if _float(s, "partial_rotary_factor", f"{where}.{SLIDING}", 1.0) != 1.0:
        raise ConfigError(f"{where}.{SLIDING}.partial_rotary_factor: must be 1.0 for 'default' RoPE")
    f_type = f.get("rope_type", f.get("type", "default"))
    if f_type not in ("proportional", "default"):
        raise ConfigError(f"{where}.{FULL}.rope_type: {f_type!r} is not supported (only 'proportional' or 'default')")
    prf = _float(f, "partial_rotary_factor", f"{where}.{FULL}", 1.0)
    if f_type == "default" and prf != 1.0:
        raise ConfigError(f"{where}.{FULL}.partial_rotary_factor: must be 1.0 for 'default' RoPE (use 'proportional')")
    if f_type == "proportional" and _float(f, "factor", f"{where}.{FULL}", 1.0) != 1.0:
        raise ConfigError(f"{where}.{FULL}.factor: RoPE scaling is not supported (must be 1.0)")
    for kind in LAYER_TYPES:
        if rp[kind].get("rope_theta") is None:
            raise ConfigError(f"{where}.{kind}.rope_theta: is required")
    return _float(s, "rope_theta", f"{where}.{SLIDING}"), _float(f, "rope_theta", f"{where}.{FULL}"), prf


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
        for name in ("rope_theta_sliding", "rope_theta_full", "rms_norm_eps"):
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
        theta_s, theta_f, prf = _rope(text)
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
            rms_norm_eps=_float(text, "rms_norm_eps", _T, _TEXT_DEFAULTS["rms_norm_eps"]),
            final_logit_softcapping=softcap,
            canvas_length=_int(top, "canvas_length", "", 256),
            tie_word_embeddings=top.get("tie_word_embeddings", text.get("tie_word_embeddings", True)),
        )

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> ModelConfig:
        """Read `path/config.json` (or `path` itself when it is a file). Missing or unparsable file -> ConfigError
        naming the file."""
        path = pathlib.Path(path)
        return cls.from_dict(_read_json(path if path.is_file() else path / "config.json"))

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


# ------------------------------------------------------------------------------------------- generation_config.json


def read_generation_config(path: str | os.PathLike[str]) -> tuple[dict[str, Any], pathlib.Path]:
    """(the generation_config.json object, its path) for a checkpoint directory or the file itself; a directory
    without one gives {} (every default). Unparsable → ConfigError naming the file. The sampling knobs in it are
    read by ``SamplingParams.from_generation_config``; ``generation_eos_token_ids`` reads the EOS ids."""
    path = pathlib.Path(path)
    file = path if path.is_file() else path / "generation_config.json"
    if not file.is_file():
        return {}, file
    return _read_json(file), file


def generation_eos_token_ids(source: dict[str, Any] | str | os.PathLike[str]) -> tuple[int, ...]:
    """generation_config's ``eos_token_id`` (an int, a list of ints, or absent/null) as a tuple, () when unset;
    anything else → ConfigError naming the field (and the file, when ``source`` is a checkpoint directory or the
    file). Not a sampling knob: the engine's end-of-sequence ids, which fall back to config.json's when empty."""
    if not isinstance(source, dict):
        d, file = read_generation_config(source)
        try:
            return generation_eos_token_ids(d)
        except ConfigError as e:
            raise ConfigError(f"{e} (in {file})") from None
    eos = source.get("eos_token_id")
    if eos is None:
        return ()
    ids = (eos,) if _is_int(eos) else eos
    if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in ids):
        raise ConfigError(
            f"generation_config.eos_token_id: expected a non-negative integer or a list of them, got {eos!r}"
        )
    return tuple(ids)
