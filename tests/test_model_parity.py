"""Logits parity of DiffusionGemma.prefill/denoise against transformers 5.23.0 (docs/exactness.md).

fp32: within 1e-4 absolute (the project's bar; measured ~1e-6). bf16: compared against transformers'
eager attention path, which rounds exactly where we do; we require ≤ 2 bf16 ulps of the logit magnitude
(measured: bit-identical), because GEMM blocking may legally differ between builds.
"""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicCache

from dgserve import DiffusionGemma, ops

FP32_TOL = 1e-4


def _hf_logits(hf, prompt, canvas, sc, P, C):
    """transformers: prefill, step without and with self-conditioning, then a second block."""
    with torch.no_grad():
        cache = DynamicCache(config=hf.config.get_text_config(decoder=True))
        hf.model.encoder(input_ids=prompt, past_key_values=cache, position_ids=torch.arange(P)[None])
        pos = torch.arange(P, P + C)[None]
        step1 = hf(decoder_input_ids=canvas, past_key_values=cache, decoder_position_ids=pos).logits
        stepn = hf(
            decoder_input_ids=canvas, past_key_values=cache, self_conditioning_logits=sc, decoder_position_ids=pos
        ).logits
        hf.model.encoder(input_ids=canvas, past_key_values=cache, position_ids=pos)
        block2 = hf(
            decoder_input_ids=canvas, past_key_values=cache, decoder_position_ids=torch.arange(P + C, P + 2 * C)[None]
        ).logits
    return step1, stepn, block2, [layer.keys.shape[-2] for layer in cache.layers]


def _ours(model, prompt, canvas, sc):
    cache = model.prefill(prompt)
    step1 = model.denoise(cache, canvas)
    stepn = model.denoise(cache, canvas, self_cond_logits=sc)
    model.prefill(canvas, cache)
    block2 = model.denoise(cache, canvas)
    return step1, stepn, block2, cache.layer_lengths(0)


@pytest.mark.parametrize("variant", ["base", "full", "wide"])
@pytest.mark.parametrize("prompt_len", [1, 5, 13])
def test_fp32_logits_match_transformers(tiny_checkpoint, hf_model_loader, variant, prompt_len):
    path = tiny_checkpoint(variant)
    hf = hf_model_loader(path, torch.float32, attn="sdpa")  # transformers' default attention
    model = DiffusionGemma.from_pretrained(path)
    C, V = model.config.canvas_length, model.config.vocab_size
    g = torch.Generator().manual_seed(prompt_len)
    prompt = torch.randint(0, V, (2, prompt_len), generator=g)
    canvas = torch.randint(0, V, (2, C), generator=g)
    sc = torch.randn(2, C, V, generator=g)
    ref, ours = _hf_logits(hf, prompt, canvas, sc, prompt_len, C), _ours(model, prompt, canvas, sc)
    assert ours[3] == ref[3], "cache lengths per layer (sliding layers keep W-1)"
    for name, a, b in zip(("step1", "self-conditioned", "block2"), ours[:3], ref[:3], strict=True):
        assert a.dtype == torch.float32 and a.shape == b.shape
        err = (a - b).abs().max().item()
        assert err <= FP32_TOL, f"{variant} {name}: max |Δlogit| = {err:.3g}"


@pytest.mark.parametrize("variant", ["base", "wide"])
def test_bf16_logits_match_transformers_eager(tiny_checkpoint, hf_model_loader, variant):
    path = tiny_checkpoint(variant)
    hf = hf_model_loader(path, torch.bfloat16, attn="eager")
    model = DiffusionGemma.from_pretrained(path, dtype=torch.bfloat16)
    C, V = model.config.canvas_length, model.config.vocab_size
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, V, (1, 11), generator=g)
    canvas = torch.randint(0, V, (1, C), generator=g)
    sc = torch.randn(1, C, V, generator=g).to(torch.bfloat16)
    ref, ours = _hf_logits(hf, prompt, canvas, sc, 11, C), _ours(model, prompt, canvas, sc)
    for name, a, b in zip(("step1", "self-conditioned", "block2"), ours[:3], ref[:3], strict=True):
        ulp = 2 * torch.finfo(torch.bfloat16).eps * b.abs().clamp(min=1.0)
        assert ((a - b).abs() <= ulp).all(), f"{variant} {name}: max |Δ| = {(a - b).abs().max().item():.3g}"


def test_self_cond_probs_equal_logits_path(tiny_checkpoint):
    model = DiffusionGemma.from_pretrained(tiny_checkpoint("base"))
    C, V = model.config.canvas_length, model.config.vocab_size
    cache = model.prefill(torch.arange(3, 12)[None])
    canvas = torch.randint(0, V, (1, C), generator=torch.Generator().manual_seed(1))
    sc = torch.randn(1, C, V, generator=torch.Generator().manual_seed(2))
    a = model.denoise(cache, canvas, self_cond_logits=sc)
    # the model's own softmax (ops.softmax_rows: torch's within 1e-6) gives the logits path's bits; torch's, its values
    b = model.denoise(cache, canvas, self_cond_probs=ops.softmax_rows(sc))
    assert torch.equal(a, b)
    c = model.denoise(cache, canvas, self_cond_probs=torch.softmax(sc, -1, dtype=torch.float32))
    torch.testing.assert_close(c, a, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="at most one"):
        model.denoise(cache, canvas, self_cond_logits=sc, self_cond_probs=sc)


def test_chunked_prefill_equals_one_shot(tiny_checkpoint):
    """Encoding a prompt in chunks (as the scheduler does) gives the same cache and logits."""
    model = DiffusionGemma.from_pretrained(tiny_checkpoint("base"))
    C, V = model.config.canvas_length, model.config.vocab_size
    prompt = torch.randint(0, V, (1, 23), generator=torch.Generator().manual_seed(3))
    canvas = torch.randint(0, V, (1, C), generator=torch.Generator().manual_seed(4))
    whole = model.denoise(model.prefill(prompt), canvas)
    cache = model.prefill(prompt[:, :5])
    model.prefill(prompt[:, 5:14], cache)
    model.prefill(prompt[:, 14:], cache)
    assert cache.lengths == [23]
    assert (model.denoise(cache, canvas) - whole).abs().max().item() <= 1e-5


@pytest.mark.parametrize("which", ["wide", "base", "shipped"])
def test_batch_rows_are_independent(tiny_checkpoint, which):
    """A row's logits do not depend on the other rows of the batch (bitwise): the CPU decoder's stacked pass
    (model/stacked.py) at mixed prompt lengths, some rows with self-conditioning logits, on the tiny MoE variants and
    the shipped model, against each row's one-canvas pass."""
    from dgserve.model import SlotCache
    from dgserve.model.default_model import SHIPPED

    model = DiffusionGemma.from_pretrained(SHIPPED if which == "shipped" else tiny_checkpoint(which))
    C, V = model.config.canvas_length, model.config.vocab_size
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, V, (1, n), generator=g) for n in (3, 9, 30, 1, 17)]
    canvases = torch.randint(0, V, (len(prompts), C), generator=g)
    sc = [None, 4 * torch.randn(C, V, generator=g), None, None, 4 * torch.randn(C, V, generator=g)]
    alone = [model.denoise(model.prefill(p), canvases[i : i + 1], [sc[i]]) for i, p in enumerate(prompts)]
    batch_cache = SlotCache.stack([model.prefill(p) for p in prompts])
    together = model.denoise(batch_cache, canvases, sc)
    for i in range(len(prompts)):
        assert torch.equal(together[i], alone[i][0]), i
