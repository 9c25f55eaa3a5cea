"""compressed-tensors FP8 dynamic checkpoints (docs/kernels.md, "FP8 checkpoints"): the format detection, exact
dequantization at load, parity with transformers on the dequantized weights (fp32 logits within 1e-4, seeded
tokens equal; docs/exactness.md), and corrupt scales named."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from fp8_checkpoint import dequantized_copy, quantization_config, write_fp8_checkpoint
from hf_reference import case_params, clear_reference, first_step_logits
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dgserve import DiffusionGemma, Engine
from dgserve.config import ConfigError, ModelConfig
from dgserve.model import fp8
from dgserve.model.checkpoint import CheckpointError, load_weights
from dgserve.model.quant_format import FP8, NVFP4, detect_format
from dgserve.model.runtime import check_plan, plan_runtime

GATE = "model.decoder.layers.1.experts.2.gate_proj.weight"
QPROJ = "model.decoder.layers.0.self_attn.q_proj.weight"


def _e4m3_f64(byte: int) -> float:
    """Independent E4M3FN decode from the bits (docs/kernels.md)."""
    s, e, m = byte >> 7, (byte >> 3) & 0xF, byte & 7
    mag = (m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -mag if s else mag


@pytest.mark.parametrize("scale", [1.0, 0.0123, 3.5e-7])
def test_dequantize_is_exact_on_every_code(scale):
    codes = [b for b in range(256) if (b & 0x7F) != 0x7F]  # every finite E4M3 value
    w = torch.tensor(codes, dtype=torch.uint8).view(torch.float8_e4m3fn).reshape(1, -1)
    s = torch.tensor([[scale]], dtype=torch.float32)
    got = fp8.dequantize(w, s)
    want = [torch.tensor(_e4m3_f64(b) * s.item(), dtype=torch.float64).float().item() for b in codes]
    assert got.tolist()[0] == want


def test_quantizer_follows_compressed_tensors():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(5, 40, generator=g) * 0.05
    w[3] = 0  # an all-zero channel: scale clamps to eps, codes all zero
    q, s = fp8.quantize(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (5, 1) and s.dtype == torch.float32
    assert s[0].item() == pytest.approx(w[0].abs().max().item() / 448, rel=1e-7)
    assert s[3].item() == torch.finfo(torch.float32).eps and not q[3].float().any()
    assert q.float().abs().amax(dim=1)[[0, 1, 2, 4]].eq(448).all()
    rel = (fp8.dequantize(q, s) - w).norm() / w.norm()
    assert rel < 0.05, rel  # 8-bit float weights: ~2-3 % relative L2 on Gaussian data


@pytest.fixture(scope="module")
def fp8_ckpt(tiny_checkpoint, tmp_path_factory):
    src = tiny_checkpoint("base")
    return src, write_fp8_checkpoint(src, tmp_path_factory.mktemp("fp8"))


def _copy(src, dst, edit=None, config_edit=None):
    for f in src.iterdir():
        shutil.copyfile(f, dst / f.name)
    if edit is not None:
        tensors = load_file(dst / "model.safetensors")
        edit(tensors)
        save_file(tensors, str(dst / "model.safetensors"))
    if config_edit is not None:
        cfg = json.loads((dst / "config.json").read_text())
        config_edit(cfg["quantization_config"])
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_detect_format(fp8_ckpt, tiny_checkpoint):
    assert detect_format(fp8_ckpt[1]) == FP8 and detect_format(tiny_checkpoint("base")) is None
    assert quantization_config("naive-quantized")["format"] == "naive-quantized"


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda q: q.update(quant_method="awq"), "quant_method 'awq' is not supported: dgserve loads ModelOpt NVFP4"),
        (lambda q: q.update(format="pack-quantized"), "format 'pack-quantized'"),
        (lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="tensor"), "weights.strategy 'tensor'"),
        (lambda q: q["config_groups"]["group_0"]["weights"].update(type="int"), "weights.type 'int'"),
        (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=4), "weights.num_bits 4"),
        (lambda q: q["config_groups"]["group_0"]["weights"].update(symmetric=False), "symmetric"),
        (lambda q: q["config_groups"]["group_0"]["input_activations"].update(dynamic=False), "dynamic False"),
        (lambda q: q.update(kv_cache_scheme={"num_bits": 8}), "kv_cache_scheme"),
    ],
)
def test_unsupported_schemes_are_named(fp8_ckpt, tmp_path, edit, match):
    path = _copy(fp8_ckpt[1], tmp_path, config_edit=edit)
    with pytest.raises(CheckpointError, match=match):
        load_weights(path, ModelConfig.from_pretrained(path))
    plan = plan_runtime(path)
    with pytest.raises(ConfigError, match=match):  # before any weight is loaded
        check_plan(plan)


def test_plan_names_the_format(fp8_ckpt):
    assert plan_runtime(fp8_ckpt[1]).expert_format == "fp8 (dequantized to float32)"


def _dequantized_by_hand(path):
    with safe_open(path / "model.safetensors", "pt") as f:
        return {
            n[: -len("_scale")]: fp8.dequantize(f.get_tensor(n[: -len("_scale")]), f.get_tensor(n))
            for n in f.keys()
            if n.endswith("weight_scale")
        }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loader_equals_dequantized(fp8_ckpt, dtype):
    src, dst = fp8_ckpt
    cfg = ModelConfig.from_pretrained(src)
    ref, got, deq = load_weights(src, cfg), load_weights(dst, cfg, dtype=dtype), _dequantized_by_hand(dst)
    inter = cfg.moe_intermediate_size
    for i in range(cfg.num_hidden_layers):
        p = f"model.decoder.layers.{i}.experts"
        for e in range(cfg.num_experts):
            gu = got[f"layers.{i}.experts.gate_up_proj"][e]
            assert torch.equal(gu[:inter], deq[f"{p}.{e}.gate_proj.weight"].to(dtype))
            assert torch.equal(gu[inter:], deq[f"{p}.{e}.up_proj.weight"].to(dtype))
            assert torch.equal(got[f"layers.{i}.experts.down_proj"][e], deq[f"{p}.{e}.down_proj.weight"].to(dtype))
    assert torch.equal(got["layers.0.self_attn.q_proj.weight"], deq[QPROJ].to(dtype))
    assert torch.equal(
        got["self_conditioning.up_proj.weight"], deq["model.decoder.self_conditioning.up_proj.weight"].to(dtype)
    )
    for name in ("embed_tokens.weight", "layers.1.router.proj.weight", "layers.0.input_layernorm.weight"):
        assert torch.equal(got[name], ref[name].to(dtype)), name  # not quantized: untouched


def test_bf16_scales_load(fp8_ckpt, tmp_path):
    src, dst = fp8_ckpt
    bf = write_fp8_checkpoint(src, tmp_path, scale_dtype=torch.bfloat16)
    cfg = ModelConfig.from_pretrained(bf)
    got = load_weights(bf, cfg)
    assert torch.equal(got["layers.0.self_attn.q_proj.weight"], _dequantized_by_hand(bf)[QPROJ])


def test_fp8_logits_match_transformers_on_dequantized_weights(fp8_ckpt, tmp_path, hf_model_loader):
    model = DiffusionGemma.from_pretrained(fp8_ckpt[1])  # fp32, dequantized at load
    hf = hf_model_loader(dequantized_copy(fp8_ckpt[1], tmp_path), torch.float32, attn="sdpa")
    ours, ref = first_step_logits(model, hf)
    assert (ours - ref).abs().max().item() <= 1e-4


def test_fp8_seeded_tokens_match_transformers(fp8_ckpt, tmp_path, hf_model_loader):
    hf = hf_model_loader(dequantized_copy(fp8_ckpt[1], tmp_path), torch.float32, attn="sdpa")
    engine = Engine.from_pretrained(fp8_ckpt[1])
    case = (16, 6, 0.4, 0.8, 0.1, 1, 0.005)
    g = torch.Generator().manual_seed(11)
    for seed in (0, 7):
        prompt = torch.randint(3, engine.model.config.vocab_size, (9,), generator=g).tolist()
        ref, _ = clear_reference(hf, prompt, seed, case, eos_ids=None, pad_id=None)
        res = engine.generate(prompt, case_params(case, seed, ignore_eos=True))
        assert res.token_ids == ref[: len(res.token_ids)] and len(res.token_ids) == case[0]


def _set(name, value):
    def edit(t):
        t[name] = value(t[name])

    return edit


@pytest.mark.parametrize("weight", [QPROJ, GATE])
@pytest.mark.parametrize(
    "value, match",
    [
        (lambda s: s[:-1], "expected a per-channel scale of shape"),
        (lambda s: s.reshape(1, -1), "expected a per-channel scale of shape"),
        (lambda s: s.index_fill(0, torch.tensor([1]), float("nan")), "finite and > 0, got nan at channel 1"),
        (lambda s: s.index_fill(0, torch.tensor([2]), float("inf")), "finite and > 0, got inf"),
        (lambda s: s.index_fill(0, torch.tensor([0]), 0.0), "finite and > 0, got 0.0"),
        (lambda s: -s, "finite and > 0, got -"),
        (lambda s: s.to(torch.int32), "expected a float32, bfloat16 or float16 scale"),
    ],
)
def test_corrupt_scale_names_the_tensor(fp8_ckpt, tmp_path, weight, value, match):
    path = _copy(fp8_ckpt[1], tmp_path, edit=_set(weight + "_scale", value))
    with pytest.raises(CheckpointError, match=match) as err:
        load_weights(path, ModelConfig.from_pretrained(path))
    assert str(err.value).startswith(weight + "_scale"), str(err.value)


@pytest.mark.parametrize("weight", [QPROJ, GATE])
def test_missing_scale_is_named(fp8_ckpt, tmp_path, weight):
    path = _copy(fp8_ckpt[1], tmp_path, edit=lambda t: t.pop(weight + "_scale"))
    with pytest.raises(CheckpointError, match=weight.replace(".", r"\.")):
        load_weights(path, ModelConfig.from_pretrained(path))


def test_nan_code_names_the_weight(fp8_ckpt, tmp_path):
    def edit(t):
        w = t[QPROJ].view(torch.uint8).clone()
        w[0, 0] = 0x7F
        t[QPROJ] = w.view(torch.float8_e4m3fn)

    path = _copy(fp8_ckpt[1], tmp_path, edit=edit)
    with pytest.raises(CheckpointError, match=f"^{QPROJ}: holds NaN codes"):
        load_weights(path, ModelConfig.from_pretrained(path))


def test_fp8_tensors_without_the_config_are_refused(fp8_ckpt, tmp_path):
    path = _copy(fp8_ckpt[1], tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    del cfg["quantization_config"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="compressed-tensors quantization_config"):
        load_weights(path, ModelConfig.from_pretrained(path))


def test_modelopt_config_is_still_nvfp4(tmp_path, tiny_checkpoint):
    path = _copy(tiny_checkpoint("base"), tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}
    (path / "config.json").write_text(json.dumps(cfg))
    assert detect_format(path) == NVFP4
