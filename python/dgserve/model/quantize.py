"""Quantize a bf16/fp32 DiffusionGemma checkpoint's routed experts to ModelOpt NVFP4.

    python -m dgserve.model.quantize SRC DST [--dtype bfloat16] [--shard-size-gb 4]

Writes DST in the layout NVIDIA's ModelOpt exports (docs/kernels.md): every routed expert projection
becomes ``model.decoder.layers.{i}.experts.{e}.{gate,up,down}_proj.{weight, weight_scale, weight_scale_2,
input_scale}``; everything else (attention, dense MLP, router, norms, embeddings, self-conditioning, vision)
stays in ``--dtype``. Rounding rules are ModelOpt's (see ``dgserve.ops.nvfp4_format.quantize``, re-exported as
``dgserve.model.nvfp4.quantize``). There is no activation calibration: ``input_scale`` is written as 1.0 and only
matters to W4A4 kernels, which dgserve does not use.
``hf_quant_config.json`` and ``config.json``'s ``quantization_config`` describe the export; tokenizer and
generation files are copied. Tensors are read one at a time and written in shards, so memory stays near one
shard.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import sys

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dgserve.config import ModelConfig
from dgserve.model import nvfp4
from dgserve.model.checkpoint import DECODER, INDEX_FILE, QUANT_FILE, SINGLE_FILE, _plan, _scan, hf_names

EXCLUDE = [
    "lm_head",
    "*embed_tokens*",
    "*embed_vision*",
    "*mlp*",
    "*router*",
    "*self_attn*",
    "*self_conditioning*",
    "*vision_tower*",
    "*norm*",
    "*layer_scalar*",
]
PRODUCER = {"name": "dgserve.model.quantize", "version": "0.1.0"}
COPIED = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
    "special_tokens_map.json",
    "README.md",
)


class _ShardWriter:
    """Accumulates tensors and writes model-0000k.safetensors shards of about `limit` bytes."""

    def __init__(self, out: pathlib.Path, limit: int):
        self.out, self.limit = out, limit
        self.pending: dict[str, torch.Tensor] = {}
        self.size = 0
        self.files: list[str] = []
        self.weight_map: dict[str, str] = {}

    def add(self, name: str, t: torch.Tensor) -> None:
        self.pending[name] = t.contiguous()
        self.size += t.numel() * t.element_size()
        if self.size >= self.limit:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            file = f"model-{len(self.files) + 1:05d}.safetensors"
            save_file(self.pending, str(self.out / file), metadata={"format": "pt"})
            self.files.append(file)
            self.weight_map.update(dict.fromkeys(self.pending, file))
            self.pending, self.size = {}, 0

    def finish(self) -> None:
        self.flush()
        if len(self.files) == 1:
            (self.out / self.files[0]).rename(self.out / SINGLE_FILE)
            return
        index = {"metadata": {}, "weight_map": dict(sorted(self.weight_map.items()))}
        (self.out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _quantize_experts(writer: _ShardWriter, layer: int, gate_up: torch.Tensor, down: torch.Tensor) -> None:
    inter = gate_up.shape[1] // 2
    for e in range(gate_up.shape[0]):
        for proj, w in (("gate_proj", gate_up[e, :inter]), ("up_proj", gate_up[e, inter:]), ("down_proj", down[e])):
            packed, scale, scale_2 = nvfp4.quantize(w)
            p = f"{DECODER}layers.{layer}.experts.{e}.{proj}."
            writer.add(p + "weight", packed)
            writer.add(p + "weight_scale", scale)
            writer.add(p + "weight_scale_2", scale_2.reshape(()))
            writer.add(p + "input_scale", torch.ones((), dtype=torch.float32))


def quantize_checkpoint(
    src: str | pathlib.Path, dst: str | pathlib.Path, dtype: torch.dtype = torch.bfloat16, shard_bytes: int = 4 << 30
) -> pathlib.Path:
    """Write the NVFP4 export of `src` to `dst` (created); returns `dst`."""
    src, dst = pathlib.Path(src), pathlib.Path(dst)
    config = ModelConfig.from_pretrained(src)
    stored = _scan(src)
    plan = _plan(dict(stored), config)
    dst.mkdir(parents=True, exist_ok=True)
    writer = _ShardWriter(dst, shard_bytes)
    planned = set(plan.values())
    experts: dict[int, dict[str, torch.Tensor]] = {}  # layer -> gate_up_proj / down_proj until both are read
    for canonical, hf in plan.items():
        with safe_open(stored[hf].file, framework="pt") as f:
            t = f.get_tensor(hf)
        if ".experts." in canonical:
            layer = int(canonical.split(".")[1])
            experts.setdefault(layer, {})[canonical.rsplit(".", 1)[1]] = t
            if len(experts[layer]) == 2:
                parts = experts.pop(layer)
                _quantize_experts(writer, layer, parts["gate_up_proj"], parts["down_proj"])
            continue
        writer.add(hf_names(canonical)[0], t.to(dtype) if t.is_floating_point() else t)
    for name, s in stored.items():  # vision tensors and anything else we do not run: copied as they are
        if name not in planned:
            with safe_open(s.file, framework="pt") as f:
                writer.add(name, f.get_tensor(name))
    writer.finish()
    _write_metadata(src, dst, dtype)
    return dst


def _write_metadata(src: pathlib.Path, dst: pathlib.Path, dtype: torch.dtype) -> None:
    quant = {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": nvfp4.GROUP, "exclude_modules": EXCLUDE}
    (dst / QUANT_FILE).write_text(json.dumps({"producer": PRODUCER, "quantization": quant}, indent=2) + "\n")
    cfg = json.loads((src / "config.json").read_text())
    cfg["dtype"] = str(dtype).removeprefix("torch.")
    cfg["quantization_config"] = {
        "quant_method": "modelopt",
        "quant_algo": "NVFP4",
        "group_size": nvfp4.GROUP,
        "ignore": EXCLUDE,
        "producer": PRODUCER,
    }
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for name in COPIED:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dgserve.model.quantize", description=__doc__.split("\n\n")[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        default="bfloat16",
        help="dtype of the tensors that stay unquantized",
    )
    ap.add_argument("--shard-size-gb", type=float, default=4.0)
    args = ap.parse_args(argv)
    out = quantize_checkpoint(args.src, args.dst, getattr(torch, args.dtype), int(args.shard_size_gb * (1 << 30)))
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
