"""NVFP4 served as NVFP4: a ModelOpt checkpoint loads straight into the packed W4A16 layout
(no dequantized copy), feed_forward runs ops.nvfp4_moe_experts, and on the CPU the packed path (the native decode
+ torch GEMMs, bit-identical to its reference) gives the dequantized path's logits.

Why the two paths differ at all: the packed path is the kernels' contract (docs/kernels.md, "Grouped expert GEMMs
(Hopper design)"): exact E2M1·E4M3
weights with the fp32 global scale applied after the sums, and the GEMM1 activation rounded once to bf16 before
GEMM2; the dequantized path rounds the weights to the model dtype and keeps the activation in it. For fp32 that
is one bf16 rounding of the activation (2^-9 relative) on the expert branch only."""

from __future__ import annotations

import pytest
import torch

from dgserve import DiffusionGemma, Engine, SamplingParams, ops
from dgserve.config import ModelConfig
from dgserve.model import checkpoint as ckpt
from dgserve.model import nvfp4
from dgserve.model.quantize import main as quantize_main
from dgserve.model.quantize import quantize_checkpoint
from dgserve.model.tiny import make_random_checkpoint


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    src = make_random_checkpoint(tmp_path_factory.mktemp("nvfp4-src"), "tiny", seed=5)
    dst = tmp_path_factory.mktemp("nvfp4-packed")
    assert quantize_main([str(src), str(dst), "--dtype", "float32"]) == 0
    return dst


def _inputs(cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, cfg.vocab_size, (2, 9), generator=g)
    canvas = torch.randint(0, cfg.vocab_size, (2, cfg.canvas_length), generator=g)
    return prompt, canvas


def _logits(model, prompt, canvas):
    return model.denoise(model.prefill(prompt), canvas)


def _rel_l2(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_loader_keeps_the_experts_packed(quantized):
    cfg = ModelConfig.from_pretrained(quantized)
    w = ckpt.load_weights(quantized, cfg, nvfp4_packed=True)
    for i in range(cfg.num_hidden_layers):
        assert f"layers.{i}.experts.gate_up_proj" not in w and f"layers.{i}.experts.down_proj" not in w
        p = w[f"layers.{i}.{ckpt.PACKED}"]
        assert isinstance(p, nvfp4.PackedExperts) and p.w13.dtype == torch.int32 and p.s13.dtype == torch.uint8
        assert (p.hidden, p.inter, p.gs.shape) == (cfg.hidden_size, cfg.moe_intermediate_size, (cfg.num_experts, 3))
        # the packed layout decodes to exactly the weights the dequantized loader builds (global scales apart)
        deq = ckpt.load_weights(quantized, cfg)
        gate_up = nvfp4.decode_repacked(p.w13, p.s13)[:, torch.argsort(nvfp4.interleave_rows(2 * p.inter))]
        gs = p.gs[:, :2].repeat_interleave(p.inter, dim=1)[..., None]
        # (E2M1·s)·gs here vs E2M1·(s·gs) in the loader: one fp32 rounding apart
        torch.testing.assert_close(
            gate_up[..., : cfg.hidden_size] * gs, deq[f"layers.{i}.experts.gate_up_proj"], rtol=2.5e-7, atol=0
        )
        break


def test_feed_forward_runs_the_nvfp4_op(quantized, monkeypatch):
    model = DiffusionGemma.from_pretrained(quantized, nvfp4_packed=True)
    calls = []
    real = ops.nvfp4_moe_experts
    monkeypatch.setattr(ops, "nvfp4_moe_experts", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(ops, "moe_experts", lambda *a: pytest.fail("the bf16 expert op ran on a packed model"))
    prompt, canvas = _inputs(model.config)
    _logits(model, prompt, canvas)
    assert len(calls) > 0


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-4), (torch.bfloat16, 2e-2)])
def test_packed_path_gives_the_dequantized_paths_logits(quantized, dtype, tol):
    packed = DiffusionGemma.from_pretrained(quantized, dtype=dtype, nvfp4_packed=True)
    deq = DiffusionGemma.from_pretrained(quantized, dtype=dtype, nvfp4_packed=False)
    prompt, canvas = _inputs(packed.config)
    a, b = _logits(packed, prompt, canvas), _logits(deq, prompt, canvas)
    # fp32: one bf16 rounding of the expert activation (module docstring); bf16: plus the dequantized path's
    # bf16 weights and activations
    assert _rel_l2(a, b) <= tol, _rel_l2(a, b)
    assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() >= 0.9


def test_packed_native_cpu_path_matches_its_reference(quantized):
    """The packed experts' native CPU path against the references, through the whole model. Not bit for bit: the
    dense MLP's native GELU-tanh gating is one fixed scalar formula within a few fp32 ulp of torch's GELU, the
    reference's (docs/kernels.md, "gelu_tanh_mul: the gating"); the op itself is bit-identical to its reference
    (tests/ops)."""
    if not ops.has_native("nvfp4_moe_experts"):
        pytest.skip("dgserve._C is not built")
    model = DiffusionGemma.from_pretrained(quantized, nvfp4_packed=True)
    prompt, canvas = _inputs(model.config, seed=3)
    native = _logits(model, prompt, canvas)
    with ops.native_disabled():
        ref = _logits(model, prompt, canvas)
    assert _rel_l2(native, ref) <= 1e-5, _rel_l2(native, ref)
    assert torch.equal(native.argmax(-1), ref.argmax(-1))


def test_engine_generates_on_packed_experts(quantized):
    model = DiffusionGemma.from_pretrained(quantized, nvfp4_packed=True)
    res = Engine(model, None).generate(
        [5, 6, 7], SamplingParams(max_new_tokens=20, max_denoising_steps=4, seed=1, ignore_eos=True)
    )
    assert len(res.token_ids) == 20


def test_each_shard_is_opened_once_per_layer(quantized, tmp_path, monkeypatch):
    quantize_checkpoint(_src_of(quantized), tmp_path, torch.float32, shard_bytes=200_000)
    cfg = ModelConfig.from_pretrained(tmp_path)
    shards = len(list(tmp_path.glob("*.safetensors")))
    opened = []
    real = ckpt.safe_open
    monkeypatch.setattr(ckpt, "safe_open", lambda f, **k: opened.append(f) or real(f, **k))
    stored = ckpt._scan(tmp_path)
    full = dict(stored)
    layers = ckpt._split_nvfp4(stored, cfg)
    opened.clear()
    for layer, names in layers.items():
        ckpt._read_nvfp4_stacked(layer, names, full, cfg)
    assert shards > 1 and len(opened) <= shards * len(layers)


def _src_of(quantized):
    # the fixture's source is not kept; re-make the same random checkpoint next to it
    return make_random_checkpoint(quantized.parent / "nvfp4-src-again", "tiny", seed=5)
