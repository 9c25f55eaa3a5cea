"""Loading safetensors checkpoints in Hugging Face DiffusionGemma layout (docs/generation.md, "Checkpoint tensors").

Canonical names drop the HF prefix: `embed_tokens.weight`, `norm.weight`, `self_conditioning.*`,
`layers.{i}.*` (the decoder's copy of every shared weight plus its `layer_scalar`), `layers.{i}.encoder_layer_scalar`
(the encoder's own, untied buffer) and `lm_head.weight` only when it is stored and differs from the embedding
(the names and shapes: `dgserve.model.checkpoint_layout`; writing: `dgserve.model.checkpoint_save`, both importable
from here too). Shared weights may be stored under `model.decoder.` or `model.encoder.language_model.` (decoder
preferred); vision tensors are ignored. NVIDIA ModelOpt NVFP4 checkpoints (per-expert
`experts.{e}.{gate,up,down}_proj` with `weight` uint8, `weight_scale` E4M3 and `weight_scale_2`; docs/kernels.md,
"NVFP4 checkpoints") are either dequantized exactly into the fused expert layout at load, or, with
``nvfp4_packed=True`` (the default on CUDA), stacked per layer and repacked on the device into the W4A16 kernel
layout (`layers.{i}.experts.packed`, an ``nvfp4.PackedExperts``) that ``ops.nvfp4_moe_experts`` runs on: no
dequantized copy is ever made. Either way a layer's expert tensors are read with one open per shard, not one per
matrix. compressed-tensors FP8 dynamic checkpoints (per-channel E4M3 `weight` + `weight_scale`, experts stored per
expert; docs/kernels.md, "FP8 checkpoints") are dequantized exactly at load (`dgserve.model.checkpoint_fp8`). Which
format a checkpoint declares is decided once, by `dgserve.model.quant_format.detect_format`.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from dgserve.config import FULL, ModelConfig
from dgserve.model import checkpoint_fp8, nvfp4
from dgserve.model import fp8_w8a8 as w8a8
from dgserve.model.checkpoint_layout import DECODER as DECODER
from dgserve.model.checkpoint_layout import ENCODER as ENCODER
from dgserve.model.checkpoint_layout import INDEX_FILE as INDEX_FILE
from dgserve.model.checkpoint_layout import LM_HEAD as LM_HEAD
from dgserve.model.checkpoint_layout import SINGLE_FILE as SINGLE_FILE
from dgserve.model.checkpoint_layout import CheckpointError as CheckpointError
from dgserve.model.checkpoint_layout import _is_vision as _is_vision
from dgserve.model.checkpoint_layout import expected_shapes as expected_shapes
from dgserve.model.checkpoint_layout import hf_names as hf_names
from dgserve.model.checkpoint_save import save_weights as save_weights
from dgserve.model.quant_format import FP8, detect_format
from dgserve.model.quant_format import QUANT_FILE as QUANT_FILE
from dgserve.model.quant_format import SUPPORTED_QUANT_ALGOS as SUPPORTED_QUANT_ALGOS

_LAYER_NAME = re.compile(r"^layers\.(\d+)\.(.+)$")


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


def _split_nvfp4(
    stored: dict[str, _Stored],
    config: ModelConfig,
    parts: tuple[str, ...] = ("weight", "weight_scale", "weight_scale_2"),
    what: str = "NVFP4",
) -> dict[int, dict[tuple[int, str, str], str]]:
    """Remove per-expert quantized tensors from `stored`; return layer -> {(expert, proj, part): HF name}.

    A checkpoint may store the shared weights under either prefix; the decoder prefix wins per layer.
    Every layer that has any per-expert tensor must have all E experts × 3 projections × `parts` (NVFP4: weight,
    weight_scale, weight_scale_2, and input_scale is optional (W4A4 kernels only); FP8: weight, weight_scale)."""
    groups: dict[int, dict[str, dict[tuple[int, str, str], str]]] = defaultdict(lambda: defaultdict(dict))
    for name in list(stored):
        m = nvfp4.EXPERT_NAME.match(name)
        if m is None:
            continue
        prefix = DECODER if name.startswith(DECODER) else ENCODER if name.startswith(ENCODER) else None
        layer, expert = int(m["layer"]), int(m["expert"])
        if prefix is None or layer >= config.num_hidden_layers or expert >= config.num_experts:
            raise CheckpointError(
                f"unexpected tensor {name}: no such layer/expert in this config "
                f"({config.num_hidden_layers} layers, {config.num_experts} experts)"
            )
        groups[layer][prefix][(expert, m["proj"], m["part"])] = name
        del stored[name]
    out = {}
    for layer, by_prefix in groups.items():
        names = by_prefix.get(DECODER) or by_prefix[ENCODER]
        for e in range(config.num_experts):
            for proj in nvfp4.PROJECTIONS:
                for part in parts:
                    if (e, proj, part) not in names:
                        raise CheckpointError(
                            f"missing tensor {DECODER}layers.{layer}.experts.{e}.{proj}.{part} "
                            f"(layer {layer} stores {what} experts)"
                        )
        out[layer] = names
    return out


def _unexpected_reason(name: str, config: ModelConfig) -> str:
    for prefix in (DECODER, ENCODER):
        m = _LAYER_NAME.match(name[len(prefix) :]) if name.startswith(prefix) else None
        if m and int(m.group(1)) >= config.num_hidden_layers:
            return f"layer {m.group(1)} is beyond num_hidden_layers={config.num_hidden_layers}"
        if m and m.group(2) == "self_attn.v_proj.weight" and not config.is_sliding(int(m.group(1))):
            return f"layer {m.group(1)} is {FULL} and full layers have no v_proj (K = V)"
    return "not a DiffusionGemma text tensor for this config"


def _plan(
    stored: dict[str, _Stored],
    config: ModelConfig,
    quantized: frozenset[int] = frozenset(),
    fp8_linears: frozenset[str] = frozenset(),
) -> dict[str, str]:
    """Canonical name -> the HF name to read, after checking names, shapes and dtypes against `config`.
    Expert tensors of the layers in `quantized` come from per-expert NVFP4 / FP8 tensors instead; the HF names in
    `fp8_linears` are FP8 weights (with a per-channel scale), every other tensor must be bf16/fp16/fp32."""
    expected = expected_shapes(config)
    for i in quantized:
        for part in ("gate_up_proj", "down_proj"):
            del expected[f"layers.{i}.experts.{part}"]
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
        if s.dtype.startswith("F8") and hf not in fp8_linears:
            raise CheckpointError(
                f"{hf} in {s.file.name}: a {s.dtype} weight needs its per-channel {hf}_scale and config.json's "
                "compressed-tensors quantization_config"
            )
        if not s.dtype.startswith(("F", "BF")):
            raise CheckpointError(f"{hf} in {s.file.name}: expected a floating-point tensor, got {s.dtype}")
        plan[canonical] = hf
    return plan


# ------------------------------------------------------------------------------------------------------- loading


def _read(
    plan: dict[str, str],
    stored: dict[str, _Stored],
    dtype: torch.dtype,
    device: torch.device | str,
    fp8_scales: dict[str, tuple[str, pathlib.Path]] | None = None,
    fp8_w8a8: bool = False,
) -> dict[str, torch.Tensor]:
    """Read the planned tensors one at a time, converting each (floating only) as soon as it is read; an FP8 weight
    (a key of `fp8_scales`, valued by its scale's HF name and file) is dequantized on the CPU first, or with
    `fp8_w8a8` kept as codes where ``fp8_w8a8.keeps_codes`` says so."""
    fp8_scales = fp8_scales or {}
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
                if hf in fp8_scales:
                    keep = fp8_w8a8 and w8a8.keeps_codes(canonical, tuple(t.shape), device)
                    t = checkpoint_fp8.read_linear(hf, t, *fp8_scales[hf], dtype, device if keep else None)
                    if keep:
                        weights[canonical] = t
                        continue
                # the CPU copy `t` is dropped right after the conversion: one extra tensor at most
                weights[canonical] = (
                    t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device=device)
                ).contiguous()
    return weights


PACKED = "experts.packed"  # layers.{i}.experts.packed: nvfp4.PackedExperts (replaces gate_up_proj / down_proj)


def load_weights(
    path: str | os.PathLike[str],
    config: ModelConfig,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    nvfp4_packed: bool = False,
    fp8_w8a8: bool = False,
) -> dict[str, torch.Tensor]:
    """Load a Hugging Face DiffusionGemma checkpoint directory into canonical names (see `expected_shapes`).

    `path` holds config.json and model.safetensors (or shards listed in model.safetensors.index.json).
    Floating tensors are converted to `dtype` and moved to `device` one at a time, so peak memory is the
    result plus one tensor. `lm_head.weight` is returned only when stored and different from the embedding.
    NVFP4 experts are dequantized exactly (fp32 bracket, one rounding to `dtype`) into the fused layout, or with
    `nvfp4_packed` kept as NVFP4 in the W4A16 kernel layout under `layers.{i}.experts.packed`.
    compressed-tensors FP8 weights (dense Linears and per-expert) are dequantized exactly into `dtype`, or with
    `fp8_w8a8` kept as E4M3 codes + fp32 scales (`dgserve.model.fp8_w8a8`: projections as ``Fp8Linear``, experts
    under `layers.{i}.experts.fp8`).
    Raises CheckpointError naming the file or tensor: missing config.json / safetensors / shard, unreadable
    file, missing tensor (its HF name), shape mismatch, unexpected non-vision tensor, bad NVFP4 / FP8 tensors,
    an unsupported quantization_config.
    """
    path = pathlib.Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path / 'config.json'}: not found (not a checkpoint directory)")
    fmt = detect_format(path)  # CheckpointError for any method or scheme dgserve does not load
    stored = _scan(path)
    full = dict(stored)
    if fmt == FP8:
        fp8_scales = checkpoint_fp8.split_linears(stored)
        quantized = _split_nvfp4(stored, config, checkpoint_fp8.EXPERT_PARTS, "FP8")
    else:
        checkpoint_fp8.refuse_without_config(stored)
        fp8_scales, quantized = {}, _split_nvfp4(stored, config)
    plan = _plan(stored, config, frozenset(quantized), frozenset(fp8_scales))
    scales = {hf: (fp8_scales[hf], full[fp8_scales[hf]].file) for hf in plan.values() if hf in fp8_scales}
    weights = _read(plan, stored, dtype, device, scales, fp8_w8a8)
    for layer, names in sorted(quantized.items()):
        if fmt == FP8:
            keep = fp8_w8a8 and w8a8.aligned((config.hidden_size, config.moe_intermediate_size), device)
            weights.update(checkpoint_fp8.read_experts(layer, names, full, config, dtype, device, keep))
            continue
        gate, up, down = _read_nvfp4_stacked(layer, names, full, config)
        if nvfp4_packed:  # the raw tensors go to the device, the repack runs there (native on CUDA)
            on = [tuple(t.to(device) for t in proj) for proj in (gate, up, down)]
            # the packed experts ride in the weights dict under their own key; LayerWeights.from_state takes them out
            weights[f"layers.{layer}.{PACKED}"] = nvfp4.pack_experts(*on)  # type: ignore[assignment]
        else:
            weights.update(_dequantize_layer(layer, (gate, up, down), config, dtype, device))
    if LM_HEAD in weights and torch.equal(weights[LM_HEAD], weights["embed_tokens.weight"]):
        del weights[LM_HEAD]  # stored but identical: tied, as transformers does (docs/generation.md)
    return weights


def _nvfp4_tensor(f, name: str, s: _Stored, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
    if s.dtype != dtype or (s.shape != shape and not (shape == () and s.shape == (1,))):
        raise CheckpointError(f"{name} in {s.file.name}: expected {dtype} {list(shape)}, got {s.dtype} {list(s.shape)}")
    return f.get_tensor(name)


_PARTS = (("weight", "U8"), ("weight_scale", "F8_E4M3"), ("weight_scale_2", "F32"))


def _read_nvfp4_stacked(
    layer: int, names: dict[tuple[int, str, str], str], stored: dict[str, _Stored], config: ModelConfig
) -> tuple[tuple[torch.Tensor, ...], ...]:
    """Layer `layer`'s ModelOpt tensors stacked over experts, on the CPU, as ``nvfp4.pack_experts`` takes them:
    per projection (gate, up, down) a tuple (weight uint8 [E, N, Kp/2], weight_scale e4m3 [E, N, Kp/16],
    weight_scale_2 fp32 [E]). Each shard is opened once; shapes, dtypes and scales are checked (CheckpointError
    naming the tensor)."""
    E, H, I = config.num_experts, config.hidden_size, config.moe_intermediate_size
    dims = {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}
    shapes = {
        proj: ((n, nvfp4.padded(k) // 2), (n, nvfp4.padded(k) // nvfp4.GROUP), ()) for proj, (n, k) in dims.items()
    }
    # per (projection, part) one slot per expert, every slot filled from the shards below
    out: dict[tuple[str, str], list[Any]] = {
        (proj, part): [None] * E for proj in nvfp4.PROJECTIONS for part, _ in _PARTS
    }
    by_file: dict[pathlib.Path, list[tuple[int, str, int]]] = defaultdict(list)
    for e in range(E):
        for proj in nvfp4.PROJECTIONS:
            for j, (part, _) in enumerate(_PARTS):
                by_file[stored[names[(e, proj, part)]].file].append((e, proj, j))
    for file, items in by_file.items():
        with safe_open(file, framework="pt") as f:
            for e, proj, j in items:
                part, code = _PARTS[j]
                name = names[(e, proj, part)]
                out[(proj, part)][e] = _nvfp4_tensor(f, name, stored[name], shapes[proj][j], code).reshape(
                    shapes[proj][j]
                )
    result = []
    for proj in nvfp4.PROJECTIONS:
        w, sc, s2 = (torch.stack(out[(proj, part)]) for part, _ in _PARTS)
        try:
            nvfp4.check_scales(sc, f"{DECODER}layers.{layer}.experts.*.{proj}.weight_scale")
        except ValueError as err:
            bad = next(e for e in range(E) if _bad_scales(sc[e]))  # name the first bad expert's tensor
            raise CheckpointError(f"{names[(bad, proj, 'weight_scale')]}: {str(err).split(': ', 1)[-1]}") from None
        if not torch.isfinite(s2).all() or bool((s2 < 0).any()):
            bad = int((~torch.isfinite(s2) | (s2 < 0)).nonzero()[0])
            raise CheckpointError(
                f"{names[(bad, proj, 'weight_scale_2')]}: global scale must be finite and >= 0, got {s2[bad].item()}"
            )
        result.append((w, sc, s2))
    return tuple(result)


def _bad_scales(scale: torch.Tensor) -> bool:
    try:
        nvfp4.check_scales(scale, "")
    except ValueError:
        return True
    return False


def _dequantize_layer(
    layer: int,
    stacked: tuple[tuple[torch.Tensor, ...], ...],
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str,
) -> dict[str, torch.Tensor]:
    """Dequantize one layer's stacked NVFP4 experts into gate_up_proj [E, 2I, H] and down_proj [E, H, I] (`dtype`).

    gate_up[e, :I] = deq(gate_proj), gate_up[e, I:] = deq(up_proj) (each with its own weight_scale_2),
    down[e] = deq(down_proj); one expert projection in fp32 at a time."""
    E, H, I = config.num_experts, config.hidden_size, config.moe_intermediate_size
    gate_up = torch.empty(E, 2 * I, H, dtype=dtype, device=device)
    down = torch.empty(E, H, I, dtype=dtype, device=device)
    (gw, gs, g2), (uw, us, u2), (dw, ds, d2) = stacked
    for e in range(E):
        gate_up[e, :I] = nvfp4.dequantize(gw[e], gs[e], g2[e], H).to(device=device, dtype=dtype)
        gate_up[e, I:] = nvfp4.dequantize(uw[e], us[e], u2[e], H).to(device=device, dtype=dtype)
        down[e] = nvfp4.dequantize(dw[e], ds[e], d2[e], I).to(device=device, dtype=dtype)
    return {f"layers.{layer}.experts.gate_up_proj": gate_up, f"layers.{layer}.experts.down_proj": down}
