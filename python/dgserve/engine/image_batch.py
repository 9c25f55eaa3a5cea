"""Images in the engine: the placeholder runs of a prompt, the images of a request, and the one vision-tower call
per iteration over every image the planned prompt chunks hold (docs/images.md, "Where images are encoded").

Public contract:
    cost = default_image_token_cost(model)          # a soft token in the prefill budget, in prompt tokens
    runs = image_runs(model, prompt, chunk)         # the ids each image stands for; ValueError naming messages
    spans = image_spans(ids, prompt, model)         # (start, image) per image of the prompt ids
    feats = encode_planned(model, plan.prefill)     # per planned chunk: its soft tokens [m, H], or None

``encode_planned`` is work shared by the requests of one iteration: when it raises, every chunk gets None and
each request's prefill encodes its own images (``ModelRunner.prefill``), so a bad image fails only its request.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from dgserve.engine.prompt import ChatPrompt, ImagePrompt, Prompt
from dgserve.engine.request import Request
from dgserve.media.images import ImageInput
from dgserve.model import DiffusionGemma

log = logging.getLogger("dgserve.engine.image_batch")
# what a soft token counts for in the prefill token budget, by device: on the CPU the tower costs up to ~2 text
# prompt tokens per soft token at 280 soft tokens (its attention over 2,520 patches; docs/images.md, "Bench"), on
# accelerators less than one by its FLOPs
IMAGE_TOKEN_COST = {"cpu": 2.0}


def default_image_token_cost(model: DiffusionGemma) -> float:
    """The scheduler's ``image_token_cost`` for a model's device: ``IMAGE_TOKEN_COST``, else 1."""
    return IMAGE_TOKEN_COST.get(model.device.type, 1.0)


def image_runs(model: DiffusionGemma, prompt: ChatPrompt | ImagePrompt, chunk: int) -> list[list[int]]:
    """The ids each image of a chat stands for in its prompt (BOI, one placeholder per soft token, EOI), as
    transformers' processor expands them; ValueError when the model cannot take images, an image has more soft
    tokens than a prompt chunk (an image is encoded in one pass: docs/images.md) or a patch grid wider or taller
    than the tower's position table."""
    if not prompt.images:
        return []
    why = model.images_unsupported()
    if why is not None:
        raise ValueError(f"messages: this model cannot take images ({why})")
    assert model.vision is not None
    vc = model.vision.config
    for k, im in enumerate(prompt.images):
        if im.tokens > chunk:
            raise ValueError(f"messages: image {k} takes {im.tokens} tokens, more than a prompt chunk ({chunk})")
        if im.positions.numel() and int(im.positions.max()) >= vc.position_embedding_size:
            raise ValueError(
                f"messages: image {k} has a patch grid of {int(im.positions.max()) + 1}, more than the vision "
                f"tower's position table ({vc.position_embedding_size})"
            )
    return [[vc.boi_token_id] + [vc.image_token_id] * im.tokens + [vc.eoi_token_id] for im in prompt.images]


def image_spans(ids: list[int], prompt: Prompt, model: DiffusionGemma) -> tuple[tuple[int, ImageInput], ...]:
    """(start, image) of each image of a chat prompt: the runs of placeholders in ids, in order (transformers'
    rule: a run of ``image_token_id`` is one image)."""
    if not isinstance(prompt, (ChatPrompt, ImagePrompt)) or not prompt.images:
        return ()
    assert model.vision is not None, "images for a model without a vision tower (image_runs refuses them)"
    image_id = model.vision.config.image_token_id
    starts = [i for i, t in enumerate(ids) if t == image_id and (i == 0 or ids[i - 1] != image_id)]
    if len(starts) != len(prompt.images):
        raise ValueError(f"messages: {len(starts)} image places in the prompt for {len(prompt.images)} images")
    return tuple(zip(starts, prompt.images, strict=True))


def placeholder_id(model: DiffusionGemma, prompt: Prompt, ids: list[int]) -> int:
    """The image placeholder id a prompt's ids may hold (-1: none); ValueError when a prompt without images holds
    it (images come in chat image parts)."""
    vision = model.vision
    if vision is None:
        return -1
    image_id = vision.config.image_token_id
    if not (isinstance(prompt, (ChatPrompt, ImagePrompt)) and prompt.images) and image_id in ids:
        raise ValueError(f"prompt: token id {image_id} is the image placeholder; images come in chat image parts")
    return image_id


def chunk_images(req: Request, start: int, end: int) -> list[ImageInput]:
    """The images whose placeholders start in prompt positions start .. end − 1, whole (``scheduler.chunk_end``
    never splits one)."""
    inside = [im for s, im in req.images if start <= s < end]
    assert all(s + im.tokens <= end for s, im in req.images if start <= s < end), "an image split across chunks"
    return inside


def encode_planned(model: DiffusionGemma, chunks: Sequence[tuple[Request, int, int]]) -> list[torch.Tensor | None]:
    """One ``encode_images`` call over the images of every planned chunk (request, start, end) still in flight,
    in tiles of ``model.image_tile``; per chunk, its soft tokens [placeholders, H] (None: no images there). When
    the shared call raises, every entry is None: each request's prefill then encodes its own images, alone."""
    per_chunk = [[] if req.finished else chunk_images(req, s, e) for req, s, e in chunks]
    images = [im for ims in per_chunk for im in ims]
    if not images:
        return [None] * len(chunks)
    try:
        feats = model.encode_images([(im.patches, im.positions) for im in images])
    except Exception as e:
        log.warning(
            "the batched vision tower call over %d images failed (%s); encoding per request",
            len(images),
            type(e).__name__,
        )
        log.debug("the batched vision tower call failed", exc_info=e)
        return [None] * len(chunks)
    it = iter(feats)
    return [torch.cat([next(it) for _ in ims]) if ims else None for ims in per_chunk]
