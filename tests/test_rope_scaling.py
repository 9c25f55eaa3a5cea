"""RoPE scaling of the full-attention layers and ``hf_overrides`` (docs/generation.md, "RoPE" and "Configuration"):
the overridden model's fp32 logits equal transformers 5.23.0's under the same override (docs/exactness.md: within
1e-4), a type transformers does not compute exactly here is refused by name, and the override reaches the engine
through ``dgserve serve``'s ``--hf-overrides``."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion
from transformers.cache_utils import DynamicCache
from transformers.models.diffusion_gemma.modeling_diffusion_gemma import DiffusionGemmaTextRotaryEmbedding

from dgserve import DiffusionGemma
from dgserve.config import ConfigError, ModelConfig, merge_overrides, parse_hf_overrides

FP32_TOL = 1e-4  # docs/exactness.md: fp32 logits vs transformers
FULL = ("text_config", "rope_parameters", "full_attention")


def _full_rope(**params) -> dict:
    return {FULL[0]: {FULL[1]: {FULL[2]: params}}}


OVERRIDES = {
    "proportional x8": _full_rope(factor=8.0),
    "proportional x0.5, theta 1e4": _full_rope(factor=0.5, rope_theta=10_000.0),
    "linear x4": _full_rope(rope_type="linear", factor=4.0, partial_rotary_factor=1.0),
    "default (factor ignored)": _full_rope(rope_type="default", factor=4.0, partial_rotary_factor=1.0),
}


def _transformers(path, overrides: dict):
    config = json.loads((path / "config.json").read_text())
    cfg = DiffusionGemmaConfig(**merge_overrides(config, overrides))
    return DiffusionGemmaForBlockDiffusion.from_pretrained(path, config=cfg, dtype=torch.float32).eval()


def _hf_logits(hf, prompt, canvas):
    P, C = prompt.shape[1], canvas.shape[1]
    with torch.no_grad():
        cache = DynamicCache(config=hf.config.get_text_config(decoder=True))
        hf.model.encoder(input_ids=prompt, past_key_values=cache, position_ids=torch.arange(P)[None])
        pos = torch.arange(P, P + C)[None]
        return hf(decoder_input_ids=canvas, past_key_values=cache, decoder_position_ids=pos).logits


def _ours(model, prompt, canvas):
    return model.denoise(model.prefill(prompt), canvas)


@pytest.mark.parametrize("name", list(OVERRIDES))
def test_overridden_rope_logits_match_transformers(tiny_checkpoint, name):
    path = tiny_checkpoint("base")
    overrides = OVERRIDES[name]
    model = DiffusionGemma.from_pretrained(path, hf_overrides=overrides)
    plain = DiffusionGemma.from_pretrained(path)
    C, V = model.config.canvas_length, model.config.vocab_size
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, V, (1, 37), generator=g)
    canvas = torch.randint(0, V, (1, C), generator=g)
    ours, ref = _ours(model, prompt, canvas), _hf_logits(_transformers(path, overrides), prompt, canvas)
    err = (ours - ref).abs().max().item()
    assert err <= FP32_TOL, f"{name}: max |Δlogit| = {err:.3g}"
    moved = (ours - _ours(plain, prompt, canvas)).abs().max().item()
    assert moved > 100 * FP32_TOL, f"{name}: the override did not change the logits ({moved:.3g})"


def test_inv_freq_is_transformers_buffer(tiny_checkpoint):
    """The frequencies themselves: the full layers' buffer equals transformers' bit for bit (both are computed on
    the CPU in fp32 by the same formula, then divided by the factor)."""
    from dgserve.model.layers import rope_inv_freq

    path = tiny_checkpoint("base")
    for overrides in OVERRIDES.values():
        ropes = [
            m for m in _transformers(path, overrides).modules() if isinstance(m, DiffusionGemmaTextRotaryEmbedding)
        ]
        cfg = ModelConfig.from_pretrained(path, overrides)
        full = next(i for i in range(cfg.num_hidden_layers) if not cfg.is_sliding(i))
        assert len(ropes) == 2  # the encoder's and the decoder's
        for rope in ropes:
            assert torch.equal(rope_inv_freq(cfg, full), rope.full_attention_inv_freq), overrides


@pytest.mark.parametrize(
    "params, says",
    [
        ({"rope_type": "yarn", "factor": 4.0}, "'yarn' is not supported"),
        ({"rope_type": "dynamic", "factor": 4.0}, "'dynamic' is not supported"),
        ({"rope_type": "llama3", "factor": 8.0}, "'llama3' is not supported"),
        ({"rope_type": "linear", "partial_rotary_factor": 1.0}, "factor: is required for 'linear'"),
        ({"rope_type": "linear", "factor": 2.0}, "partial_rotary_factor: must be 1.0 for 'linear'"),
        ({"factor": 0.0}, "factor: must be positive"),
        ({"factor": "2"}, "factor: expected a number"),
    ],
)
def test_unsupported_full_layer_rope_is_refused_by_name(tiny_checkpoint, params, says):
    with pytest.raises(ConfigError, match=r"rope_parameters\.full_attention") as e:
        ModelConfig.from_pretrained(tiny_checkpoint("base"), _full_rope(**params))
    assert says in str(e.value)


def test_sliding_layers_take_default_rope_only(tiny_checkpoint):
    bad = {"text_config": {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}}}
    with pytest.raises(ConfigError, match=r"sliding_attention.rope_type: 'linear' is not supported"):
        ModelConfig.from_pretrained(tiny_checkpoint("base"), bad)


def test_scaled_config_round_trips(tiny_checkpoint):
    cfg = ModelConfig.from_pretrained(tiny_checkpoint("base"), _full_rope(factor=4.0))
    assert cfg.rope_factor_full == 4.0 and ModelConfig.from_dict(cfg.to_dict()) == cfg


def test_overrides_merge_key_by_key():
    base = {"a": 1, "text_config": {"x": 1, "rope_parameters": {"full_attention": {"rope_theta": 1e6, "k": 2}}}}
    merged = merge_overrides(base, {"text_config": {"rope_parameters": {"full_attention": {"factor": 2}}}, "b": [1]})
    assert merged == {
        "a": 1,
        "b": [1],
        "text_config": {"x": 1, "rope_parameters": {"full_attention": {"rope_theta": 1e6, "k": 2, "factor": 2}}},
    }
    assert base["text_config"]["rope_parameters"]["full_attention"] == {"rope_theta": 1e6, "k": 2}  # not mutated
    assert merge_overrides({"a": {"b": 1}}, {"a": 3}) == {"a": 3}  # a non-object replaces an object


@pytest.mark.parametrize(
    "raw, says", [("{", "not valid JSON"), ("[1]", "expected a JSON object, got list"), ("3", "got int")]
)
def test_bad_overrides_name_the_flag(raw, says):
    with pytest.raises(ConfigError, match=r"^--hf-overrides: ") as e:
        parse_hf_overrides(raw, "--hf-overrides")
    assert says in str(e.value) and "\n" not in str(e.value)


def test_serve_flag_reaches_the_engine(tiny_checkpoint, capsys):
    """``dgserve serve --hf-overrides``: parsed into the ServiceConfig, then the engine the server loads runs the
    overridden config (its window and its RoPE); a bad value exits 2 with one line naming the flag."""
    from service.__main__ import build_config, main
    from service.server import load_engine

    overrides = {"text_config": {"max_position_embeddings": 96, **_full_rope(factor=2.0)["text_config"]}}
    cfg, _ = build_config(["--model", str(tiny_checkpoint("base")), "--hf-overrides", json.dumps(overrides)], {})
    assert cfg.hf_overrides == overrides
    engine = load_engine(cfg)
    assert engine.max_model_len == 96 and engine.model.config.rope_factor_full == 2.0
    env_cfg, _ = build_config(["--model", "m"], {"DGSERVE_HF_OVERRIDES": json.dumps(overrides)})
    assert env_cfg.hf_overrides == overrides
    assert main(["--model", str(tiny_checkpoint("base")), "--hf-overrides", "[1]"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--hf-overrides: expected a JSON object" in err and len(err.splitlines()) == 1, err


def test_generate_cli_takes_overrides(tiny_checkpoint, capsys):
    from dgserve.__main__ import main

    path = str(tiny_checkpoint("base"))
    assert main(["generate", "--model", path, "--prompt-ids", "5,6", "--hf-overrides", "{nope"]) == 2
    assert "--hf-overrides: not valid JSON" in capsys.readouterr().err
    bad = json.dumps(_full_rope(rope_type="yarn", factor=2.0))
    assert main(["generate", "--model", path, "--prompt-ids", "5,6", "--hf-overrides", bad]) == 2
    assert "'yarn' is not supported" in capsys.readouterr().err
    ok = json.dumps(_full_rope(factor=2.0))
    assert (
        main(["generate", "--model", path, "--prompt-ids", "5,6", "--max-new-tokens", "16", "--hf-overrides", ok]) == 0
    )
