"""Tiny random DiffusionGemma models built with transformers: the parity reference (docs/exactness.md, "Test
models")."""

from __future__ import annotations

import torch

# name -> kwargs overriding the tiny config (docs/exactness.md, "Test models")
TINY_VARIANTS: dict[str, dict] = {
    # docs/exactness.md, "Test models": C=16 > W=8, two sliding layers and one full layer, 4 experts top-2
    "base": {},
    # every layer full (k_eq_v everywhere), more experts, top-1
    "full": dict(layer_types=["full_attention", "full_attention"], num_hidden_layers=2, num_experts=5, top_k_experts=1),
    # window longer than the canvas, canvas 8, more experts and heads
    "wide": dict(
        sliding_window=24,
        num_experts=6,
        top_k_experts=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        canvas_length=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        num_hidden_layers=4,
    ),
    # images (docs/images.md): image token ids inside the vocabulary, a 2-layer tower with GQA and a non-square
    # head layout; "vis_wide" has a window longer than an image's placeholder run
    "vis": dict(vision=True),
    # a tower that cuts 8-pixel patches and pools 2x2 (tests/test_image_processor.py: a processor unlike the defaults)
    "vis_proc": dict(vision=True, tower=dict(patch_size=8, pooling_kernel_size=2)),
    "vis_wide": dict(
        vision=True, sliding_window=24, layer_types=["sliding_attention", "full_attention"], num_hidden_layers=2
    ),
}
# the image token ids of the vision variants (in the tiny vocabulary of 300)
BOI, IMAGE, EOI = 296, 297, 298


def tiny_config(canvas_length: int = 16, vision: bool = False, tower: dict | None = None, **overrides):
    from transformers import DiffusionGemmaConfig, DiffusionGemmaTextConfig, Gemma4VisionConfig

    text_kw = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=4,
        top_k_experts=2,
        num_hidden_layers=3,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        num_global_key_value_heads=1,
        sliding_window=8,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        use_bidirectional_attention="vision",
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
        },
    )
    text_kw.update(overrides)
    text = DiffusionGemmaTextConfig(**text_kw)
    if not vision:
        tower = Gemma4VisionConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=8,
        )
        return DiffusionGemmaConfig(text_config=text, vision_config=tower, canvas_length=canvas_length)
    tower = Gemma4VisionConfig(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        position_embedding_size=64,
        **(tower or {}),  # (tests/test_image_processor.py: another patch size and pooling)
    )
    return DiffusionGemmaConfig(
        text_config=text,
        vision_config=tower,
        canvas_length=canvas_length,
        boi_token_id=BOI,
        image_token_id=IMAGE,
        eoi_token_id=EOI,
        vision_soft_tokens_per_image=70,
    )


def make_tiny_hf_model(variant: str = "base", seed: int = 0):
    """A random transformers model whose norms, scales and layer scalars are non-trivial (docs/exactness.md, "Test
    models")."""
    from transformers import DiffusionGemmaForBlockDiffusion

    kw = dict(TINY_VARIANTS[variant])
    canvas = kw.pop("canvas_length", 16)
    vision = bool(kw.get("vision"))
    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion(tiny_config(canvas, **kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            # (the vision variants only: the text variants' weights, and so the parity fixtures, stay as they were)
            if vision and "vision_tower" in name and name.endswith("position_embedding_table"):
                p.copy_(0.5 * torch.randn_like(p))  # initialised to ones: make the 2-D positions visible
            if name.endswith(("norm.weight", "router.scale", "per_expert_scale")):
                p.copy_(1 + 0.3 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand_like(b))
    return model


# tests/test_image_processor.py: an image processor unlike transformers' defaults in every setting it reads (the
# tower's patch size and pooling are "vis_proc"'s); do_resize is not among them: only true is supported
ODD_PROCESSOR = {
    "image_processor_type": "Gemma4ImageProcessor",
    "patch_size": 8,
    "pooling_kernel_size": 2,
    "max_soft_tokens": 140,
    "resample": 1,  # lanczos
    "do_rescale": False,
    "rescale_factor": 0.5,  # (not applied: do_rescale is false, as in transformers)
    "do_normalize": True,
    "image_mean": [120.0, 128.5, 136.0],
    "image_std": [60.0, 64.0, 68.25],
    "do_convert_rgb": False,
}


def make_processor_checkpoint(path) -> None:
    """The "vis_proc" model in ``path`` with ODD_PROCESSOR as its processor_config.json's image_processor section
    (a preprocessor_config.json saying otherwise loses to it, as config.json's 70 soft tokens do), a tokenizer
    whose image tokens are BOI, IMAGE, EOI and the shipped model's chat template (it writes ``<|image|>``)."""
    import json
    import pathlib

    from dgserve.model.default_model import TOKENIZER_CONFIG, train_tokenizer

    path = pathlib.Path(path)
    make_tiny_hf_model("vis_proc").save_pretrained(path)
    tok = train_tokenizer(BOI)
    tok.add_special_tokens(["<|image>", "<|image|>", "<image|>"])  # ids BOI, IMAGE, EOI
    tok.save(str(path / "tokenizer.json"))
    small = pathlib.Path(__file__).parents[1] / "python/dgserve/models/small/tokenizer_config.json"
    config = {
        **TOKENIZER_CONFIG,
        "chat_template": json.loads(small.read_text())["chat_template"],
        "extra_special_tokens": {"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>"},
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    processor = {"image_processor": ODD_PROCESSOR, "processor_class": "Gemma4Processor", "image_seq_length": 280}
    (path / "processor_config.json").write_text(json.dumps(processor))
    (path / "preprocessor_config.json").write_text(json.dumps({**ODD_PROCESSOR, "max_soft_tokens": 70}))


def write_vision_chat_checkpoint(path):
    """The "vis" tiny checkpoint (image ids 296..298 inside its 300-token vocabulary) with a BPE tokenizer of 296
    tokens, written to ``path``: as in the real model, no text encodes to an image id. Returns ``path``."""
    import json

    from dgserve.model.default_model import TOKENIZER_CONFIG, train_tokenizer

    make_tiny_hf_model("vis").save_pretrained(path)
    train_tokenizer(296).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG))
    return path
