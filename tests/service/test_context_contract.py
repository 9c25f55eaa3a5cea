"""A context contract agents can rely on (docs/generation.md, "Limits: what one request can cost"): an output limit
above the room left is clamped to it on every door, its finish said in each API's terms; --max-tokens-policy reject
refuses it (400 naming the field); --max-request-steps ends a request with "length" instead of refusing a large
limit; --default-max-tokens applies on every door to a request without a limit."""

from __future__ import annotations

import grpc
import httpx
import pytest
from service_helpers import base_config, running

from dgserve.v1 import text_generation_pb2 as pb
from dgserve.v1 import text_generation_pb2_grpc as pb_grpc

FAST = {"max_denoising_steps": 1, "seed": 1}  # one step a canvas: a run to the window stays cheap
HI = [{"role": "user", "content": "Say hi"}]


def _window(url: str) -> int:
    return httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["max_model_len"]


def test_messages_max_tokens_32000_is_clamped_not_refused(http, url):
    """Claude Code's max_tokens: 32000 on a 4,096-position window: answered, within the window."""
    body = {"model": "tiny", "max_tokens": 32000, "messages": HI, **FAST}
    r = http.post("/v1/messages", json=body, timeout=300)
    assert r.status_code == 200, r.text
    m = r.json()
    assert m["stop_reason"] in ("max_tokens", "end_turn")
    assert m["usage"]["input_tokens"] + m["usage"]["output_tokens"] <= _window(url)


def test_a_huge_chat_max_tokens_runs_to_the_room_with_length(http, url):
    body = {"model": "tiny", "messages": HI, "max_tokens": 1 << 20, "ignore_eos": True, **FAST}
    r = http.post("/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    out = r.json()
    usage = out["usage"]
    assert out["choices"][0]["finish_reason"] == "length"
    assert 0 < _window(url) - usage["total_tokens"] < 16  # the whole canvases left after the prompt
    responses = {"model": "tiny", "input": "Say hi", "max_output_tokens": 1 << 20, "ignore_eos": True, **FAST}
    r = http.post("/v1/responses", json=responses, timeout=300)
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "incomplete"
    assert r.json()["incomplete_details"]["reason"] == "max_output_tokens"


@pytest.fixture(scope="module")
def strict(model_dir):
    """A server that refuses a limit above the room, bounds a request's steps at 8 and defaults to 16 tokens."""
    config = base_config(model_dir, max_tokens_policy="reject", max_request_steps=8, default_max_tokens=16)
    with running(config) as s, httpx.Client(base_url=s.http_url, timeout=120) as c:
        channel = grpc.insecure_channel(s.target)
        c.stub = pb_grpc.TextGenerationStub(channel)  # type: ignore[attr-defined]
        try:
            yield c
        finally:
            channel.close()


def test_the_reject_policy_is_a_400_naming_the_field(strict):
    for path, body, field in (
        ("/v1/chat/completions", {"messages": HI, "max_tokens": 32000}, "max_tokens"),
        ("/v1/chat/completions", {"messages": HI, "max_completion_tokens": 32000}, "max_completion_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 32000}, "max_tokens"),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 32000}, "max_output_tokens"),
    ):
        r = strict.post(path, json={"model": "tiny", **body, **FAST})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == field and "room left" in error["message"], error
    r = strict.post("/v1/messages", json={"model": "tiny", "max_tokens": 32000, "messages": HI, **FAST})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("max_tokens: 32000"), r.text
    with pytest.raises(grpc.RpcError) as e:
        list(
            strict.stub.Generate(
                pb.GenerateRequest(prompt="hi", params=pb.SamplingParams(max_new_tokens=32000, max_denoising_steps=1))
            )
        )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("params.max_new_tokens: 32000")


def test_the_step_limit_ends_a_request_with_length(strict):
    """10 canvases at 4 steps each is 40 steps, more than 8: admitted, then ended at the limit (at most 8 blocks)."""
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 160, "ignore_eos": True, "max_denoising_steps": 4}
    r = strict.post("/v1/completions", json={**body, "seed": 2})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["completion_tokens"] <= 8 * 16
    r = strict.post("/v1/completions", json={**body, "max_denoising_steps": 9})  # one canvas alone is too much
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_denoising_steps", r.text


def test_the_default_max_tokens_applies_on_every_door(strict):
    knobs = {"ignore_eos": True, "max_denoising_steps": 2, "seed": 1}
    chat = strict.post("/v1/chat/completions", json={"model": "tiny", "messages": HI, **knobs}).json()
    assert chat["usage"]["completion_tokens"] == 16 and chat["choices"][0]["finish_reason"] == "length"
    text = strict.post("/v1/completions", json={"model": "tiny", "prompt": "hi", **knobs}).json()
    assert text["usage"]["completion_tokens"] == 16
    resp = strict.post("/v1/responses", json={"model": "tiny", "input": "hi", **knobs}).json()
    assert resp["usage"]["output_tokens"] == 16 and resp["incomplete_details"]["reason"] == "max_output_tokens"
    msg = strict.post("/v1/messages", json={"model": "tiny", "messages": HI, **knobs}).json()
    assert msg["usage"]["output_tokens"] == 16 and msg["stop_reason"] == "max_tokens", msg
    p = pb.SamplingParams(ignore_eos=True, max_denoising_steps=2, seed=1)
    events = list(strict.stub.Generate(pb.GenerateRequest(prompt="hi", params=p)))
    finished = events[-1].finished
    assert finished.usage.completion_tokens == 16 and finished.finish_reason == pb.FINISH_REASON_LENGTH
