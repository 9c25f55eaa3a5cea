"""Loading compressed-tensors FP8 dynamic checkpoints (docs/kernels.md, "FP8 checkpoints"): every FP8 weight is
dequantized exactly at load (``dgserve.model.fp8``) into the model's dtype, so the model runs as if unquantized.

A Linear is FP8 exactly when its ``.weight`` is stored as F8_E4M3 and a ``.weight_scale`` sibling exists (the
checkpoint's ``ignore`` list is not needed: the tensors say it). Routed experts are stored per expert,
``…layers.{i}.experts.{e}.{gate_proj,up_proj,down_proj}.{weight,weight_scale}``, and land in the fused layout:
``gate_up_proj[e, :I] = deq(gate_proj)``, ``gate_up_proj[e, I:] = deq(up_proj)``, ``down_proj[e] = deq(down_proj)``.
Used by ``dgserve.model.checkpoint``; errors are CheckpointError naming the tensor.
"""

from __future__ import annotations

import pathlib
from collections import defaultdict
from typing import Any

import torch
from safetensors import safe_open

from dgserve.config import ModelConfig
from dgserve.model import fp8, fp8_w8a8, nvfp4
from dgserve.model.checkpoint_layout import CheckpointError

EXPERT_PARTS = ("weight", "weight_scale")
FP8_EXPERTS = "experts.fp8"  # layers.{i}.experts.fp8: fp8_w8a8.Fp8Experts (replaces gate_up_proj / down_proj)
_SCALE = ".weight_scale"


def split_linears(stored: dict[str, Any]) -> dict[str, str]:
    """Remove the per-channel scales of FP8 Linears (experts excepted) from ``stored``; return weight -> scale."""
    out = {}
    for name in list(stored):
        if not name.endswith(_SCALE) or nvfp4.EXPERT_NAME.match(name):
            continue
        weight = name[: -len("_scale")]
        if weight in stored and stored[weight].dtype == fp8.WEIGHT_DTYPE:
            out[weight] = name
            del stored[name]
    return out


def refuse_without_config(stored: dict[str, Any]) -> None:
    """CheckpointError naming the first FP8 weight of a checkpoint that does not declare compressed-tensors."""
    for name, s in stored.items():
        if name.endswith(".weight") and s.dtype == fp8.WEIGHT_DTYPE:
            raise CheckpointError(
                f"{name} in {s.file.name}: an {s.dtype} weight needs config.json's compressed-tensors "
                "quantization_config (FP8 dynamic) and its per-channel weight_scale"
            )


def _checked(weight: torch.Tensor, scale: torch.Tensor, names: tuple[str, str], shape: tuple[int, int]) -> None:
    wname, sname = names
    if weight.dtype != torch.float8_e4m3fn or tuple(weight.shape) != shape:
        raise CheckpointError(f"{wname}: expected float8_e4m3fn {list(shape)}, got {weight.dtype} {list(weight.shape)}")
    if scale.dtype not in fp8.SCALE_DTYPES.values():
        raise CheckpointError(f"{sname}: expected a float32, bfloat16 or float16 scale, got {scale.dtype}")
    try:
        fp8.check_scale(scale, shape[0], sname)
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def dequantize_checked(
    weight: torch.Tensor, scale: torch.Tensor, names: tuple[str, str], shape: tuple[int, int]
) -> torch.Tensor:
    """fp32 [N, K] from a checked FP8 weight and its scale; CheckpointError naming the bad tensor (a NaN code
    names the weight)."""
    _checked(weight, scale, names, shape)
    w = fp8.dequantize(weight, scale)
    if not bool(torch.isfinite(w).all()):
        raise CheckpointError(f"{names[0]}: holds NaN codes (E4M3 0x7f / 0xff)")
    return w


def read_linear(
    hf: str,
    weight: torch.Tensor,
    scale_name: str,
    file: pathlib.Path,
    dtype: torch.dtype,
    codes_on: torch.device | str | None = None,
) -> torch.Tensor:
    """The dequantized `dtype` weight of the FP8 Linear ``hf`` (its scale read from ``file``), on the CPU; with
    ``codes_on`` (W8A8) the checked codes and fp32 scales on that device as an ``fp8_w8a8.Fp8Linear``."""
    with safe_open(file, framework="pt") as f:
        scale = f.get_tensor(scale_name)
    w = dequantize_checked(weight, scale, (hf, scale_name), tuple(weight.shape))  # type: ignore[arg-type]
    if codes_on is not None:
        return fp8_w8a8.Fp8Linear(weight.to(codes_on), scale.float().to(codes_on), dtype)
    return w.to(dtype)


def read_experts(
    layer: int,
    names: dict[tuple[int, str, str], str],
    stored: dict[str, Any],
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    keep_codes: bool = False,
) -> dict[str, Any]:
    """Layer ``layer``'s FP8 experts dequantized into gate_up_proj [E, 2I, H] and down_proj [E, H, I] (`dtype`, on
    `device`), one expert projection in fp32 at a time; each shard is opened once. ``keep_codes`` (W8A8): the checked
    codes and fp32 scales in the same fused layout, as ``layers.{i}.experts.fp8`` (an ``fp8_w8a8.Fp8Experts``)."""
    E, H, I = config.num_experts, config.hidden_size, config.moe_intermediate_size
    shapes = {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}
    rows = {"gate_proj": slice(0, I), "up_proj": slice(I, 2 * I), "down_proj": slice(0, H)}
    kind = torch.float8_e4m3fn if keep_codes else dtype
    out = {
        "gate_up_proj": torch.empty(E, 2 * I, H, dtype=kind, device=device),
        "down_proj": torch.empty(E, H, I, dtype=kind, device=device),
    }
    scales = {"gate_up_proj": torch.empty(E, 2 * I, device=device), "down_proj": torch.empty(E, H, device=device)}
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = defaultdict(dict)
    by_file: dict[pathlib.Path, list[tuple[int, str, str]]] = defaultdict(list)
    for (e, proj, part), name in names.items():
        if part in EXPERT_PARTS:
            by_file[stored[name].file].append((e, proj, part))
    for file, items in by_file.items():
        with safe_open(file, framework="pt") as f:
            for e, proj, part in items:
                parts[(e, proj)][part] = f.get_tensor(names[(e, proj, part)])
                if len(parts[(e, proj)]) < len(EXPERT_PARTS):
                    continue  # the other half of the pair is in a later item or shard
                got = parts.pop((e, proj))
                ids = (names[(e, proj, "weight")], names[(e, proj, "weight_scale")])
                w = dequantize_checked(got["weight"], got["weight_scale"], ids, shapes[proj])
                fused = "down_proj" if proj == "down_proj" else "gate_up_proj"
                if keep_codes:
                    out[fused][e, rows[proj]] = got["weight"].to(device)
                    scales[fused][e, rows[proj]] = got["weight_scale"].float().reshape(-1).to(device)
                else:
                    out[fused][e, rows[proj]] = w.to(device=device, dtype=dtype)
    if keep_codes:
        ex = fp8_w8a8.Fp8Experts(out["gate_up_proj"], scales["gate_up_proj"], out["down_proj"], scales["down_proj"])
        return {f"layers.{layer}.{FP8_EXPERTS}": ex}
    return {f"layers.{layer}.experts.{k}": v for k, v in out.items()}
