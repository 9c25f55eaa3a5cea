"""The small trained model shipped in the package (its card: python/dgserve/models/small/README.md).

It must load in dgserve and in transformers 5.23.0 (no missing or unexpected keys), generate the same tokens in both
for the same seed under the noise contract (fp32, docs/exactness.md, "Seeded parity with transformers"), fit in 25 MB,
and produce text.
"""

from __future__ import annotations

import json
import pathlib
import re

import pytest
import torch
from hf_reference import Margins, hf_generate

from dgserve import DiffusionGemma, Engine, SamplingParams, Tokenizer
from dgserve.engine.prompt import ChatPrompt

SMALL = pathlib.Path(__file__).resolve().parents[1] / "python" / "dgserve" / "models" / "small"
LEXICON = pathlib.Path(__file__).resolve().parent / "data" / "modern_train_words.txt"
# Unpicked prompts, as tools/eval_small_model.py draws them: the first half (at most 12 words) of the first paragraph
# of each of the first 8 held-out documents (whole documents never trained on, in the corpus's sorted order).
HELD_OUT_PROMPTS = (
    "Coroutine objects are what functions",
    "Return 1 if the object provides the mapping protocol or supports slicing,",
    "The C structure of the",
    "The setup script is the centre of all activity in building, distributing,",
    "The default Python prompt of the interactive shell. Often seen",
    "There is a French translation of an earlier revision",
    "A deprecated alias of TimeoutError, raised when",
    "The modules described in this chapter provide some basic services operations for",
)
FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "README.md",
)

pytestmark = pytest.mark.skipif(not (SMALL / "model.safetensors").exists(), reason="small model not exported")


@pytest.fixture(scope="module")
def hf_small():
    from transformers import DiffusionGemmaForBlockDiffusion

    model, info = DiffusionGemmaForBlockDiffusion.from_pretrained(SMALL, dtype=torch.float32, output_loading_info=True)
    return model.eval(), info


@pytest.fixture(scope="module")
def engine():
    return Engine.from_pretrained(SMALL, dtype=torch.float32)


def test_directory_contents_and_size():
    for name in FILES:
        assert (SMALL / name).is_file(), name
    total = sum(p.stat().st_size for p in SMALL.rglob("*") if p.is_file())
    assert total <= 25 * 1024 * 1024, f"{total} bytes"


def test_config_is_the_real_architecture():
    cfg = json.loads((SMALL / "config.json").read_text())
    text = cfg["text_config"]
    assert cfg["model_type"] == "diffusion_gemma" and cfg["tie_word_embeddings"] is True
    assert {"sliding_attention", "full_attention"} <= set(text["layer_types"])
    assert text["layer_types"][-1] == "full_attention"
    assert text["num_experts"] > text["top_k_experts"] >= 2
    assert cfg["vision_config"]["hidden_size"] <= 32 and cfg["vision_config"]["num_hidden_layers"] == 1
    gen = json.loads((SMALL / "generation_config.json").read_text())
    assert gen["sampler_config"]["_cls_name"] == "EntropyBoundSamplerConfig"
    assert isinstance(gen["sampler_config"]["entropy_bound"], float)
    assert gen["pad_token_id"] == 0 and 1 in gen["eos_token_id"]


def test_transformers_loads_without_missing_or_unexpected_keys(hf_small):
    model, info = hf_small
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info.get("mismatched_keys")
    n = sum(p.numel() for p in model.parameters())
    assert 1_000_000 < n < 10_000_000


def test_dgserve_loads_the_same_weights(hf_small):
    model = DiffusionGemma.from_pretrained(SMALL, dtype=torch.float32)
    cfg = model.config
    assert cfg.canvas_length == hf_small[0].config.canvas_length
    assert cfg.vocab_size == hf_small[0].config.text_config.vocab_size


def test_tokenizer_round_trips_and_chat_template():
    tok = Tokenizer.from_pretrained(SMALL)
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (0, 1, 2)
    for text in [
        "Return a new list containing all items from the iterable in ascending order.",
        "Hello, world! 123 — naïve café\n\ttabs",
        "",
    ]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
    ids = tok.encode("The pathspec syntax", add_special_tokens=True)
    assert ids[0] == 2 and ids.count(2) == 1
    chat = tok.apply_chat_template([{"role": "user", "content": "Who is the king of glory?"}])
    assert chat == "<bos><|turn>user\nWho is the king of glory?<turn|>\n<|turn>model\n"
    chat_ids = tok.encode_chat([{"role": "user", "content": "Who is the king of glory?"}])
    assert chat_ids[:2] == [2, 3] and chat_ids.count(4) == 1


def test_tokenizer_json_adds_one_bos_like_the_config_says():
    """tokenizer.json's post-processor prepends <bos> (`<bos> $A`) and tokenizer_config.json says add_bos_token, so
    `tokenizers` and dgserve agree on plain text (one tokenization of a checkpoint); the training documents
    were `<bos>...<eos>` the same way."""
    from tokenizers import Tokenizer as RawTokenizer

    assert json.loads((SMALL / "tokenizer_config.json").read_text())["add_bos_token"] is True
    raw = RawTokenizer.from_file(str(SMALL / "tokenizer.json"))
    text = "Return the number of items in a container."
    ids = raw.encode(text).ids
    assert ids[0] == 2 and ids.count(2) == 1
    assert ids == Tokenizer.from_pretrained(SMALL).encode(text, add_special_tokens=True)


@pytest.mark.parametrize("seed", [0, 7])
def test_engine_matches_transformers_generate(hf_small, engine, seed):
    """Same tokens as transformers' generate() under the seeded noise contract (fp32; docs/exactness.md, "Seeded
    parity with transformers")."""
    hf = hf_small[0]
    prompt = engine.tokenizer.encode("This function returns a new object, and the caller", add_special_tokens=True)
    steps, max_new = 12, 32
    margins = Margins()
    ref, _ = hf_generate(
        hf,
        prompt,
        seed,
        max_new_tokens=max_new,
        steps=steps,
        t_min=0.4,
        t_max=0.8,
        entropy_bound=0.5,
        eos_ids=(1, 4),
        pad_id=0,
        margins=margins,
    )
    # exact tokens are promised only away from near-ties (docs/exactness.md, "Near-ties"): the fixture must be
    assert margins.worst() > 1, f"seed {seed}: the fixture sits on a near-tie {margins}"
    params = SamplingParams(
        max_new_tokens=max_new, max_denoising_steps=steps, t_min=0.4, t_max=0.8, entropy_bound=0.5, seed=seed
    )
    res = engine.generate(prompt, params)
    assert res.token_ids and res.token_ids == ref[: len(res.token_ids)]


def test_generation_returns_text(engine):
    res = engine.generate("The default value is", engine.default_params(max_new_tokens=32, seed=1))
    assert res.text.strip()
    res = engine.generate(
        ChatPrompt(({"role": "user", "content": "What does this function return?"},)),
        engine.default_params(max_new_tokens=32, seed=2),
    )
    assert res.token_ids and res.finish_reason in ("eos", "length")


def test_writes_mostly_real_words(engine):
    """Recognisably English: most words the model writes are words of its training text.

    The word list is the train split's vocabulary (19,674 words of the Python, Git and Debian documentation prose,
    written by `tools/eval_small_model.py --write-lexicon`). The shipped model scores 0.90 on these 8 prompts; the
    model card has the eval tool's 40-prompt score next to the true continuations and tokens drawn from the train
    unigram distribution. A model that learned only token frequencies, or a broken export, fails this bar.
    """
    vocab = set(LEXICON.read_text().split())
    params = [
        engine.default_params(max_new_tokens=48, seed=100 + i, ignore_eos=True) for i in range(len(HELD_OUT_PROMPTS))
    ]
    outs = engine.generate_batch(list(HELD_OUT_PROMPTS), params)
    words = [w.lower() for o in outs for w in re.findall(r"[A-Za-z]+", o.text)]
    assert len(words) >= 150, words
    known = sum(w in vocab for w in words) / len(words)
    print(f"known words: {known:.3f}")
    assert known >= 0.80, (known, [o.text for o in outs])


def _picture(seed: int, size=(72, 120)):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8), "RGB")


def test_tokenizer_image_tokens_are_in_the_vocabulary():
    """The image ids (BOI, placeholder, EOI) are three byte-level entries no UTF-8 text can produce (bytes 0xFD–0xFF),
    renamed to Gemma 4's image markers: text encodes as before, and the markers are special tokens."""
    config = json.loads((SMALL / "config.json").read_text())
    ids = (config["boi_token_id"], config["image_token_id"], config["eoi_token_id"])
    assert ids == (190, 191, 192) and all(i < config["text_config"]["vocab_size"] for i in ids)
    tok = Tokenizer.from_pretrained(SMALL)
    text = "".join(chr(c) for c in range(1, 0x3000) if not 0xD800 <= c < 0xE000) + " ý þ ÿ"
    assert not set(tok.encode(text, add_special_tokens=False)) & set(ids)
    assert tok.encode("<|image><|image|><image|>", add_special_tokens=False) == list(ids)
    assert tok.decode(list(ids) + tok.encode("a", add_special_tokens=False), skip_special_tokens=True) == "a"


def test_engine_takes_an_image_like_transformers(hf_small, engine):
    """The shipped chat template writes <|image|> for an image part; the engine splices BOI, one placeholder per
    soft token and EOI there, and generates transformers' tokens for the same seed (the tower is untrained: the
    answer is noise, but the path is the real one)."""
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    from dgserve.media.images import pad_batch, preprocess

    vc = engine.model.vision.config
    image = preprocess(_picture(3), vc.patch_size, vc.pooling_kernel_size, 280)
    messages = ({"role": "user", "content": [{"type": "text", "text": "What is this?"}, {"type": "image"}]},)
    prompt = ChatPrompt(messages, images=(image,))
    ids = engine.prompt_ids(prompt)
    start = ids.index(vc.boi_token_id)
    assert ids[start + 1 : start + 1 + image.tokens] == [vc.image_token_id] * image.tokens
    assert ids[start + 1 + image.tokens] == vc.eoi_token_id and ids.count(vc.image_token_id) == image.tokens
    ref_pv = Gemma4ImageProcessorPil(patch_size=16, max_soft_tokens=280, pooling_kernel_size=3)(
        [_picture(3)], return_tensors="pt"
    )["pixel_values"]
    pv, pos = pad_batch([image])
    assert torch.equal(ref_pv[:, : pv.shape[1]], pv)
    margins = Margins()
    case = dict(max_new_tokens=32, steps=12, t_min=0.4, t_max=0.8, entropy_bound=0.5)
    ref, _ = hf_generate(
        hf_small[0],
        ids,
        5,
        eos_ids=(1, 4),
        pad_id=0,
        margins=margins,
        pixel_values=pv,
        image_position_ids=pos,
        mm_token_type_ids=(torch.tensor([ids]) == vc.image_token_id).long(),
        **case,
    )
    assert margins.worst() > 1, f"the fixture sits on a near-tie {margins}"
    params = SamplingParams(max_new_tokens=32, max_denoising_steps=12, t_min=0.4, t_max=0.8, entropy_bound=0.5, seed=5)
    res = engine.generate(prompt, params)
    assert res.token_ids and res.token_ids == ref[: len(res.token_ids)]
