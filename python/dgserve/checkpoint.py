"""Safetensors checkpoints in Hugging Face DiffusionGemma layout (spec §2).

Canonical names drop the HF prefix: `embed_tokens.weight`, `norm.weight`, `self_conditioning.*`,
`layers.{i}.*` (the decoder's copy of every shared weight plus its `layer_scalar`), `layers.{i}.encoder_layer_scalar`
(the encoder's own, untied buffer) and `lm_head.weight` only when it is stored and differs from the embedding.
Shared weights may be stored under `model.decoder.` or `model.encoder.language_model.` (decoder preferred);
vision tensors are ignored. NVIDIA ModelOpt NVFP4 expert tensors are rejected for now.
"""
from __future__ import annotations

import json
import pathlib
import re
from collections import defaultdict
from dataclasses import dataclass

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .config import FULL, TINY_VISION_CONFIG, ModelConfig

DECODER = "model.decoder."
ENCODER = "model.encoder.language_model."
LM_HEAD = "lm_head.weight"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
NVFP4_MESSAGE = "NVFP4 ModelOpt checkpoints are not supported yet (issue #7)"

_ENCODER_SCALAR = ".encoder_layer_scalar"
_LAYER_NAME = re.compile(r"^layers\.(\d+)\.(.+)$")
_NVFP4_SUFFIXES = (".weight_scale", ".weight_scale_2", ".input_scale")
_PER_EXPERT = re.compile(r"\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight$")


class CheckpointError(ValueError):
    """A checkpoint dgserve cannot load; the message names the file or tensor."""


# ------------------------------------------------------------------------------------------------------------ names

def _layer_shapes(config: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape for layer i (spec §2.1)."""
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


# ------------------------------------------------------------------------------------------------- reading headers

@dataclass(frozen=True)
class _Stored:
    file: pathlib.Path
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype code: "F32", "BF16", "U8", ...


def _shard_files(path: pathlib.Path) -> tuple[list[pathlib.Path], dict[str, str]]:
    """(safetensors files, index weight_map or {}); model.safetensors wins over an index, as in transformers."""
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE], {}
    index = path / INDEX_FILE
    if not index.is_file():
        raise CheckpointError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE}")
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("weight_map is not an object of file names")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index}: cannot read weight_map ({e!r})") from None
    files = [path / name for name in sorted(set(weight_map.values()))]
    for file in files:
        if not file.is_file():
            raise CheckpointError(f"{file}: shard listed in {INDEX_FILE} is missing")
    return files, weight_map


def _scan(path: pathlib.Path) -> dict[str, _Stored]:
    """HF name -> where it is stored, from the safetensors headers only (no tensor data is read)."""
    files, weight_map = _shard_files(path)
    stored: dict[str, _Stored] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    if name in stored:
                        raise CheckpointError(f"{name}: stored twice ({stored[name].file.name}, {file.name})")
                    meta = f.get_slice(name)
                    stored[name] = _Stored(file, tuple(meta.get_shape()), meta.get_dtype())
        except SafetensorError as e:
            raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from None
    for name, shard in weight_map.items():
        if name not in stored or stored[name].file != path / shard:
            raise CheckpointError(f"{name}: listed in {INDEX_FILE} under {shard} but not stored there")
    return stored


# --------------------------------------------------------------------------------------------------- load planning

def _reject_nvfp4(stored: dict[str, _Stored]) -> None:
    for name, s in stored.items():
        if name.endswith(_NVFP4_SUFFIXES) or (_PER_EXPERT.search(name) and s.dtype == "U8"):
            raise CheckpointError(f"{NVFP4_MESSAGE}: found {name} in {s.file.name}")


def _unexpected_reason(name: str, config: ModelConfig) -> str:
    for prefix in (DECODER, ENCODER):
        m = _LAYER_NAME.match(name[len(prefix):]) if name.startswith(prefix) else None
        if m and int(m.group(1)) >= config.num_hidden_layers:
            return f"layer {m.group(1)} is beyond num_hidden_layers={config.num_hidden_layers}"
        if m and m.group(2) == "self_attn.v_proj.weight" and not config.is_sliding(int(m.group(1))):
            return f"layer {m.group(1)} is {FULL} and full layers have no v_proj (K = V)"
    return "not a DiffusionGemma text tensor for this config"


def _plan(stored: dict[str, _Stored], config: ModelConfig) -> dict[str, str]:
    """Canonical name -> the HF name to read, after checking names, shapes and dtypes against `config`."""
    _reject_nvfp4(stored)
    expected = expected_shapes(config)
    expected[LM_HEAD] = (config.vocab_size, config.hidden_size)
    known = {hf for canonical in expected for hf in hf_names(canonical)}
    for name, s in stored.items():
        if name not in known and not _is_vision(name):
            raise CheckpointError(f"unexpected tensor {name} in {s.file.name}: {_unexpected_reason(name, config)}")
    plan: dict[str, str] = {}
    for canonical, shape in expected.items():
        candidates = hf_names(canonical)
        hf = next((n for n in candidates if n in stored), None)
        if hf is None:
            if canonical == LM_HEAD:
                continue  # tied to the embedding
            alt = f" (or {candidates[1]})" if len(candidates) > 1 else ""
            raise CheckpointError(f"missing tensor {candidates[0]}{alt}, expected shape {list(shape)}")
        s = stored[hf]
        if s.shape != shape:
            raise CheckpointError(f"{hf} in {s.file.name}: shape mismatch, expected {list(shape)}, got {list(s.shape)}")
        if not s.dtype.startswith(("F", "BF")):
            raise CheckpointError(f"{hf} in {s.file.name}: expected a floating-point tensor, got {s.dtype}")
        plan[canonical] = hf
    return plan


# ------------------------------------------------------------------------------------------------------- loading

def _read(plan: dict[str, str], stored: dict[str, _Stored], dtype: torch.dtype,
          device: torch.device | str) -> dict[str, torch.Tensor]:
    """Read the planned tensors one at a time, converting each (floating only) as soon as it is read."""
    by_file: dict[pathlib.Path, list[tuple[str, str]]] = defaultdict(list)
    for canonical, hf in plan.items():
        by_file[stored[hf].file].append((canonical, hf))
    weights: dict[str, torch.Tensor] = {}
    for file, items in by_file.items():
        with safe_open(file, framework="pt") as f:
            for canonical, hf in items:
                try:
                    t = f.get_tensor(hf)
                except SafetensorError as e:
                    raise CheckpointError(f"{hf} in {file}: cannot read ({e})") from None
                # the CPU copy `t` is dropped right after the conversion: one extra tensor at most
                weights[canonical] = (t.to(device=device, dtype=dtype) if t.is_floating_point()
                                      else t.to(device=device)).contiguous()
    return weights


def load_weights(path: str | pathlib.Path, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Load a Hugging Face DiffusionGemma checkpoint directory into canonical names (see `expected_shapes`).

    `path` holds config.json and model.safetensors (or shards listed in model.safetensors.index.json).
    Floating tensors are converted to `dtype` and moved to `device` one at a time, so peak memory is the
    result plus one tensor. `lm_head.weight` is returned only when stored and different from the embedding.
    Raises CheckpointError naming the file or tensor: missing config.json / safetensors / shard, unreadable
    file, missing tensor (its HF name), shape mismatch, unexpected non-vision tensor, NVFP4 experts.
    """
    path = pathlib.Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path / 'config.json'}: not found (not a checkpoint directory)")
    stored = _scan(path)
    weights = _read(_plan(stored, config), stored, dtype, device)
    if LM_HEAD in weights and torch.equal(weights[LM_HEAD], weights["embed_tokens.weight"]):
        del weights[LM_HEAD]  # stored but identical: tied, as transformers does (spec §2.2)
    return weights


# -------------------------------------------------------------------------------------------------------- saving

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
        shapes.update({
            p + "self_attn.q_proj.linear.weight": (q, h), p + "self_attn.k_proj.linear.weight": (kv, h),
            p + "self_attn.v_proj.linear.weight": (kv, h), p + "self_attn.o_proj.linear.weight": (h, q),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.linear.weight": (inner, h), p + "mlp.up_proj.linear.weight": (inner, h),
            p + "mlp.down_proj.linear.weight": (h, inner),
        })
        for norm in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
            shapes[f"{p}{norm}_layernorm.weight"] = (h,)
    return shapes


def _check_for_save(config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    expected = expected_shapes(config)
    for name, t in weights.items():
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
        raise CheckpointError(f"missing tensor {missing[0]}" + (f" (and {len(missing) - 1} more)" if missing[1:] else ""))


def save_weights(path: str | pathlib.Path, config: ModelConfig, weights: dict[str, torch.Tensor],
                 dtype: torch.dtype = torch.float32) -> None:
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
