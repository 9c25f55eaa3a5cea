"""Images: preprocessing bit for bit against transformers' Gemma 4 image processor, and fp32 logits with images
within the text tolerance against transformers 5.23.0 (docs/exactness.md, docs/images.md)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import BOI, EOI, IMAGE
from transformers.cache_utils import DynamicCache

from dgserve import DiffusionGemma
from dgserve.media.images import pad_batch, preprocess, to_rgb

FP32_TOL = 1e-4
SIZES = [(100, 80), (37, 300), (48, 48), (500, 20), (64, 200)]


def _images(sizes, seed=0, mode="RGB"):
    from PIL import Image

    rng = np.random.default_rng(seed)
    channels = 4 if mode == "RGBA" else 3
    return [Image.fromarray(rng.integers(0, 256, (h, w, channels), dtype=np.uint8), mode) for h, w in sizes]


@pytest.mark.parametrize("soft", [70, 280])
def test_preprocess_is_transformers_bit_for_bit(soft):
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    imgs = _images(SIZES) + _images([(60, 90)], seed=1, mode="RGBA") + [_images([(33, 70)])[0].convert("L")]
    ref = Gemma4ImageProcessorPil(max_soft_tokens=soft)(imgs, return_tensors="pt")
    ours = [preprocess(to_rgb(im), 16, 3, soft) for im in imgs]
    pv, pos = pad_batch(ours)
    P = pv.shape[1]
    assert [o.tokens for o in ours] == ref["num_soft_tokens_per_image"].tolist()
    assert torch.equal(ref["pixel_values"][:, :P], pv) and bool((ref["pixel_values"][:, P:] == 0).all())
    assert torch.equal(ref["image_position_ids"][:, :P], pos) and bool((ref["image_position_ids"][:, P:] == -1).all())


def _prompt(parts, g, V=290):
    """parts: ints (that many random text ids) or ImageInputs (boi, placeholders, eoi)."""
    ids: list[int] = []
    for p in parts:
        if isinstance(p, int):
            ids += torch.randint(3, V, (p,), generator=g).tolist()
        else:
            ids += [BOI] + [IMAGE] * p.tokens + [EOI]
    return torch.tensor(ids)[None]


def _hf(hf, ids, pv, pos, canvas, C, blocks=True):
    P = ids.shape[1]
    enc = hf.model.encoder
    with torch.no_grad():
        cache = DynamicCache(config=hf.config.get_text_config(decoder=True))
        position_ids = torch.arange(P)[None]
        masks = enc.create_masks_for_generate(
            config=hf.config,
            inputs_embeds=torch.empty(1, P, 0),
            attention_mask=None,
            past_key_values=cache,
            position_ids=position_ids,
            mm_token_type_ids=(ids == IMAGE).long() if blocks else None,
        )
        enc(
            input_ids=ids,
            pixel_values=pv,
            image_position_ids=pos,
            attention_mask=masks,
            past_key_values=cache,
            position_ids=position_ids,
        )
        return hf(
            decoder_input_ids=canvas, past_key_values=cache, decoder_position_ids=torch.arange(P, P + C)[None]
        ).logits


@pytest.mark.parametrize("variant", ["vis", "vis_wide"])
def test_fp32_logits_with_images_match_transformers(tiny_checkpoint, hf_model_loader, variant):
    path = tiny_checkpoint(variant)
    hf = hf_model_loader(path, torch.float32, attn="sdpa")
    model = DiffusionGemma.from_pretrained(path)
    assert model.vision is not None and model.images_unsupported() is None
    C = model.config.canvas_length
    g = torch.Generator().manual_seed(11)
    # several images of different sizes in one prompt, placeholder runs longer than the window (W = 8 in "vis")
    imgs = [preprocess(to_rgb(im), 16, 3, 70) for im in _images([(96, 96), (48, 150), (150, 100)])]
    ids = _prompt([3, imgs[0], 2, imgs[1], imgs[2], 4], g)
    pv, pos = pad_batch(imgs)
    canvas = torch.randint(0, 290, (1, C), generator=g)
    ref = _hf(hf, ids, pv, pos, canvas, C)
    ours = model.denoise(model.prefill(ids, pixel_values=pv, image_position_ids=pos), canvas)
    err = (ours - ref).abs().max().item()
    assert err <= FP32_TOL, f"{variant}: max |Δlogit| = {err:.3g}"
    # the encoder's bidirectional image blocks matter at this tolerance (a causal encoder would fail above)
    causal = _hf(hf, ids, pv, pos, canvas, C, blocks=False)
    assert (causal - ref).abs().max().item() > 100 * FP32_TOL
    # the images matter: the same placeholders with other pixels give other logits
    other = model.denoise(model.prefill(ids, pixel_values=pv.flip(0) * 0 + 0.5, image_position_ids=pos), canvas)
    assert (other - ours).abs().max().item() > 1e-3


def _image_prompt(sizes, layout, seed):
    from dgserve.engine.prompt import ImagePrompt

    imgs = [preprocess(to_rgb(im), 16, 3, 70) for im in _images(sizes, seed=seed)]
    it = iter(imgs)
    parts = [p if isinstance(p, int) else next(it) for p in layout]
    return ImagePrompt(tuple(_prompt(parts, torch.Generator().manual_seed(seed))[0].tolist()), tuple(imgs))


def test_seeded_generation_with_images_matches_transformers(tiny_checkpoint, hf_model_loader):
    from hf_reference import Margins, hf_generate

    from dgserve import Engine, SamplingParams

    path = tiny_checkpoint("vis")
    hf = hf_model_loader(path, torch.float32, attn="sdpa")
    # chunks of 80 tokens: the first (64 placeholders from 4 on) lies in the first, a full cacheable chunk; the second
    # (from 82 on) in the second
    from dgserve.engine.scheduler import SchedulerConfig

    engine = Engine.from_pretrained(path, scheduler_config=SchedulerConfig(prefill_chunk=80, max_prefill_tokens=80))
    prompt = _image_prompt([(96, 96), (96, 144)], [3, "img", 12, "img", 2], seed=5)
    pv, pos = pad_batch(list(prompt.images))
    ids = torch.tensor([prompt.ids])
    margins = Margins()
    case = dict(max_new_tokens=32, steps=8, t_min=0.4, t_max=0.8, entropy_bound=0.1)
    ref, _ = hf_generate(
        hf,
        prompt.ids,
        7,
        margins=margins,
        pixel_values=pv,
        image_position_ids=pos,
        mm_token_type_ids=(ids == IMAGE).long(),
        **case,
    )
    assert margins.worst() > 1, f"near-tie {margins}"
    params = SamplingParams(max_new_tokens=32, max_denoising_steps=8, t_min=0.4, t_max=0.8, entropy_bound=0.1, seed=7)
    res = engine.generate(prompt, params)
    assert res.token_ids == ref[: len(res.token_ids)]
    # the prefix cache: the same images again reuse their chunks and give the same tokens; other pixels behind
    # the same placeholder ids never share KV
    again = engine.generate(prompt, params)
    assert again.token_ids == res.token_ids and again.cached_tokens > 0
    other = _image_prompt([(96, 96), (96, 144)], [3, "img", 12, "img", 2], seed=6)
    other = type(other)(prompt.ids, other.images)  # same ids, other pixels
    assert other.images[0].tokens == prompt.images[0].tokens
    fresh = engine.generate(other, params)
    assert fresh.cached_tokens == 0


def test_chunks_never_split_an_image():
    """scheduler.chunk_end: a chunk stops before an image it would split, one starting with an image ends after it,
    and the chunks realign to multiples of the chunk size (the prefix cache's blocks)."""
    from types import SimpleNamespace

    from dgserve.engine.scheduler import chunk_end

    img = SimpleNamespace(tokens=10)
    seq = SimpleNamespace(prefilled=0, prompt_len=50, images=((12, img), (25, img)))
    ends = []
    while seq.prefilled < seq.prompt_len:
        seq.prefilled = chunk_end(seq, 16)
        ends.append(seq.prefilled)
    assert ends == [12, 22, 25, 35, 48, 50]
