"""dgserve.config: ModelConfig resolves config.json exactly as transformers 5.23 does (docs/generation.md,
"Configuration"), rejects what
dgserve cannot run with a message naming the field, and generation_config.json's defaults follow docs/generation.md,
"Configuration"
(read into SamplingParams, the one table of knobs)."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
from tiny_models import TINY_VARIANTS, tiny_config

from dgserve.config import FULL, SLIDING, ConfigError, ModelConfig, generation_eos_token_ids
from dgserve.sampling_params import SamplingParams


def _variant_config(variant: str):
    kw = dict(TINY_VARIANTS[variant])
    return tiny_config(kw.pop("canvas_length", 16), **kw)


def _hf_geometry(text) -> list[tuple[str, int, int]]:
    """(layer type, head_dim, kv heads) per layer, as transformers' text config reports them."""
    return [
        (text.layer_types[i], text.per_layer_config[i].head_dim, text.per_layer_config[i].num_key_value_heads)
        for i in range(text.num_hidden_layers)
    ]


def _our_geometry(cfg: ModelConfig) -> list[tuple[str, int, int]]:
    return [(cfg.layer_types[i], cfg.head_dim(i), cfg.num_kv_heads(i)) for i in range(cfg.num_hidden_layers)]


def _hf_text(d: dict):
    from transformers import DiffusionGemmaTextConfig

    return DiffusionGemmaTextConfig(**copy.deepcopy(d))


@pytest.fixture(scope="module")
def saved_configs(tmp_path_factory):
    """variant -> directory holding a transformers-written config.json (no weights)."""
    out = {}
    for variant in TINY_VARIANTS:
        path = tmp_path_factory.mktemp(f"cfg-{variant}")
        _variant_config(variant).save_pretrained(path)
        out[variant] = path
    return out


@pytest.fixture
def base_dict(saved_configs) -> dict:
    return json.loads((saved_configs["base"] / "config.json").read_text())


# --------------------------------------------------------------------------------------------- parity with transformers


@pytest.mark.parametrize("variant", list(TINY_VARIANTS))
def test_from_pretrained_matches_transformers(saved_configs, variant):
    from transformers import DiffusionGemmaConfig

    ours = ModelConfig.from_pretrained(saved_configs[variant])
    hf = DiffusionGemmaConfig.from_pretrained(saved_configs[variant])
    text = hf.text_config
    assert _our_geometry(ours) == _hf_geometry(text)
    assert ours.canvas_length == hf.canvas_length
    for name in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "moe_intermediate_size",
        "num_experts",
        "top_k_experts",
        "num_hidden_layers",
        "num_attention_heads",
        "sliding_window",
        "rms_norm_eps",
        "max_position_embeddings",
        "final_logit_softcapping",
        "pad_token_id",
        "eos_token_id",
        "bos_token_id",
    ):
        assert getattr(ours, name) == getattr(text, name), name
    assert ours.rope_theta_sliding == text.rope_parameters[SLIDING]["rope_theta"]
    assert ours.rope_theta_full == text.rope_parameters[FULL]["rope_theta"]
    assert ours.partial_rotary_factor_full == text.rope_parameters[FULL]["partial_rotary_factor"]


@pytest.mark.parametrize("variant", list(TINY_VARIANTS))
def test_to_dict_round_trips_and_transformers_loads_it(saved_configs, variant):
    from transformers import DiffusionGemmaConfig

    ours = ModelConfig.from_pretrained(saved_configs[variant])
    d = ours.to_dict()
    assert ModelConfig.from_dict(d) == ours
    assert ModelConfig.from_dict(json.loads(json.dumps(d))) == ours
    hf = DiffusionGemmaConfig.from_dict(copy.deepcopy(d))
    assert _hf_geometry(hf.text_config) == _our_geometry(ours)
    assert hf.canvas_length == ours.canvas_length
    assert hf.text_config.final_logit_softcapping == ours.final_logit_softcapping


@pytest.mark.parametrize(
    "extra",
    [
        dict(global_head_dim=32, num_global_key_value_heads=1),
        dict(global_head_dim=64),  # kv heads of full layers default to num_key_value_heads
        dict(),  # global_head_dim defaults to 512
        dict(num_hidden_layers=7, layer_types=None),  # (i+1) % 6 rule, last layer forced full
        dict(num_hidden_layers=4, layer_types=[SLIDING] * 4),  # last layer forced full
    ],
)
def test_global_keys_and_layer_type_defaults_match_transformers(extra):
    text = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=4,
        top_k_experts=2,
        num_hidden_layers=3,
        layer_types=[SLIDING, SLIDING, FULL],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    text.update(extra)
    if text["layer_types"] is None:
        del text["layer_types"]
    ours = ModelConfig.from_dict(dict(text, canvas_length=8))  # a bare text_config plus canvas_length
    assert ours.canvas_length == 8
    assert _our_geometry(ours) == _hf_geometry(_hf_text(text))
    assert ours.layer_types[-1] == FULL


def test_zero_padded_per_layer_config_keys_and_layer_pattern():
    text = dict(
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=32,
        num_hidden_layers=12,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        per_layer_config={
            "05": {"head_dim": 64, "num_key_value_heads": 1},
            "11": {"head_dim": 64, "num_key_value_heads": 1},
        },
    )
    ours = ModelConfig.from_dict({"model_type": "diffusion_gemma", "text_config": text})
    assert [i for i in range(12) if not ours.is_sliding(i)] == [5, 11]
    assert (ours.full_head_dim, ours.full_num_kv_heads, ours.sliding_head_dim) == (64, 1, 16)
    assert _our_geometry(ours) == _hf_geometry(_hf_text(text))
    assert list(ours.to_dict()["text_config"]["per_layer_config"]) == ["05", "11"]


def test_defaults_when_absent():
    ours = ModelConfig.from_dict({"text_config": dict(num_experts=8, top_k_experts=2, moe_intermediate_size=16)})
    assert ours.canvas_length == 256 and ours.final_logit_softcapping == 30.0 and ours.tie_word_embeddings
    assert (ours.rope_theta_sliding, ours.rope_theta_full, ours.partial_rotary_factor_full) == (1e4, 1e6, 0.25)
    assert (ours.full_head_dim, ours.full_num_kv_heads) == (512, 4)
    assert (ours.pad_token_id, ours.eos_token_id, ours.bos_token_id) == (0, 1, 2)


def test_softcapping_rope_default_and_eos_list(base_dict):
    d = copy.deepcopy(base_dict)
    d["text_config"]["final_logit_softcapping"] = None
    d["text_config"]["eos_token_id"] = [1, 106]
    d["text_config"]["rope_parameters"][FULL] = {"rope_type": "default", "rope_theta": 5e5}
    ours = ModelConfig.from_dict(d)
    assert ours.final_logit_softcapping is None
    assert ours.eos_token_id == (1, 106)
    assert ours.partial_rotary_factor_full == 1.0 and ours.rope_theta_full == 5e5
    assert ModelConfig.from_dict(ours.to_dict()) == ours
    d["text_config"]["final_logit_softcapping"] = 20.0
    assert ModelConfig.from_dict(d).final_logit_softcapping == 20.0


def test_ignores_vision_bookkeeping_and_gemma4_keys(base_dict):
    d = copy.deepcopy(base_dict)
    d.update(eos_token_id=[9, 9], vision_soft_tokens_per_image=280, initializer_range=0.5)
    d["text_config"].update(
        attention_k_eq_v=False,
        enable_moe_block=False,
        num_kv_shared_layers=3,
        hidden_size_per_layer_input=0,
        use_double_wide_mlp=True,
        attention_dropout=0.1,
    )
    assert ModelConfig.from_dict(d) == ModelConfig.from_dict(base_dict)


def test_per_layer_helpers_frozen_and_hashable(base_dict):
    cfg = ModelConfig.from_dict(base_dict)
    assert [cfg.is_sliding(i) for i in range(3)] == [True, True, False]
    assert [cfg.head_dim(i) for i in range(3)] == [16, 16, 32]
    assert [cfg.num_kv_heads(i) for i in range(3)] == [2, 2, 1]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hidden_size = 1
    assert hash(cfg) == hash(ModelConfig.from_dict(base_dict))


# -------------------------------------------------------------------------------------------------------- rejections


def _set(path: str, value):
    def mutate(d):
        *parents, last = path.split(".")
        node = d
        for p in parents:
            node = node[p]
        if value is _DELETE:
            del node[last]
        else:
            node[last] = value

    return mutate


_DELETE = object()

REJECTIONS = [
    ("text_config.attention_bias", True, "text_config.attention_bias"),
    ("text_config.use_bidirectional_attention", "all", "text_config.use_bidirectional_attention"),
    ("text_config.hidden_activation", "gelu", "text_config.hidden_activation"),
    ("model_type", "gemma4", "model_type"),
    ("text_config.model_type", "gemma4_text", "text_config.model_type"),
    ("text_config.num_experts", _DELETE, "text_config.num_experts"),
    ("text_config.top_k_experts", None, "text_config.top_k_experts"),
    ("text_config.moe_intermediate_size", _DELETE, "text_config.moe_intermediate_size"),
    ("text_config.top_k_experts", 5, "text_config.top_k_experts"),
    ("text_config.hidden_size", 0, "text_config.hidden_size"),
    ("text_config.vocab_size", -3, "text_config.vocab_size"),
    ("text_config.intermediate_size", 96.0, "text_config.intermediate_size"),
    ("text_config.num_hidden_layers", 0, "text_config.num_hidden_layers"),
    ("text_config.sliding_window", 0, "text_config.sliding_window"),
    ("canvas_length", 0, "canvas_length"),
    ("text_config.num_key_value_heads", 3, "text_config.num_key_value_heads"),
    ("text_config.per_layer_config", {"2": {"head_dim": 32, "num_key_value_heads": 3}}, "num_key_value_heads"),
    ("text_config.per_layer_config", {"2": {"sliding_window": 4}}, "text_config.per_layer_config.2.sliding_window"),
    ("text_config.per_layer_config", {"7": {"head_dim": 32}}, "text_config.per_layer_config.7"),
    ("text_config.per_layer_config", {"0": {"head_dim": 32}}, "text_config.per_layer_config"),
    ("text_config.layer_types", [SLIDING, FULL], "text_config.layer_types"),
    ("text_config.layer_types", [SLIDING, "chunked", FULL], "text_config.layer_types"),
    (
        "text_config.rope_parameters.full_attention.rope_type",
        "yarn",
        "text_config.rope_parameters.full_attention.rope_type",
    ),
    (
        "text_config.rope_parameters.sliding_attention.rope_type",
        "linear",
        "text_config.rope_parameters.sliding_attention.rope_type",
    ),
    (
        "text_config.rope_parameters.full_attention.partial_rotary_factor",
        0.0,
        "text_config.rope_parameters.full_attention.partial_rotary_factor",
    ),
    (
        "text_config.rope_parameters.full_attention.partial_rotary_factor",
        1.5,
        "text_config.rope_parameters.full_attention.partial_rotary_factor",
    ),
    ("text_config.rope_parameters.full_attention.factor", -2.0, "text_config.rope_parameters.full_attention.factor"),
    (
        "text_config.rope_parameters.full_attention.rope_theta",
        _DELETE,
        "text_config.rope_parameters.full_attention.rope_theta",
    ),
    ("text_config.rope_parameters.sliding_attention", _DELETE, "text_config.rope_parameters.sliding_attention"),
    ("text_config.rms_norm_eps", 0.0, "text_config.rms_norm_eps"),
    ("text_config.final_logit_softcapping", -1.0, "text_config.final_logit_softcapping"),
    ("text_config.eos_token_id", "eos", "text_config.eos_token_id"),
    ("tie_word_embeddings", "yes", "tie_word_embeddings"),
]


@pytest.mark.parametrize("path,value,field", REJECTIONS, ids=[f"{p}={v!r}" for p, v, _ in REJECTIONS])
def test_rejections_name_the_field(base_dict, path, value, field):
    d = copy.deepcopy(base_dict)
    _set(path, value)(d)
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict(d)
    assert field in str(e.value)
    assert isinstance(e.value, ValueError)


def test_from_pretrained_file_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match=r"config\.json"):
        ModelConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"config\.json"):
        ModelConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"config\.json"):
        ModelConfig.from_pretrained(tmp_path)


def test_direct_construction_is_validated(base_dict):
    cfg = ModelConfig.from_dict(base_dict)
    with pytest.raises(ConfigError, match=r"text_config\.top_k_experts"):
        dataclasses.replace(cfg, top_k_experts=9)
    with pytest.raises(ConfigError, match=r"text_config\.layer_types"):
        dataclasses.replace(cfg, layer_types=(SLIDING, FULL, SLIDING))


# ------------------------------------------------------------------------------------------- generation_config.json


def test_generation_defaults_absent_file_and_transformers_nulls(tmp_path, saved_configs, tiny_checkpoint):
    assert SamplingParams.from_generation_config(tmp_path) == SamplingParams()
    assert generation_eos_token_ids(tmp_path) == ()
    path = tiny_checkpoint("base")
    assert json.loads((path / "generation_config.json").read_text())["t_min"] is None  # explicit nulls
    assert SamplingParams.from_generation_config(path) == SamplingParams()


def test_generation_defaults_values(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {
                "max_new_tokens": 64,
                "max_denoising_steps": 8,
                "t_min": 0.1,
                "t_max": 0.9,
                "stability_threshold": 0,
                "confidence_threshold": 0.01,
                "eos_token_id": [1, 106, 50],
                "pad_token_id": 0,
                "max_length": None,
                "sampler_config": {"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": 0.25},
                "return_dict_in_generate": True,
                "transformers_version": "5.23.0",
            }
        )
    )
    want = SamplingParams(
        max_new_tokens=64,
        max_denoising_steps=8,
        t_min=0.1,
        t_max=0.9,
        entropy_bound=0.25,
        stability_threshold=0,
        confidence_threshold=0.01,
    )
    assert SamplingParams.from_generation_config(tmp_path) == want
    assert SamplingParams.from_generation_config(tmp_path / "generation_config.json") == want  # the file itself
    assert generation_eos_token_ids(tmp_path) == (1, 106, 50)


def test_generation_defaults_eos_int_and_null_sampler():
    d = {"eos_token_id": 1, "sampler_config": None, "pad_token_id": None}
    assert generation_eos_token_ids(d) == (1,) and SamplingParams.from_generation_config(d).entropy_bound == 0.1
    g = SamplingParams.from_generation_config(
        {"sampler_config": {"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": None}}
    )
    assert g.entropy_bound == 0.1
    assert generation_eos_token_ids({"eos_token_id": []}) == ()


def test_generation_defaults_read_every_knob_with_a_config_key():
    """Each knob the table maps to generation_config.json is read from there (and only those)."""
    from dgserve.sampling_params import KNOBS

    keys = {name: k.config_key for name, k in KNOBS.items() if k.config_key}
    assert set(keys) == {
        "max_new_tokens",
        "max_denoising_steps",
        "t_min",
        "t_max",
        "entropy_bound",
        "stability_threshold",
        "confidence_threshold",
    }
    assert keys["entropy_bound"] == "sampler_config.entropy_bound"
    d: dict = {"seed": 5, "ignore_eos": True, "stop": ["x"]}  # not knobs of generation_config.json: ignored
    for name, key in keys.items():
        value = getattr(SamplingParams(), name) * 2  # in bounds for every knob (t_min 0.8 < t_max 1.6)
        outer, _, inner = key.rpartition(".")
        (d.setdefault(outer, {}) if outer else d)[inner] = value
    got = SamplingParams.from_generation_config(d)
    assert all(getattr(got, n) == getattr(SamplingParams(), n) * 2 for n in keys)
    assert got.seed is None and got.ignore_eos is False and got.stop == ()


@pytest.mark.parametrize(
    "d,field",
    [
        ({"sampler_config": {"_cls_name": "TopKSamplerConfig", "k": 3}}, "sampler_config._cls_name"),
        (
            {"sampler_config": {"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": 0.0}},
            r"sampler_config\.entropy_bound",
        ),
        ({"sampler_config": "entropy"}, "sampler_config"),
        ({"t_min": 0.9}, "t_max"),
        ({"t_min": -0.1}, "t_min"),
        ({"max_denoising_steps": 0}, "max_denoising_steps"),
        ({"max_denoising_steps": 2000}, "max_denoising_steps"),  # above the request limit: no request could use it
        ({"max_new_tokens": 2.5}, "max_new_tokens"),
        ({"stability_threshold": -1}, "stability_threshold"),
        ({"confidence_threshold": 0}, "confidence_threshold"),
    ],
)
def test_generation_defaults_rejections_name_the_field(d, field):
    with pytest.raises(ConfigError, match=rf"^generation_config\.{field}: "):
        SamplingParams.from_generation_config(d)


@pytest.mark.parametrize("eos", ["x", [1, None], [1, -2], 1.5])
def test_generation_eos_rejections_name_the_field(eos):
    with pytest.raises(ConfigError, match=r"^generation_config\.eos_token_id: "):
        generation_eos_token_ids({"eos_token_id": eos})


def test_generation_defaults_bad_json_names_file(tmp_path):
    (tmp_path / "generation_config.json").write_text("{")
    with pytest.raises(ConfigError, match=r"generation_config\.json"):
        SamplingParams.from_generation_config(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"t_min": "hot"}))
    with pytest.raises(ConfigError, match=r"generation_config\.t_min: .*generation_config\.json"):
        SamplingParams.from_generation_config(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(ConfigError, match=r"generation_config\.eos_token_id: .*generation_config\.json"):
        generation_eos_token_ids(tmp_path)
