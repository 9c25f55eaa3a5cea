"""The context contract at the engine (docs/generation.md, "Limits: what one request can cost"): an output limit
above the room left is clamped to it (or refused under the "reject" policy, naming the caller's field), a request
without one takes the server's default, and --max-request-steps bounds the steps a request runs (finish "length")
instead of refusing a large limit at admission."""

from __future__ import annotations

import json
import shutil

import pytest

from dgserve import Engine, SamplingParams
from dgserve.engine import request_checks as checks
from dgserve.engine.prompt import Submission
from dgserve.structured.response_format import ResponseFormat

PROMPT = [5, 6, 7]


def _run(eng: Engine, sub: Submission):
    """Step ``sub``'s request to its end; its result."""
    req = eng.add(eng.make_request(sub))
    while not req.finished:
        eng.step()
    return req.result()


def test_a_limit_above_the_room_is_clamped_and_ends_with_length(tiny_checkpoint):
    eng = Engine.from_pretrained(tiny_checkpoint("base"), max_model_len=40)
    C = eng.model.config.canvas_length
    room = (40 - len(PROMPT)) // C * C
    p = SamplingParams(max_new_tokens=32000, max_denoising_steps=3, seed=1, ignore_eos=True, min_tokens=5000)
    res = _run(eng, Submission(PROMPT, p))
    assert res.finish_reason == "length" and len(res.token_ids) == room  # the clamped limit ended it
    assert sum(len(b.token_ids) for b in res.blocks) == room  # usage counts what was returned
    alone = eng.generate(PROMPT, SamplingParams(max_new_tokens=room, max_denoising_steps=3, seed=1, ignore_eos=True))
    assert res.token_ids == alone.token_ids  # the output rules with the clamped value


def test_the_reject_policy_refuses_naming_the_field_and_the_room(tiny_checkpoint):
    eng = Engine.from_pretrained(tiny_checkpoint("base"), max_model_len=40, max_tokens_policy="reject")
    C = eng.model.config.canvas_length
    room = (40 - len(PROMPT)) // C * C
    p = SamplingParams(max_new_tokens=32000, max_denoising_steps=3, seed=1)
    with pytest.raises(ValueError, match=rf"^max_tokens: 32000 tokens .* leave {room} of the 40-position window"):
        eng.make_request(Submission(PROMPT, p, limit_field="max_tokens"))
    ok = SamplingParams(max_new_tokens=room, max_denoising_steps=3, seed=1)
    assert eng.make_request(Submission(PROMPT, ok)).params.max_new_tokens == room
    # a request without a limit is never refused: the default is lowered to the room
    assert eng.make_request(Submission(PROMPT, p, fill_context=True)).params.max_new_tokens == room
    with pytest.raises(ValueError, match="max_tokens_policy"):
        checks.OutputLimits("truncate")


def test_the_step_limit_ends_a_request_with_length(tiny_checkpoint):
    """6 steps at most, 4 per canvas: the second block cannot finish within the limit unless adaptive stopping ends
    it early; either way the request ends with "length", within the limit, with the tokens an unlimited run has."""
    path = tiny_checkpoint("base")
    eng = Engine.from_pretrained(path, max_request_steps=6)
    C = eng.model.config.canvas_length
    p = SamplingParams(max_new_tokens=8 * C, max_denoising_steps=4, seed=3, ignore_eos=True)
    res = _run(eng, Submission(PROMPT, p))  # 8 canvases x 4 steps = 32 > 6: admitted, no longer refused
    assert res.finish_reason == "length" and len(res.token_ids) < 8 * C
    assert sum(b.stats.denoising_steps for b in res.blocks) <= 6
    full = Engine.from_pretrained(path).generate(PROMPT, p)
    assert res.token_ids == full.token_ids[: len(res.token_ids)]
    with pytest.raises(ValueError, match=r"^max_denoising_steps: 7 steps for one canvas .*--max-request-steps"):
        eng.make_request(Submission(PROMPT, SamplingParams(max_denoising_steps=7)))


def test_the_default_limit_of_a_request_without_one(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("base")
    eng = Engine.from_pretrained(path, max_model_len=200)
    C = eng.model.config.canvas_length
    p = SamplingParams(max_new_tokens=32, max_denoising_steps=3, seed=1)
    fmt = SamplingParams(max_new_tokens=32, response_format=ResponseFormat("json_object"))
    room = (200 - len(PROMPT)) // C * C
    limits = eng.admission.limits
    # no flag, no checkpoint default: a grammar-ended output fills the room, any other takes the params' own
    assert checks.output_limit(limits, checks.OutputLimits(), len(PROMPT), fmt, False, "max_tokens") == room
    assert eng.make_request(Submission(PROMPT, p, fill_context=True)).params.max_new_tokens == 32
    # the operator's default, for a request without a limit (grammar or not); a given limit stays its own
    flagged = Engine.from_pretrained(path, max_model_len=200, default_max_tokens=C)
    assert flagged.default_params().max_new_tokens == C
    assert checks.output_limit(limits, flagged.admission.output_limits, 3, fmt, False, "max_tokens") == C
    assert flagged.make_request(Submission(PROMPT, p, fill_context=True)).params.max_new_tokens == C
    assert flagged.make_request(Submission(PROMPT, p)).params.max_new_tokens == 32
    # the checkpoint's generation_config.json: max_new_tokens, else max_length counting the prompt
    ckpt = tmp_path / "ckpt"
    shutil.copytree(path, ckpt)
    (ckpt / "generation_config.json").write_text(json.dumps({"max_length": 3 + 2 * C}))
    by_length = Engine.from_pretrained(ckpt, max_model_len=200)
    assert by_length.make_request(Submission(PROMPT, p, fill_context=True)).params.max_new_tokens == 2 * C
    (ckpt / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3 * C, "max_length": 5}))
    by_tokens = Engine.from_pretrained(ckpt, max_model_len=200)
    assert by_tokens.make_request(Submission(PROMPT, None, fill_context=True)).params.max_new_tokens == 3 * C
    overridden = Engine.from_pretrained(ckpt, max_model_len=200, default_max_tokens=C)  # the flag wins
    assert overridden.make_request(Submission(PROMPT, None, fill_context=True)).params.max_new_tokens == C
