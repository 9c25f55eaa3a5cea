"""The decoder's row-wise ops are batch-invariant on the CPU (docs/exactness.md, "Batch invariance"): several canvases
stacked as one [B·C, H] pass through rms_norm, the projections, the attention output, the feed-forward (dense MLP,
router, experts) and the LM head give every canvas the bits of its own one-canvas pass (``decode_row_hidden``,
``output_logits``). Attention stays per canvas, and RoPE's cos/sin are made per canvas (their torch cos/sin are
vectorised over the whole tensor)."""

from __future__ import annotations

import pytest
import torch

from dgserve.model import SlotCache
from dgserve.model.default_model import SHIPPED
from dgserve.model.diffusion_gemma import DiffusionGemma
from dgserve.model.stacked import decode_stacked
from dgserve.model.tiny import make_random_checkpoint, preset


@pytest.mark.parametrize("which", ["moe16", "shipped"])
def test_stacked_canvases_give_each_canvas_its_own_bits(C, tmp_path, which):
    """``decode_stacked`` (model/stacked.py) of 4 canvases, two with a self-conditioning signal, gives each the
    hidden states of its own ``decode_row_hidden`` bit for bit, and the LM head over the stack each its logits."""
    if which == "shipped":
        model = DiffusionGemma.from_pretrained(SHIPPED)
    else:  # 16 experts, top-3: expert groups of a few rows alone, more when stacked (a BLAS's row-count-dependent case)
        config = preset("tiny", num_experts=16, top_k_experts=3)
        model = DiffusionGemma.from_pretrained(make_random_checkpoint(tmp_path / "tiny", config, seed=3))
    Cn, V, H = model.config.canvas_length, model.config.vocab_size, model.config.hidden_size
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, V, (1, n), generator=g) for n in (3, 9, 30, 17)]
    canvases = torch.randint(0, V, (len(prompts), Cn), generator=g)
    signals = [None, torch.randn(Cn, H, generator=g), None, torch.randn(Cn, H, generator=g)]
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
        # the LM head (linear) and its softcap: C·V even and below torch's parallel grain, so torch's tanh runs one
        # loop whose vector body covers every canvas alike
        logits = model.output_logits(stacked.reshape(-1, stacked.shape[-1])).view(len(prompts), Cn, -1)
        for b in range(len(prompts)):
            assert torch.equal(logits[b], model.output_logits(alone[b])), b
    assert not torch.equal(alone[0], alone[1])  # the canvases differ, so equal bits are not a coincidence
