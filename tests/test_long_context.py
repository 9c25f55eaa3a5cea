"""A context window past the model's max_position_embeddings only behind ``DGSERVE_ALLOW_LONG_MAX_MODEL_LEN=1``
(docs/generation.md, "Limits: what one request can cost"), and the shipped model's own window (its card,
python/dgserve/models/small/README.md, "Long context")."""

from __future__ import annotations

import json
import logging

import pytest

from dgserve import Engine, SamplingParams
from dgserve.config import ModelConfig
from dgserve.engine.request_checks import ALLOW_LONG_MAX_MODEL_LEN, check_max_model_len
from dgserve.model.default_model import SHIPPED

LIMIT = 4096  # the tiny test models' max_position_embeddings (tests/tiny_models.py)


def test_window_past_the_model_is_refused_with_how_to_opt_in(tiny_checkpoint):
    with pytest.raises(ValueError) as e:
        Engine.from_pretrained(tiny_checkpoint("base"), max_model_len=LIMIT + 16)
    msg = str(e.value)
    assert f"max_model_len {LIMIT + 16} exceeds the model's max_position_embeddings {LIMIT}" in msg
    assert f"{ALLOW_LONG_MAX_MODEL_LEN}=1" in msg and "\n" not in msg
    with pytest.raises(ValueError, match=ALLOW_LONG_MAX_MODEL_LEN):
        check_max_model_len(LIMIT + 1, LIMIT)


@pytest.mark.parametrize("value", ["0", "", "no"])
def test_the_server_opts_in_only_on_a_true_value(tiny_checkpoint, value):
    from service.__main__ import build_config
    from service.server import load_engine

    argv = ["--model", str(tiny_checkpoint("base")), "--max-model-len", str(LIMIT + 16)]
    cfg, _ = build_config(argv, {ALLOW_LONG_MAX_MODEL_LEN: value})
    assert not cfg.allow_long_max_model_len
    with pytest.raises(ValueError, match=f"{ALLOW_LONG_MAX_MODEL_LEN}=1"):
        load_engine(cfg)


def test_opted_in_window_past_the_model_is_served_with_a_warning(tiny_checkpoint, caplog):
    """Through the server's configuration: the environment variable (or the flag) reaches the engine."""
    from service.__main__ import build_config
    from service.server import load_engine

    argv = ["--model", str(tiny_checkpoint("base")), "--max-model-len", str(LIMIT + 64)]
    cfg, _ = build_config(argv, {ALLOW_LONG_MAX_MODEL_LEN: "1"})
    assert cfg.allow_long_max_model_len and build_config([*argv, "--allow-long-max-model-len"], {})[0] == cfg
    with caplog.at_level(logging.WARNING, logger="dgserve.engine.request_checks"):
        eng = load_engine(cfg)
    assert eng.max_model_len == LIMIT + 64
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(f"max_model_len {LIMIT + 64} exceeds the model's max_position_embeddings {LIMIT}" in m for m in warned)
    # a prompt past the model's positions is served: its tokens reach positions beyond max_position_embeddings
    prompt = [5 + i % 50 for i in range(LIMIT + 8)]
    out = eng.generate(prompt, SamplingParams(max_new_tokens=16, max_denoising_steps=2, seed=0, ignore_eos=True))
    assert len(out.token_ids) == 16


def test_within_the_model_no_opt_in_is_needed(caplog):
    with caplog.at_level(logging.WARNING, logger="dgserve.engine.request_checks"):
        assert check_max_model_len(LIMIT, LIMIT) == LIMIT and check_max_model_len(None, LIMIT) == LIMIT
    assert not caplog.records
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError, match=r"max_model_len must be an integer in \[1, 4096\]"):
            check_max_model_len(bad, LIMIT, allow_long=True)


def test_the_shipped_model_serves_65536_positions():
    """The card's "Long context" section is why: the loss at 32K-64K was measured against the loss below 2K."""
    cfg = ModelConfig.from_pretrained(SHIPPED)
    assert cfg.max_position_embeddings >= 65_536
    tok = json.loads((SHIPPED / "tokenizer_config.json").read_text())
    assert tok.get("model_max_length", cfg.max_position_embeddings) == cfg.max_position_embeddings
    assert "## Long context" in (SHIPPED / "README.md").read_text()
