"""Which quantized format a checkpoint directory declares, decided in one place (docs/kernels.md, "NVFP4
checkpoints" and "FP8 checkpoints").

Contract: ``detect_format(path)`` reads ``config.json``'s ``quantization_config`` and ``hf_quant_config.json`` (when
present) and returns ``NVFP4`` (NVIDIA ModelOpt), ``FP8`` (compressed-tensors FP8 "dynamic": per-channel E4M3
weights, dynamic per-token activations, nothing stored for activations) or None (no quantization metadata). Any
other method, algorithm or compressed-tensors scheme is a CheckpointError (a ValueError) naming the field and the
value. Which tensors are quantized is still decided per module by the tensors themselves (the loader).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

from dgserve.model.checkpoint_layout import CheckpointError

QUANT_FILE = "hf_quant_config.json"
NVFP4 = "nvfp4"
FP8 = "fp8"
SUPPORTED_QUANT_ALGOS = ("NVFP4", "W4A16_NVFP4", "MIXED_PRECISION")
NVFP4_GROUP = 16
CT_FORMATS = ("float-quantized", "naive-quantized")
_SUPPORTED = "dgserve loads ModelOpt NVFP4, compressed-tensors FP8 dynamic, or unquantized checkpoints"
_FP8_WEIGHTS = {"num_bits": 8, "type": "float", "strategy": "channel"}
_FP8_ACTIVATIONS = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}


def _sources(path: pathlib.Path) -> list[tuple[str, Any]]:
    sources = []
    if (path / QUANT_FILE).is_file():
        try:
            sources.append((QUANT_FILE + ":quantization", json.loads((path / QUANT_FILE).read_text())["quantization"]))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{path / QUANT_FILE}: cannot read the quantization section ({e!r})") from None
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return sources  # no or unreadable config.json: the loader reports it
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    if qc is not None:
        sources.append(("config.json:quantization_config", qc))
    return sources


def detect_format(path: str | pathlib.Path) -> str | None:
    """NVFP4, FP8 or None for the checkpoint at ``path``; CheckpointError naming what is not supported."""
    found = set()
    for where, q in _sources(pathlib.Path(path)):
        if not isinstance(q, dict):
            raise CheckpointError(f"{where}: expected an object")
        method = q.get("quant_method", "modelopt")
        if method == "modelopt":
            _check_modelopt(where, q)
            found.add(NVFP4)
        elif method == "compressed-tensors":
            _check_compressed_tensors(where, q)
            found.add(FP8)
        else:
            raise CheckpointError(f"{where}.quant_method {method!r} is not supported: {_SUPPORTED}")
    if len(found) > 1:
        raise CheckpointError(f"{path}: the quantization metadata declares both ModelOpt NVFP4 and compressed-tensors")
    return found.pop() if found else None


def _check_modelopt(where: str, q: dict) -> None:
    algo = q.get("quant_algo")
    if algo not in SUPPORTED_QUANT_ALGOS:
        raise CheckpointError(
            f"{where}.quant_algo: {algo!r} is not supported; expected one of {list(SUPPORTED_QUANT_ALGOS)} "
            f"({_SUPPORTED})"
        )
    if q.get("group_size", NVFP4_GROUP) != NVFP4_GROUP:
        raise CheckpointError(f"{where}.group_size: {q['group_size']} is not supported (NVFP4 uses 16)")


def _check_compressed_tensors(where: str, q: dict) -> None:
    """Only FP8 dynamic: per-channel symmetric E4M3 weights, dynamic per-token FP8 activations (or none)."""
    fmt = q.get("format")
    if fmt not in CT_FORMATS:
        raise CheckpointError(f"{where}.format {fmt!r} is not supported: compressed-tensors FP8 uses {CT_FORMATS}")
    for key in ("sparsity_config", "transform_config", "kv_cache_scheme"):
        value = q.get(key)
        if value and not (key == "sparsity_config" and value.get("format") in (None, "dense")):
            raise CheckpointError(f"{where}.{key} is not supported (compressed-tensors FP8 dynamic only), got {value}")
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise CheckpointError(f"{where}.config_groups: expected a non-empty object, got {groups!r}")
    for name, group in groups.items():
        at = f"{where}.config_groups.{name}"
        if not isinstance(group, dict):
            raise CheckpointError(f"{at}: expected an object")
        if group.get("format", fmt) not in CT_FORMATS:
            raise CheckpointError(f"{at}.format {group['format']!r} is not supported (compressed-tensors FP8 only)")
        _check_args(f"{at}.weights", group.get("weights"), _FP8_WEIGHTS)
        w = group["weights"]
        if w.get("symmetric", True) is not True or w.get("dynamic", False) is not False:
            raise CheckpointError(f"{at}.weights: only static symmetric FP8 weights are supported, got {w}")
        if group.get("input_activations") is not None:
            _check_args(f"{at}.input_activations", group["input_activations"], _FP8_ACTIVATIONS)
        if group.get("output_activations") is not None:
            raise CheckpointError(f"{at}.output_activations is not supported, got {group['output_activations']}")


def _check_args(at: str, args: Any, want: dict) -> None:
    if not isinstance(args, dict):
        raise CheckpointError(f"{at}: expected an object, got {args!r}")
    for key, value in want.items():
        if args.get(key) != value:
            raise CheckpointError(
                f"{at}.{key} {args.get(key)!r} is not supported: dgserve loads compressed-tensors FP8 dynamic "
                f"({', '.join(f'{k}={v}' for k, v in want.items())})"
            )
