"""NVFP4: exact decode, ModelOpt rounding rules, the quantizer CLI, loading ModelOpt-layout checkpoints,
and logits parity of an NVFP4 model with transformers on the same weights dequantized (fp32)."""

from __future__ import annotations

import json

import pytest
import torch
from hf_reference import first_step_logits

from dgserve import DiffusionGemma
from dgserve.config import ModelConfig
from dgserve.model import nvfp4
from dgserve.model.checkpoint import CheckpointError, load_weights, save_weights
from dgserve.model.quantize import main as quantize_main
from dgserve.model.quantize import quantize_checkpoint


def _e4m3_f64(byte: int) -> float:
    """Independent E4M3FN decode from the bits (docs/kernels.md)."""
    s, e, m = byte >> 7, (byte >> 3) & 0xF, byte & 7
    mag = (m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -mag if s else mag


E2M1_F64 = [0, 0.5, 1, 1.5, 2, 3, 4, 6]


@pytest.mark.parametrize("scale_2", [1.0, 0.0123, 3.5e-5])
def test_exhaustive_decode_all_codes_and_finite_scales(scale_2):
    bytes_ = [b for b in range(256) if (b & 0x7F) != 0x7F]  # every finite E4M3 value
    codes = torch.arange(16, dtype=torch.uint8)
    packed = (codes[1::2] << 4) | codes[0::2]  # [8]: the 16 codes in order
    weight = packed.repeat(len(bytes_), 2)  # [rows, 16] -> 32 elements per row
    scale = torch.tensor(bytes_, dtype=torch.uint8).view(torch.float8_e4m3fn)[:, None].repeat(1, 2)
    got = nvfp4.dequantize(weight, scale, torch.tensor(scale_2))
    s2 = torch.tensor(scale_2, dtype=torch.float32).item()
    for r, b in enumerate(bytes_):
        bracket = torch.tensor(_e4m3_f64(b) * s2, dtype=torch.float64).float().item()  # fp32 bracket
        for c in range(16):
            v = E2M1_F64[c & 7] * (-1 if c & 8 else 1)
            want = torch.tensor(v * bracket, dtype=torch.float64).float().item()
            assert got[r, c].item() == want and got[r, c + 16].item() == want, (b, c)
    if scale_2 == 1.0:  # E2M1 × E4M3 is exact in bf16 (docs/kernels.md)
        assert torch.equal(got.to(torch.bfloat16).float(), got)


def test_e2m1_rounding_ties_to_even_code_and_saturates():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.2501, 5.01, 7.0, 1e9, -0.25, -0.75, -6.5, 0.0])
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, 6.0, 6.0, 6.0, -0.0, -1.0, -6.0, 0.0]
    assert nvfp4.e2m1_decode(nvfp4.cast_e2m1(x)).tolist() == want


def test_quantizer_scales_follow_modelopt():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 40, generator=g) * 0.05
    w[1, :16] = 0  # an all-zero block -> block scale 1.0
    w[2, 16:32] = 1e-9  # a tiny block -> clamped to the smallest E4M3 subnormal
    packed, scale, s2 = nvfp4.quantize(w)
    assert packed.shape == (6, 24) and packed.dtype == torch.uint8  # K = 40 padded to 48
    assert scale.shape == (6, 3) and scale.dtype == torch.float8_e4m3fn
    assert s2.item() == pytest.approx(w.abs().max().item() / (6 * 448), rel=1e-7)
    assert scale[1, 0].float().item() == 1.0
    assert scale[2, 1].float().item() == 2.0**-9
    assert scale.float().max().item() == 448.0  # the block holding amax lands on 448
    deq = nvfp4.dequantize(packed, scale, s2, 40)
    assert deq.shape == (6, 40) and torch.equal(deq[1, :16], torch.zeros(16))
    rel = (deq - w).norm() / w.norm()
    assert rel < 0.15, rel  # 4-bit weights: ~8-10 % relative L2 on Gaussian data


def test_quantize_all_zero_tensor():
    packed, scale, s2 = nvfp4.quantize(torch.zeros(3, 16))
    assert s2.item() == 0 and torch.equal(scale.float(), torch.ones(3, 1)) and not packed.any()
    assert not nvfp4.dequantize(packed, scale, s2).any()


@pytest.fixture(scope="module")
def quantized(tiny_checkpoint, tmp_path_factory):
    src = tiny_checkpoint("base")
    dst = tmp_path_factory.mktemp("nvfp4")
    assert quantize_main([str(src), str(dst), "--dtype", "float32"]) == 0
    return src, dst


def test_export_layout(quantized):
    src, dst = quantized
    qc = json.loads((dst / "hf_quant_config.json").read_text())["quantization"]
    assert qc["quant_algo"] == "NVFP4" and qc["group_size"] == 16
    assert json.loads((dst / "config.json").read_text())["quantization_config"]["quant_method"] == "modelopt"
    from safetensors import safe_open

    with safe_open(dst / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("model.decoder.layers.0.experts.3.down_proj.weight").shape == (64, 16)
        assert f.get_tensor("model.decoder.layers.0.experts.3.down_proj.weight_scale").dtype == torch.float8_e4m3fn
        assert f.get_tensor("model.decoder.layers.0.experts.3.gate_proj.weight").shape == (32, 32)
    assert not any(n.endswith(("gate_up_proj", "experts.down_proj")) for n in names)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_loader_equals_dequantized(quantized, dtype):
    """Our loader on our quantizer's output equals quantize→dequantize of the source weights exactly."""
    src, dst = quantized
    cfg = ModelConfig.from_pretrained(src)
    ref = load_weights(src, cfg)
    got = load_weights(dst, cfg, dtype=dtype)
    inter = cfg.moe_intermediate_size
    for i in range(cfg.num_hidden_layers):
        gu, dn = ref[f"layers.{i}.experts.gate_up_proj"], ref[f"layers.{i}.experts.down_proj"]
        for e in range(cfg.num_experts):
            want = [
                nvfp4.dequantize(*nvfp4.quantize(w), w.shape[1]).to(dtype)
                for w in (gu[e, :inter], gu[e, inter:], dn[e])
            ]
            assert torch.equal(got[f"layers.{i}.experts.gate_up_proj"][e], torch.cat(want[:2]))
            assert torch.equal(got[f"layers.{i}.experts.down_proj"][e], want[2])
    for name, t in ref.items():  # everything else is untouched
        if ".experts." not in name:
            assert torch.equal(got[name], t.to(dtype)), name


def test_nvfp4_logits_match_transformers_on_dequantized_weights(quantized, tmp_path, hf_model_loader):
    src, dst = quantized
    model = DiffusionGemma.from_pretrained(dst)  # fp32, experts dequantized at load
    cfg = model.config
    save_weights(tmp_path, cfg, load_weights(dst, cfg), dtype=torch.float32)  # the same weights, plain fp32
    hf = hf_model_loader(tmp_path, torch.float32, attn="sdpa")
    ours, ref = first_step_logits(model, hf)
    assert (ours - ref).abs().max().item() <= 1e-4


def test_sharded_export_loads(quantized, tmp_path):
    src, _ = quantized
    quantize_checkpoint(src, tmp_path, torch.float32, shard_bytes=200_000)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    cfg = ModelConfig.from_pretrained(src)
    assert torch.equal(
        load_weights(tmp_path, cfg)["layers.2.experts.down_proj"],
        load_weights(quantized[1], cfg)["layers.2.experts.down_proj"],
    )


def test_unsupported_quant_config_is_named(quantized, tmp_path):
    _, dst = quantized
    for f in dst.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    q = json.loads((tmp_path / "hf_quant_config.json").read_text())
    q["quantization"]["quant_algo"] = "FP8"
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(q))
    with pytest.raises(CheckpointError, match="quant_algo"):
        load_weights(tmp_path, ModelConfig.from_pretrained(tmp_path))
