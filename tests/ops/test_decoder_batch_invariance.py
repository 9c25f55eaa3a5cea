"""The decoder's row-wise ops are batch-invariant on the CPU (docs/exactness.md, "Batch invariance"): several canvases
stacked as one [B·C, H] pass through rms_norm, the projections, the attention output, the feed-forward (dense MLP,
router, experts) and the LM head give every canvas the bits of its own one-canvas pass (``decode_row_hidden``,
``output_logits``). Attention is one ``decode_attention`` call (each canvas over its own slot), and RoPE's cos/sin
are made per distinct start position (their torch cos/sin are vectorised over the whole tensor). The encoder stacks
the same way: several rows' token chunks in one ``encode_stacked`` pass leave each slot as its own ``encode_row``
does."""

from __future__ import annotations

import pytest
import torch

from dgserve.model import SlotCache
from dgserve.model.default_model import SHIPPED
from dgserve.model.diffusion_gemma import DiffusionGemma
from dgserve.model.stacked import decode_stacked, encode_stacked
from dgserve.model.tiny import make_random_checkpoint, preset


@pytest.mark.parametrize("which", ["moe16", "shipped"])
def test_stacked_canvases_give_each_canvas_its_own_bits(C, tmp_path, which):
    """``decode_stacked`` (model/stacked.py) of 6 canvases, three (then all) with a self-conditioning signal and two
    pairs starting at the same position (one RoPE table per start, gathered), gives each the hidden states of its own
    ``decode_row_hidden`` bit for bit, and the LM head over the stack each its logits."""
    if which == "shipped":
        model = DiffusionGemma.from_pretrained(SHIPPED)
    else:  # 16 experts, top-3: expert groups of a few rows alone, more when stacked (a BLAS's row-count-dependent case)
        config = preset("tiny", num_experts=16, top_k_experts=3)
        model = DiffusionGemma.from_pretrained(make_random_checkpoint(tmp_path / "tiny", config, seed=3))
    Cn, V, H = model.config.canvas_length, model.config.vocab_size, model.config.hidden_size
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, V, (1, n), generator=g) for n in (3, 9, 30, 17, 9, 3)]
    canvases = torch.randint(0, V, (len(prompts), Cn), generator=g)
    mixed = [None, torch.randn(Cn, H, generator=g), None, torch.randn(Cn, H, generator=g)]
    mixed += [torch.randn(Cn, H, generator=g), None]
    everyone = [torch.randn(Cn, H, generator=g) for _ in prompts]  # the steady state: one add for the stack
    for signals in (mixed, everyone):
        with torch.inference_mode():
            alone = [
                model.decode_row_hidden(model.prefill(p).view(0), canvases[b], None, None, signals[b])
                for b, p in enumerate(prompts)
            ]
            cache = SlotCache.stack([model.prefill(p) for p in prompts])
            cache.reserve(max(cache.lengths) + Cn, Cn)
            stacked = decode_stacked(model, [cache.view(b) for b in range(len(prompts))], canvases, signals)
            for b in range(len(prompts)):
                assert torch.equal(stacked[b], alone[b]), b
            # the LM head (linear) and its softcap: C·V even and below torch's parallel grain, so torch's tanh runs
            # one loop whose vector body covers every canvas alike
            logits = model.output_logits(stacked.reshape(-1, stacked.shape[-1])).view(len(prompts), Cn, -1)
            for b in range(len(prompts)):
                assert torch.equal(logits[b], model.output_logits(alone[b])), b
    assert not torch.equal(alone[0], alone[1])  # the canvases differ, so equal bits are not a coincidence


@pytest.mark.parametrize("which", ["moe16", "shipped"])
def test_stacked_encoder_gives_each_row_its_own_cache(C, tmp_path, which):
    """``encode_stacked`` of 4 rows' chunks (lengths 1 to 40, after cached prefixes of 0 to 100 positions that wrap
    the sliding rings) leaves every slot's keys, values and length as 4 separate ``encode_row`` calls do."""
    if which == "shipped":
        model = DiffusionGemma.from_pretrained(SHIPPED)
    else:
        config = preset("tiny", num_experts=16, top_k_experts=3)
        model = DiffusionGemma.from_pretrained(make_random_checkpoint(tmp_path / "tiny", config, seed=3))
    cfg = model.config
    g = torch.Generator().manual_seed(5)
    chunks = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in (16, 5, 40, 1)]
    prefixes = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in (0, 30, 7, 100)]

    def cache_with_prefixes() -> SlotCache:
        c = SlotCache(cfg, 4, 256, 128, torch.float32, torch.device("cpu"), zero=True)
        for b, p in enumerate(prefixes):
            if len(p):
                model.encode_row(p, c.view(b))
        return c

    with torch.inference_mode():
        alone, stacked = cache_with_prefixes(), cache_with_prefixes()
        for b, ids in enumerate(chunks):
            model.encode_row(ids, alone.view(b))
        encode_stacked(model, [stacked.view(b) for b in range(4)], chunks)
    assert stacked.lengths == alone.lengths == [16, 35, 47, 101]
    for layer in range(cfg.num_hidden_layers):
        assert torch.equal(stacked.keys[layer], alone.keys[layer]), layer
        assert torch.equal(stacked.values[layer], alone.values[layer]), layer


def test_fused_projections_give_the_separate_projections_bits(C):
    """On the CPU the layers stack q/k/v and gate/up into one weight each (``LayerWeights.fuse_projections``): one
    GEMM instead of three and two, each output column its own fixed k sequence, so the decoder's hidden states (one
    canvas, and stacked) are bit for bit those of the separate GEMMs."""
    fused, separate = DiffusionGemma.from_pretrained(SHIPPED), DiffusionGemma.from_pretrained(SHIPPED)
    assert all(lw.qkv_proj is not None and lw.mlp_gate_up is not None for lw in fused.layers)
    assert all(lw.q_proj.data_ptr() == lw.qkv_proj.data_ptr() for lw in fused.layers)  # views, no second copy
    for lw in separate.layers:
        lw.qkv_proj = lw.mlp_gate_up = None
        lw.q_proj, lw.k_proj, lw.mlp_gate, lw.mlp_up = (
            t.clone() for t in (lw.q_proj, lw.k_proj, lw.mlp_gate, lw.mlp_up)
        )
        lw.v_proj = None if lw.v_proj is None else lw.v_proj.clone()
    Cn, V = fused.config.canvas_length, fused.config.vocab_size
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, V, (1, n), generator=g) for n in (5, 12)]
    canvases = torch.randint(0, V, (2, Cn), generator=g)
    with torch.inference_mode():
        got, want = [], []
        for model, out in ((fused, got), (separate, want)):
            cache = SlotCache.stack([model.prefill(p) for p in prompts])
            cache.reserve(max(cache.lengths) + Cn, Cn)
            out.append(decode_stacked(model, [cache.view(b) for b in range(2)], canvases, [None, None]))
            out.append(model.decode_row_hidden(model.prefill(prompts[0]).view(0), canvases[0], None, None, None))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
