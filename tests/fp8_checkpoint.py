"""Write a checkpoint in the compressed-tensors FP8 dynamic layout (docs/kernels.md, "FP8 checkpoints") from a plain
one: every text Linear (attention, dense MLP, self-conditioning, and the routed experts split per expert) becomes
``weight`` float8_e4m3fn + ``weight_scale`` [N, 1]; the router, embeddings, norms, lm_head and vision stay as they
are (the export's ``ignore`` list); config.json gets the ``quantization_config`` RedHatAI's FP8-dynamic exports
carry. ``dequantized_copy`` writes the same weights dequantized, in plain safetensors, for transformers."""

from __future__ import annotations

import json
import pathlib
import re
import shutil

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dgserve.config import ModelConfig
from dgserve.model import fp8
from dgserve.model.checkpoint import load_weights, save_weights

LINEAR = re.compile(
    r"\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj|self_conditioning\.(gate|up|down)_proj)\.weight$"
)
EXPERTS = re.compile(r"^(?P<prefix>.*\.layers\.\d+\.experts)\.(?P<part>gate_up_proj|down_proj)$")
IGNORE = ["lm_head", "re:.*router.*", "re:.*vision.*", "re:.*embed_vision.*"]


def quantization_config(fmt: str = "float-quantized") -> dict:
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8,
                    "type": "float",
                    "symmetric": True,
                    "strategy": "channel",
                    "dynamic": False,
                    "group_size": None,
                    "observer": "minmax",
                },
                "input_activations": {
                    "num_bits": 8,
                    "type": "float",
                    "symmetric": True,
                    "strategy": "token",
                    "dynamic": True,
                    "observer": None,
                },
                "output_activations": None,
            }
        },
        "ignore": IGNORE,
        "kv_cache_scheme": None,
        "sparsity_config": {},
    }


def _put(out: dict, name: str, w: torch.Tensor, scale_dtype: torch.dtype) -> None:
    q, s = fp8.quantize(w, scale_dtype)
    out[name] = q
    out[name + "_scale"] = s


def write_fp8_checkpoint(
    src: pathlib.Path, dst: pathlib.Path, scale_dtype: torch.dtype = torch.float32
) -> pathlib.Path:
    dst.mkdir(parents=True, exist_ok=True)
    out: dict[str, torch.Tensor] = {}
    with safe_open(src / "model.safetensors", framework="pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            m = EXPERTS.match(name)
            if m and m["part"] == "gate_up_proj":
                inter = t.shape[1] // 2
                for e in range(t.shape[0]):
                    _put(out, f"{m['prefix']}.{e}.gate_proj.weight", t[e, :inter], scale_dtype)
                    _put(out, f"{m['prefix']}.{e}.up_proj.weight", t[e, inter:], scale_dtype)
            elif m:
                for e in range(t.shape[0]):
                    _put(out, f"{m['prefix']}.{e}.down_proj.weight", t[e], scale_dtype)
            elif LINEAR.search(name) and "vision" not in name:
                _put(out, name, t, scale_dtype)
            else:
                out[name] = t
    save_file({k: v.contiguous() for k, v in out.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = quantization_config()
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    for extra in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (src / extra).is_file():
            shutil.copyfile(src / extra, dst / extra)
    return dst


def dequantized_copy(fp8_dir: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    """The FP8 checkpoint's weights as dgserve dequantizes them, saved plain fp32 (for transformers)."""
    cfg = ModelConfig.from_pretrained(fp8_dir)
    save_weights(dst, cfg, load_weights(fp8_dir, cfg), dtype=torch.float32)
    return dst
