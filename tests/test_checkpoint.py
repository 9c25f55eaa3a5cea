"""dgserve.model.checkpoint: loads transformers-written checkpoints under canonical names with the exact values
transformers uses (docs/generation.md, "Checkpoint tensors"), writes checkpoints transformers loads, and names the
culprit in every error."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import TINY_VARIANTS, make_tiny_hf_model

from dgserve.config import ModelConfig
from dgserve.model.checkpoint import CheckpointError, expected_shapes, hf_names, load_weights, save_weights

ENC = "model.encoder.language_model."
DEC = "model.decoder."


def hf_reference(model) -> dict[str, torch.Tensor]:
    """transformers' tensors under dgserve's canonical names: the decoder's parameters and persistent buffers,
    plus the encoder's own layer scalars."""
    ref = dict(model.model.decoder.state_dict())
    for name, buf in model.model.encoder.language_model.named_buffers():
        if name.endswith(".layer_scalar"):
            ref[name.removesuffix("layer_scalar") + "encoder_layer_scalar"] = buf
    return ref


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name


def rewrite(src, dst, edit) -> None:
    """Copy checkpoint `src` to `dst`, passing its state dict through `edit` (which mutates it in place)."""
    dst.mkdir(parents=True, exist_ok=True)
    sd = load_file(src / "model.safetensors")
    edit(sd)
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(src / "config.json", dst / "config.json")


@pytest.fixture(scope="module")
def base(tiny_checkpoint):
    path = tiny_checkpoint("base")
    cfg = ModelConfig.from_pretrained(path)
    return path, cfg, load_weights(path, cfg)


# ---------------------------------------------------------------------------------------- parity with transformers


@pytest.mark.parametrize("variant", list(TINY_VARIANTS))
def test_names_shapes_and_values_match_transformers(tiny_checkpoint, hf_model_loader, variant):
    path = tiny_checkpoint(variant)
    cfg = ModelConfig.from_pretrained(path)
    ours = load_weights(path, cfg)
    ref = hf_reference(hf_model_loader(path))
    assert {k: tuple(v.shape) for k, v in ref.items()} == expected_shapes(cfg)
    assert_same(ours, ref)
    # both scalar sets are real and distinct (docs/generation.md, "Checkpoint tensors")
    for i in range(cfg.num_hidden_layers):
        assert not torch.equal(ours[f"layers.{i}.layer_scalar"], ours[f"layers.{i}.encoder_layer_scalar"])
    assert "lm_head.weight" not in ours
    assert all(f"layers.{i}.self_attn.v_proj.weight" in ours for i in range(cfg.num_hidden_layers) if cfg.is_sliding(i))


def test_bf16_load(base, hf_model_loader):
    path, cfg, fp32 = base
    bf16 = load_weights(path, cfg, dtype=torch.bfloat16, device="cpu")
    assert all(t.dtype == torch.bfloat16 for t in bf16.values())
    assert_same(bf16, {k: v.to(torch.bfloat16) for k, v in fp32.items()})
    assert_same(bf16, hf_reference(hf_model_loader(path, torch.bfloat16)))


def test_sharded_checkpoint(base, tmp_path):
    path, cfg, single = base
    make_tiny_hf_model("base").save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (tmp_path / "model.safetensors").exists()
    assert_same(load_weights(tmp_path, cfg), single)


def _is_shared(name: str) -> bool:
    return (
        name.startswith(DEC) and not name.endswith(".layer_scalar") and not name.startswith(DEC + "self_conditioning.")
    )


def test_encoder_prefixed_layout_loads_identically(base, tmp_path):
    path, cfg, ref = base

    def to_encoder(sd):
        for name in [n for n in sd if _is_shared(n)]:
            sd[ENC + name.removeprefix(DEC)] = sd.pop(name)

    rewrite(path, tmp_path, to_encoder)
    assert any(n.startswith(ENC + "layers.0.experts") for n in load_file(tmp_path / "model.safetensors"))
    assert_same(load_weights(tmp_path, cfg), ref)


def test_both_prefixes_present_prefers_decoder(base, tmp_path):
    path, cfg, ref = base

    def add_encoder_copies(sd):
        for name in [n for n in sd if _is_shared(n)]:
            sd[ENC + name.removeprefix(DEC)] = sd[name] + 1.0

    rewrite(path, tmp_path, add_encoder_copies)
    assert_same(load_weights(tmp_path, cfg), ref)


def test_lm_head_kept_only_when_different(base, tmp_path):
    path, cfg, ref = base
    rewrite(path, tmp_path / "same", lambda sd: sd.update({"lm_head.weight": sd[DEC + "embed_tokens.weight"].clone()}))
    assert_same(load_weights(tmp_path / "same", cfg), ref)
    head = torch.randn(cfg.vocab_size, cfg.hidden_size)
    rewrite(path, tmp_path / "diff", lambda sd: sd.update({"lm_head.weight": head}))
    ours = load_weights(tmp_path / "diff", cfg)
    assert torch.equal(ours.pop("lm_head.weight"), head)
    assert_same(ours, ref)


# --------------------------------------------------------------------------------------------------------- saving


@pytest.mark.parametrize("variant", list(TINY_VARIANTS))
def test_save_weights_loads_in_transformers(tiny_checkpoint, tmp_path, variant):
    from transformers import DiffusionGemmaForBlockDiffusion

    src = tiny_checkpoint(variant)
    cfg = ModelConfig.from_pretrained(src)
    weights = load_weights(src, cfg)
    save_weights(tmp_path, cfg, weights, torch.float32)
    assert ModelConfig.from_pretrained(tmp_path) == cfg
    model, info = DiffusionGemmaForBlockDiffusion.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert_same(hf_reference(model.eval()), weights)
    assert model.lm_head.weight.data_ptr() == model.model.decoder.embed_tokens.weight.data_ptr()  # tied
    assert_same(load_weights(tmp_path, cfg), weights)


def test_save_weights_bf16_and_lm_head(base, tmp_path):
    path, cfg, weights = base
    save_weights(tmp_path / "bf16", cfg, weights, torch.bfloat16)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    assert_same(
        load_weights(tmp_path / "bf16", cfg, torch.bfloat16), {k: v.to(torch.bfloat16) for k, v in weights.items()}
    )
    head = torch.randn(cfg.vocab_size, cfg.hidden_size)
    save_weights(tmp_path / "head", cfg, dict(weights, **{"lm_head.weight": head}))
    assert torch.equal(load_weights(tmp_path / "head", cfg)["lm_head.weight"], head)
    save_weights(tmp_path / "tied", cfg, dict(weights, **{"lm_head.weight": weights["embed_tokens.weight"]}))
    assert "lm_head.weight" not in load_file(tmp_path / "tied" / "model.safetensors")


@pytest.mark.parametrize(
    "edit,needle",
    [
        (lambda w: w.pop("layers.1.mlp.up_proj.weight"), "layers.1.mlp.up_proj.weight"),
        (lambda w: w.update({"layers.2.self_attn.v_proj.weight": torch.zeros(32, 64)}), "layers.2.self_attn.v_proj"),
        (lambda w: w.update({"norm.weight": torch.zeros(65)}), "norm.weight"),
    ],
)
def test_save_weights_rejects_bad_dicts(base, tmp_path, edit, needle):
    _, cfg, weights = base
    weights = dict(weights)
    edit(weights)
    with pytest.raises(CheckpointError, match=needle.replace(".", r"\.")):
        save_weights(tmp_path, cfg, weights)


def test_hf_names():
    assert hf_names("layers.3.encoder_layer_scalar") == (ENC + "layers.3.layer_scalar",)
    assert hf_names("layers.3.layer_scalar") == (DEC + "layers.3.layer_scalar",)
    assert hf_names("self_conditioning.up_proj.weight") == (DEC + "self_conditioning.up_proj.weight",)
    assert hf_names("layers.0.experts.down_proj") == (
        DEC + "layers.0.experts.down_proj",
        ENC + "layers.0.experts.down_proj",
    )


# --------------------------------------------------------------------------------------------------------- errors


def _expect_error(path, cfg, *needles):
    with pytest.raises(CheckpointError) as e:
        load_weights(path, cfg)
    for needle in needles:
        assert needle in str(e.value)
    return str(e.value)


def test_missing_files(base, tmp_path):
    path, cfg, _ = base
    (tmp_path / "a").mkdir()
    shutil.copy(path / "model.safetensors", tmp_path / "a")
    _expect_error(tmp_path / "a", cfg, "config.json")
    (tmp_path / "b").mkdir()
    shutil.copy(path / "config.json", tmp_path / "b")
    _expect_error(tmp_path / "b", cfg, "model.safetensors")


def test_index_listing_missing_shard(base, tmp_path):
    _, cfg, _ = base
    make_tiny_hf_model("base").save_pretrained(tmp_path, max_shard_size="20KB")
    shard = sorted(set(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"].values()))[1]
    (tmp_path / shard).unlink()
    _expect_error(tmp_path, cfg, shard)
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": ')
    _expect_error(tmp_path, cfg, "model.safetensors.index.json")


@pytest.mark.parametrize("garble", ["truncate", "garbage", "empty"])
def test_garbled_file(base, tmp_path, garble):
    path, cfg, _ = base
    shutil.copy(path / "config.json", tmp_path)
    data = (path / "model.safetensors").read_bytes()
    data = {"truncate": data[: len(data) // 2], "garbage": b"this is not a safetensors file" * 9, "empty": b""}[garble]
    (tmp_path / "model.safetensors").write_bytes(data)
    _expect_error(tmp_path, cfg, "model.safetensors")


def _nvfp4_layer0(experts=range(4), scale_byte=0x38):
    """Replace layer 0's fused experts by per-expert NVFP4 tensors (scale byte 0x38 = 1.0, 0x7F = NaN)."""

    def edit(sd):
        for name in [n for n in sd if n.startswith(DEC + "layers.0.experts.")]:
            del sd[name]
        for e in experts:
            for proj, (n, k) in {"gate_proj": (32, 64), "up_proj": (32, 64), "down_proj": (64, 32)}.items():
                p = f"{DEC}layers.0.experts.{e}.{proj}."
                sd[p + "weight"] = torch.zeros(n, k // 2, dtype=torch.uint8)
                sd[p + "weight_scale"] = torch.full((n, k // 16), scale_byte, dtype=torch.uint8).view(
                    torch.float8_e4m3fn
                )
                sd[p + "weight_scale_2"] = torch.ones(1)
                sd[p + "input_scale"] = torch.ones(1)

    return edit


ERRORS = [
    ("missing tensor", lambda sd: sd.pop(DEC + "layers.1.mlp.up_proj.weight"), DEC + "layers.1.mlp.up_proj.weight"),
    (
        "missing self-conditioning",
        lambda sd: sd.pop(DEC + "self_conditioning.down_proj.weight"),
        DEC + "self_conditioning.down_proj.weight",
    ),
    ("missing encoder scalar", lambda sd: sd.pop(ENC + "layers.0.layer_scalar"), ENC + "layers.0.layer_scalar"),
    ("missing decoder scalar", lambda sd: sd.pop(DEC + "layers.2.layer_scalar"), DEC + "layers.2.layer_scalar"),
    (
        "shape mismatch",
        lambda sd: sd.update({DEC + "layers.0.self_attn.q_norm.weight": torch.ones(17)}),
        DEC + "layers.0.self_attn.q_norm.weight",
        "[16]",
        "[17]",
    ),
    (
        "expert shape",
        lambda sd: sd.update({DEC + "layers.2.experts.gate_up_proj": torch.ones(4, 32, 64)}),
        DEC + "layers.2.experts.gate_up_proj",
        "[4, 64, 64]",
    ),
    (
        "v_proj on full layer",
        lambda sd: sd.update({DEC + "layers.2.self_attn.v_proj.weight": torch.ones(32, 64)}),
        DEC + "layers.2.self_attn.v_proj.weight",
        "full",
    ),
    (
        "attention bias",
        lambda sd: sd.update({DEC + "layers.0.self_attn.q_proj.bias": torch.ones(64)}),
        DEC + "layers.0.self_attn.q_proj.bias",
    ),
    (
        "layer out of range",
        lambda sd: sd.update({DEC + "layers.3.layer_scalar": torch.ones(1)}),
        DEC + "layers.3.layer_scalar",
    ),
    (
        "integer weight",
        lambda sd: sd.update({DEC + "norm.weight": torch.ones(64, dtype=torch.int32)}),
        DEC + "norm.weight",
        "I32",
    ),
    ("nvfp4 expert missing", _nvfp4_layer0(range(3)), DEC + "layers.0.experts.3.gate_proj.weight"),
    ("nvfp4 NaN scale", _nvfp4_layer0(scale_byte=0x7F), "layers.0.experts.0.gate_proj.weight_scale", "NaN"),
    ("nvfp4 negative scale", _nvfp4_layer0(scale_byte=0xB8), "weight_scale", "negative"),
]


@pytest.mark.parametrize("case,edit,needles", [(c, e, n) for c, e, *n in ERRORS], ids=[c for c, *_ in ERRORS])
def test_tensor_errors_name_the_tensor(base, tmp_path, case, edit, needles):
    path, cfg, _ = base
    rewrite(path, tmp_path, edit)
    _expect_error(tmp_path, cfg, *needles)


def test_vision_tensors_are_ignored(base, tmp_path):
    path, cfg, ref = base
    assert any("vision_tower" in n for n in load_file(path / "model.safetensors"))
    rewrite(
        path,
        tmp_path,
        lambda sd: sd.update(
            {"model.encoder.embed_vision.extra.weight": torch.ones(3), "model.vision_tower.anything": torch.ones(2)}
        ),
    )
    assert_same(load_weights(tmp_path, cfg), ref)


def test_checkpoint_of_another_config_is_rejected(tiny_checkpoint):
    cfg_wide = ModelConfig.from_pretrained(tiny_checkpoint("wide"))  # layer 1 is full there, sliding in "base"
    _expect_error(tiny_checkpoint("base"), cfg_wide, DEC + "layers.1.self_attn.v_proj.weight")
    cfg_5 = dataclasses.replace(ModelConfig.from_pretrained(tiny_checkpoint("base")), num_experts=5)
    _expect_error(tiny_checkpoint("base"), cfg_5, "shape mismatch", "expected [5, 64]")
