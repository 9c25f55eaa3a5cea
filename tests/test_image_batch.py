"""Images batched and bounded (docs/images.md, "Where images are encoded", "Memory"): a padded tile of images
through the vision tower equals each image alone within fp32 tolerance (and transformers' padded pass); the
engine encodes the images of every chunk planned in an iteration in one tower call and a request's tokens are
the same alone or batched; a bad image fails only its own request; the tower's tile workspace comes out of the KV
cache budget; a patch grid beyond the position table is a ValueError before the tower."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from tiny_models import BOI, EOI, IMAGE

from dgserve import DiffusionGemma, Engine, SamplingParams
from dgserve.engine.cache_config import CacheConfig
from dgserve.engine.image_batch import encode_planned
from dgserve.engine.model_runner import ModelRunner
from dgserve.engine.prompt import ImagePrompt, Submission
from dgserve.engine.request import Request, RequestFailedError
from dgserve.engine.scheduler import Scheduler, SchedulerConfig
from dgserve.media.images import ImageError, pad_batch, preprocess, to_rgb
from dgserve.model.cache import SlotCache
from dgserve.model.vision import VisionConfig, tile_workspace_bytes

FP32_TOL = 1e-4
# different sizes: 64, 56, 60 and 60 soft tokens (576, 504, 540, 540 patches), so a tile pads all but the largest
SIZES = [(96, 96), (48, 150), (150, 100), (200, 60)]


def _images(sizes, seed=0):
    from PIL import Image

    rng = np.random.default_rng(seed)
    arrays = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes]
    return [preprocess(to_rgb(Image.fromarray(a)), 16, 3, 70) for a in arrays]


@pytest.fixture(scope="module")
def vis(tiny_checkpoint):
    return tiny_checkpoint("vis")


@pytest.mark.parametrize("kernel", ["default", "math"])
def test_a_padded_tile_equals_each_image_alone_and_transformers(vis, hf_model_loader, kernel):
    """The padded pass's SDPA, with the kernel torch picks and with the math kernel it may fall back to."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = DiffusionGemma.from_pretrained(vis)
    assert model.vision is not None and model.image_tile == 1  # CPU: one image per pass
    imgs = _images(SIZES)
    pairs = [(im.patches, im.positions) for im in imgs]
    alone = [model.vision.encode(*p) for p in pairs]
    if kernel == "math":
        with sdpa_kernel([SDPBackend.MATH]):
            tile = model.vision.encode_tile(pairs)
    else:
        tile = model.vision.encode_tile(pairs)
    assert [t.shape for t in tile] == [a.shape for a in alone] == [(im.tokens, 64) for im in imgs]
    for a, t in zip(alone, tile, strict=True):
        assert (a - t).abs().max().item() <= FP32_TOL
    # transformers pads the same way ((-1, -1) positions) and strips the padding after the pooling
    hf = hf_model_loader(vis, torch.float32)
    pv, pos = pad_batch(imgs)
    with torch.no_grad():
        ref = hf.model.encoder.get_image_features(pv, pos).pooler_output
    assert (torch.cat(tile) - ref).abs().max().item() <= FP32_TOL
    # tiles of 3: one padded pass of three images and one of the last alone, in order
    model.image_tile = 3
    tiled = model.encode_images(pairs)
    assert all((a - t).abs().max().item() <= FP32_TOL for a, t in zip(alone, tiled, strict=True))


def _prompt(image_sizes, seed, text=(3, 5, 2)) -> ImagePrompt:
    """Text, image, text, image, ... with random text ids of the tiny vocabulary."""
    imgs = _images(image_sizes, seed)
    g = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    for k, n in enumerate(text):
        ids += torch.randint(3, 290, (n,), generator=g).tolist()
        if k < len(imgs):
            ids += [BOI] + [IMAGE] * imgs[k].tokens + [EOI]
    return ImagePrompt(tuple(ids), tuple(imgs))


PARAMS = SamplingParams(max_new_tokens=32, max_denoising_steps=6, seed=3)


def _engine(path) -> Engine:
    # chunks of 160 tokens and 1,024 per iteration: every prompt below is planned whole in the first step
    return Engine.from_pretrained(path, scheduler_config=SchedulerConfig(prefill_chunk=160, max_prefill_tokens=1024))


def test_images_of_requests_admitted_together_give_the_tokens_of_each_alone(vis):
    prompts = [_prompt([(96, 96), (48, 150)], 1), _prompt([(150, 100)], 2), _prompt([(200, 60), (96, 96)], 3)]
    text = list(range(5, 40))
    engine = _engine(vis)
    alone = [engine.generate(p, PARAMS).token_ids for p in [*prompts, text]]
    reqs = [engine.add(engine.make_request(Submission(p, PARAMS))) for p in [*prompts, text]]
    engine.step()
    # the first step planned every prompt whole: the images of three requests were encoded in that step's one call
    assert all(r.prefilled == r.prompt_len for r in reqs)
    assert engine.runner.cache.lengths[: len(reqs)] == [r.prompt_len for r in reqs]
    assert sum(bool(r.images) for r in reqs) == 3
    while not all(r.finished for r in reqs):
        engine.step()
    assert [r.result().token_ids for r in reqs] == alone


def test_a_tile_of_four_on_the_cpu_runs_the_padded_pass_through_the_engine(vis):
    """The accelerators' tile forced on the CPU: five images of three requests admitted together are encoded in
    one planned call as a padded tile of four and one alone; each request's soft tokens equal its images alone
    within fp32 tolerance, and every request completes."""
    engine = _engine(vis)
    engine.model.image_tile = 4
    assert engine.model.vision is not None
    prompts = [_prompt([(96, 96), (48, 150)], 1), _prompt([(150, 100)], 2), _prompt([(200, 60), (96, 96)], 3)]
    reqs = [engine.add(engine.make_request(Submission(p, PARAMS))) for p in prompts]
    feats = encode_planned(engine.model, [(r, 0, r.prompt_len) for r in reqs])
    for r, f in zip(reqs, feats, strict=True):
        alone = torch.cat([engine.model.vision.encode(im.patches, im.positions) for _, im in r.images])
        assert f is not None and f.shape == alone.shape
        assert (f - alone).abs().max().item() <= FP32_TOL
    engine.step()
    assert all(r.prefilled == r.prompt_len for r in reqs)  # one step planned the three prompts: one tower call
    while not all(r.finished for r in reqs):
        engine.step()
    assert all(r.error is None and r.result().token_ids for r in reqs)


def test_a_bad_image_fails_its_request_alone(vis):
    good = [_prompt([(96, 96)], 4), _prompt([(48, 150), (150, 100)], 5)]
    engine = _engine(vis)
    alone = [engine.generate(p, PARAMS).token_ids for p in good]
    # patches one value too wide for the tower's input projection: the shared tower call raises, then each request
    # encodes its own images and only this one fails
    img = good[0].images[0]
    bad_img = dataclasses.replace(img, patches=torch.cat([img.patches, img.patches[:, :1]], dim=1))
    bad = ImagePrompt(good[0].ids, (bad_img,))
    reqs = [engine.add(engine.make_request(Submission(p, PARAMS))) for p in [good[0], bad, good[1]]]
    failed = []
    while not all(r.finished for r in reqs):
        failed += engine.step().failed
    assert failed == [reqs[1]] and isinstance(reqs[1].error, RequestFailedError)
    assert [reqs[0].result().token_ids, reqs[2].result().token_ids] == alone


def test_the_tile_workspace_arithmetic_on_the_real_dims():
    vc = VisionConfig.from_dict({"vision_config": {}})  # transformers' Gemma 4 vision defaults
    assert vc is not None
    assert (vc.hidden_size, vc.intermediate_size, vc.num_attention_heads, vc.max_soft_tokens) == (768, 3072, 12, 280)
    P = 280 * 9  # patches of the largest image
    # the math kernel SDPA may fall back to: fp32 scores, softmax, the all-masked-row check's bool and where()
    scores = 12 * P * P * (4 + 4 + 1 + 4)
    rows = P * (8 * 768 + 3 * 3072) * 2 + P * 4 * 768 * 4  # the layer's activations in bf16, fp32 q/k/v/out
    edges = P * 768 * 4 + P * 280 * 4 + 280 * 768 * 4  # fp32 patches, pooling weights, pooled
    assert tile_workspace_bytes(vc, 1, torch.bfloat16) == scores + rows + edges == 1_110_466_560
    assert tile_workspace_bytes(vc, 4, torch.bfloat16) == 4 * 1_110_466_560  # ~4.4 GB for a GPU tile of 4


def test_the_tile_workspace_comes_out_of_the_kv_budget(vis, caplog):
    model = DiffusionGemma.from_pretrained(vis)
    ws = model.image_workspace_bytes()
    assert model.vision is not None
    assert ws == tile_workspace_bytes(model.vision.config, 1, torch.float32) > 0
    chunk, max_len = 64, 256
    per_slot = SlotCache.bytes_per_slot(model.config, max_len, chunk, model.dtype)
    with caplog.at_level("INFO", logger="dgserve"):
        two = ModelRunner(model, 8, max_len, chunk, CacheConfig(memory=2 * per_slot + ws), prefix_caching=False)
    assert two.num_slots == 2 and two.image_workspace == ws
    assert "set aside for the vision tower" in caplog.text
    one = ModelRunner(model, 8, max_len, chunk, CacheConfig(memory=2 * per_slot + ws - 1), prefix_caching=False)
    assert one.num_slots == 1
    # a model that cannot take images sets nothing aside
    model.vision = None
    assert model.image_workspace_bytes() == 0
    assert ModelRunner(model, 8, max_len, chunk, CacheConfig(memory=2 * per_slot), prefix_caching=False).num_slots == 2


def test_a_grid_beyond_the_position_table_is_a_value_error_before_the_tower(vis):
    from PIL import Image

    thin = Image.fromarray(np.zeros((40, 1000, 3), dtype=np.uint8))
    # "vis" has a position table of 64: this image resizes to 41 x 1 soft tokens, a grid of 123 x 3 patches
    with pytest.raises(ImageError, match=r"^messages\[0\]: the image resizes to 123x3 patches, more than .* 64"):
        preprocess(thin, 16, 3, 70, "messages[0]", max_grid=64)
    img = preprocess(thin, 16, 3, 70)  # without the table's bound (a caller's own ImageInput)
    engine = _engine(vis)
    prompt = ImagePrompt((5, BOI, *[IMAGE] * img.tokens, EOI), (img,))
    with pytest.raises(ValueError, match=r"^messages: image 0 has a patch grid of 123, more than .* \(64\)"):
        engine.make_request(Submission(prompt, PARAMS))
    assert engine.model.vision is not None
    with pytest.raises(ValueError, match="position table"):
        engine.model.vision.encode(img.patches, img.positions)


@pytest.mark.parametrize("cost, together", [(1.0, True), (2.0, False)])
def test_soft_tokens_count_image_token_cost_in_the_prefill_budget(cost, together):
    """A 100-token text prompt and a 70-token prompt holding a 60-soft-token image, a budget of 200 prompt tokens:
    at cost 1 both fit one iteration (170); at cost 2 the image prompt counts 130 and waits for the next."""
    from types import SimpleNamespace

    s = Scheduler(SchedulerConfig(prefill_chunk=128, max_prefill_tokens=200, image_token_cost=cost))
    s.add(Request("text", [0] * 100, None, None))  # type: ignore[arg-type]
    img = SimpleNamespace(tokens=60)
    s.add(Request("image", [0] * 70, None, None, images=((5, img),)))  # type: ignore[arg-type]
    first = [(r.request_id, a, b) for r, a, b in s.schedule().prefill]
    assert first == ([("text", 0, 100), ("image", 0, 70)] if together else [("text", 0, 100)])
    # alone, an image chunk over the budget is still planned: at least one chunk runs every iteration
    if not together:
        assert [(r.request_id, a, b) for r, a, b in s.schedule().prefill] == [("image", 0, 70)]
    with pytest.raises(ValueError, match="image_token_cost"):
        SchedulerConfig(image_token_cost=0.5)


def test_the_engine_sizes_image_tokens_for_its_device(vis):
    engine = _engine(vis)
    assert engine.scheduler.config.image_token_cost == 2.0  # the CPU's default (docs/images.md, "Bench")
    given = Engine.from_pretrained(vis, scheduler_config=SchedulerConfig(image_token_cost=1.5))
    assert given.scheduler.config.image_token_cost == 1.5
