"""The checkpoint's image processor (docs/images.md, "Where the settings come from"): its files read as transformers
reads them, every setting applied bit for bit as ``Gemma4ImageProcessorPil`` applies it, and a checkpoint whose
processor differs from the defaults in every setting gives transformers' prompt ids, pixels and seeded tokens."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
import torch
from tiny_models import IMAGE, ODD_PROCESSOR, make_processor_checkpoint

from dgserve.engine.prompt import ChatPrompt
from dgserve.media.images import ImageError, pad_batch, preprocess
from dgserve.media.processor import ImageProcessorConfig
from dgserve.model.vision import VisionConfig

SMALL = pathlib.Path(__file__).parents[1] / "python/dgserve/models/small"
# odd sizes; each fits the tiny tower's 64-patch position table at 8-pixel patches
SIZES = [(37, 90), (61, 45), (100, 33), (50, 50)]


def _images(sizes, seed=0, mode="RGB"):
    from PIL import Image

    rng = np.random.default_rng(seed)
    channels = 4 if mode == "RGBA" else 3
    return [Image.fromarray(rng.integers(0, 256, (h, w, channels), dtype=np.uint8), mode) for h, w in sizes]


def _hf_image_processor(d: dict):
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    return Gemma4ImageProcessorPil(**{k: v for k, v in d.items() if k != "image_processor_type"})


def _same_as_transformers(ours, ref):
    pv, pos = pad_batch(ours)
    P = pv.shape[1]
    if "num_soft_tokens_per_image" in ref:  # (the processor drops it: its prompt ids hold the counts)
        assert [o.tokens for o in ours] == ref["num_soft_tokens_per_image"].tolist()
    assert torch.equal(ref["pixel_values"][:, :P].float(), pv) and bool((ref["pixel_values"][:, P:] == 0).all())
    assert torch.equal(ref["image_position_ids"][:, :P], pos) and bool((ref["image_position_ids"][:, P:] == -1).all())


@pytest.fixture(scope="module")
def odd_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("dg-odd-processor")
    make_processor_checkpoint(path)
    return path


SETTINGS = [
    ODD_PROCESSOR,
    # rescaled by another factor, then normalized (each step's rounding: float64 then float32)
    {"max_soft_tokens": 70, "resample": 2, "rescale_factor": 1 / 127.5, "do_normalize": True, "image_mean": 1.0,
     "image_std": [0.5, 0.25, 2.0]},
    {"max_soft_tokens": 560, "resample": 0, "do_rescale": False},  # raw uint8 values
    {"patch_size": 14, "pooling_kernel_size": 2, "max_soft_tokens": 140, "resample": 4, "rescale_factor": 0.01},
    {"max_soft_tokens": 140, "resample": 5, "do_convert_rgb": False},
]  # fmt: skip


@pytest.mark.parametrize("settings", SETTINGS)
def test_every_setting_is_applied_as_transformers_applies_it(settings):
    proc = ImageProcessorConfig.from_dict(settings, "processor_config.json: image_processor")
    ref_proc = _hf_image_processor(settings)
    for key in ("patch_size", "pooling_kernel_size", "max_soft_tokens", "do_rescale", "rescale_factor"):
        assert getattr(proc, key) == getattr(ref_proc, key), key
    assert proc.resample == int(ref_proc.resample) and proc.do_convert_rgb == ref_proc.do_convert_rgb
    imgs = _images(SIZES + [(300, 48)])
    if proc.do_convert_rgb:
        imgs += _images([(60, 90)], seed=1, mode="RGBA") + [_images([(33, 70)])[0].convert("L")]
    ref = ref_proc(imgs, return_tensors="pt")
    p, k, n = proc.patch_size, proc.pooling_kernel_size, proc.max_soft_tokens
    _same_as_transformers([preprocess(im, p, k, n, processor=proc) for im in imgs], ref)
    if not proc.do_convert_rgb:  # transformers would hand the tower 4 channels: a 400 naming the part
        with pytest.raises(ImageError, match=r"^messages\[0\]\.content\[1\]: the image is RGBA.*do_convert_rgb"):
            preprocess(_images([(60, 90)], mode="RGBA")[0], p, k, n, "messages[0].content[1]", processor=proc)


def test_the_files_are_read_as_transformers_reads_them(odd_dir, tmp_path):
    from transformers import AutoImageProcessor

    # processor_config.json's section wins over preprocessor_config.json (70) and config.json (70)
    proc = VisionConfig.from_pretrained(odd_dir).processor
    ref = AutoImageProcessor.from_pretrained(odd_dir)
    assert proc == ImageProcessorConfig.from_dict(ODD_PROCESSOR, "processor_config.json: image_processor")
    assert (proc.max_soft_tokens, ref.max_soft_tokens) == (140, 140)
    assert proc.image_mean == ref.image_mean and proc.image_std == ref.image_std
    # without the section, preprocessor_config.json is the file
    for name in ("config.json", "preprocessor_config.json"):
        (tmp_path / name).write_text((odd_dir / name).read_text())
    (tmp_path / "processor_config.json").write_text(json.dumps({"processor_class": "Gemma4Processor"}))
    assert ImageProcessorConfig.from_pretrained(tmp_path).max_soft_tokens == 70
    assert AutoImageProcessor.from_pretrained(tmp_path).max_soft_tokens == 70
    # none: transformers' defaults, config.json's vision_soft_tokens_per_image kept (the "vis" checkpoints); the
    # shipped model's preprocessing is unchanged (280 soft tokens, the defaults)
    (tmp_path / "processor_config.json").unlink()
    (tmp_path / "preprocessor_config.json").unlink()
    assert ImageProcessorConfig.from_pretrained(tmp_path) == ImageProcessorConfig(max_soft_tokens=70)
    small = VisionConfig.from_pretrained(SMALL)
    assert small is not None and small.processor == ImageProcessorConfig() and small.max_soft_tokens == 280


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("max_soft_tokens", 100, "max_soft_tokens 100 is not one of"),
        ("resample", 7, "resample 7 is not a PIL resampling filter"),
        ("resample", "bicubic", "resample 'bicubic' is not a PIL resampling filter"),
        ("do_resize", False, "do_resize false is not supported"),
        ("image_std", [1.0, 0.0, 1.0], "image_std must not hold 0"),
        ("image_mean", [0.5, 0.5], "image_mean must be a number or 3 numbers"),
        ("do_normalize", "yes", "do_normalize must be true or false"),
        ("rescale_factor", -1, "rescale_factor must be a positive number"),
        ("patch_size", 16, "patch_size 16 differs from config.json's vision_config.patch_size 8"),
        ("pooling_kernel_size", 3, "pooling_kernel_size 3 differs"),
        ("image_processor_type", "SiglipImageProcessor", "image_processor_type 'SiglipImageProcessor' is not"),
    ],
)
def test_a_setting_dgserve_cannot_serve_is_a_value_error_naming_file_and_key(odd_dir, tmp_path, key, value, message):
    (tmp_path / "config.json").write_text((odd_dir / "config.json").read_text())
    bad = {**ODD_PROCESSOR, "do_rescale": True, key: value}
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_processor": bad}))
    with pytest.raises(ValueError, match=r"^processor_config\.json: image_processor: " + message.replace(".", r"\.")):
        VisionConfig.from_pretrained(tmp_path)


class _Processor:
    """transformers' ``Gemma4Processor`` without its video processor (which needs torchvision, not installed
    here): the same image expansion and tokenization."""

    @staticmethod
    def load(path, chat_template: str):
        from transformers import AutoImageProcessor, AutoTokenizer, Gemma4AudioFeatureExtractor, Gemma4Processor
        from transformers.processing_utils import ProcessorMixin

        class NoVideo(Gemma4Processor):
            @classmethod
            def get_attributes(cls):
                return ["feature_extractor", "image_processor", "tokenizer"]

            def __init__(self, feature_extractor, image_processor, tokenizer, chat_template=None):
                self.image_seq_length = 280
                self.image_token_id = tokenizer.image_token_id
                self.boi_token, self.eoi_token = tokenizer.boi_token, tokenizer.eoi_token
                self.image_token = tokenizer.image_token
                self.audio_token, self.boa_token, self.eoa_token = "<|audio|>", "<|audio>", "<audio|>"
                ProcessorMixin.__init__(
                    self,
                    feature_extractor=feature_extractor,
                    image_processor=image_processor,
                    tokenizer=tokenizer,
                    chat_template=chat_template,
                )

        tok = AutoTokenizer.from_pretrained(path)
        return NoVideo(Gemma4AudioFeatureExtractor(), AutoImageProcessor.from_pretrained(path), tok, chat_template)


def test_a_checkpoint_unlike_the_defaults_gives_transformers_ids_pixels_and_tokens(odd_dir, hf_model_loader):
    from hf_reference import Margins, hf_generate

    from dgserve import Engine, SamplingParams

    engine = Engine.from_pretrained(odd_dir)
    vc = engine.model.vision.config
    assert (vc.patch_size, vc.pooling_kernel_size, vc.max_soft_tokens) == (8, 2, 140)
    template = json.loads((odd_dir / "tokenizer_config.json").read_text())["chat_template"]
    processor = _Processor.load(odd_dir, template)
    imgs = _images(SIZES[:3], seed=4)
    content = [{"type": "text", "text": "look"}, {"type": "image"}, {"type": "text", "text": "and"}]
    content += [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "what differs?"}]
    ref = processor.apply_chat_template(
        [{"role": "user", "content": [dict(p, image=imgs.pop(0)) if p["type"] == "image" else p for p in content]}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
    )
    ours = [preprocess(im, 8, 2, 140, processor=vc.processor) for im in _images(SIZES[:3], seed=4)]
    _same_as_transformers(ours, ref)
    prompt = ChatPrompt(({"role": "user", "content": content},), images=tuple(ours))
    ids = engine.prompt_ids(prompt)
    assert ids == ref["input_ids"][0].tolist() and ids.count(IMAGE) == sum(o.tokens for o in ours)

    hf = hf_model_loader(odd_dir, torch.float32, attn="sdpa")
    margins = Margins()
    case = dict(max_new_tokens=32, steps=8, t_min=0.4, t_max=0.8, entropy_bound=0.1)
    want, _ = hf_generate(
        hf,
        ids,
        7,
        margins=margins,
        pixel_values=ref["pixel_values"],
        image_position_ids=ref["image_position_ids"],
        mm_token_type_ids=(ref["input_ids"] == IMAGE).long(),
        **case,
    )
    assert margins.worst() > 1, f"near-tie {margins}"
    params = SamplingParams(max_new_tokens=32, max_denoising_steps=8, t_min=0.4, t_max=0.8, entropy_bound=0.1, seed=7)
    got = engine.generate(prompt, params)
    assert got.token_ids == want[: len(got.token_ids)]
