"""config.json's ``text_config``, resolved the way transformers 5.23 resolves it (docs/generation.md,
"Configuration").

Contract: each function takes the parsed JSON (the ``text_config`` object, or the top level for
`_split_top_level`) and returns one resolved piece of the text model: the layer types, the head geometry of each
layer type, the RoPE parameters; a value dgserve cannot run raises `ConfigError` naming the JSON field. Absent keys
take transformers' defaults (``_TEXT_DEFAULTS``, ``_DEFAULT_ROPE``). `dgserve.config.ModelConfig.from_dict`
assembles the pieces and validates the cross-field rules.
"""

from __future__ import annotations

import json
from typing import Any

from dgserve.config_fields import ConfigError, _float, _int

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
# full-layer RoPE types whose frequencies dgserve computes exactly as transformers 5.23 does
_FULL_ROPE_TYPES = ("proportional", "default", "linear")

_T = "text_config"


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


def _rope(text: dict[str, Any]) -> tuple[float, float, float, float]:
    """(theta_sliding, theta_full, partial_rotary_factor_full, factor_full) from rope_parameters
    (docs/generation.md, "RoPE").

    Full layers take what transformers 5.23 computes exactly: ``proportional`` (inv_freq / factor), ``linear``
    (the default frequencies / factor; partial_rotary_factor 1) and ``default`` (which ignores ``factor``, as
    transformers does). Sliding layers take ``default`` only. Any other type is refused by name."""
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
    if f_type not in _FULL_ROPE_TYPES:
        raise ConfigError(
            f"{where}.{FULL}.rope_type: {f_type!r} is not supported (only {', '.join(map(repr, _FULL_ROPE_TYPES))})"
        )
    prf = _float(f, "partial_rotary_factor", f"{where}.{FULL}", 1.0)
    if f_type != "proportional" and prf != 1.0:
        raise ConfigError(f"{where}.{FULL}.partial_rotary_factor: must be 1.0 for {f_type!r} RoPE (use 'proportional')")
    factor = 1.0
    if f_type != "default":  # transformers' default RoPE ignores `factor`; linear requires it
        factor = _float(f, "factor", f"{where}.{FULL}", None if f_type == "linear" else 1.0)
        if factor is None:
            raise ConfigError(f"{where}.{FULL}.factor: is required for 'linear' RoPE")
        if factor <= 0:
            raise ConfigError(f"{where}.{FULL}.factor: must be positive, got {factor}")
    for kind in LAYER_TYPES:
        if rp[kind].get("rope_theta") is None:
            raise ConfigError(f"{where}.{kind}.rope_theta: is required")
    return _float(s, "rope_theta", f"{where}.{SLIDING}"), _float(f, "rope_theta", f"{where}.{FULL}"), prf, factor
