"""What Claude Code sends by default is accepted (docs/messages-api.md, "Claude Code"), field by field, on a recorded
request of Claude Code 2.1.332 (tests/data); and a prompt that does not fit is refused in each API's recognisable
shape: Anthropic's ``prompt is too long: N tokens > M maximum``, OpenAI's code ``context_length_exceeded``, gRPC
INVALID_ARGUMENT with ErrorInfo reason CONTEXT_LENGTH_EXCEEDED and the numbers in its metadata."""

from __future__ import annotations

import copy
import json
import pathlib
import re

import anthropic
import grpc
import openai
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from dgserve.v1 import text_generation_pb2 as pb

RECORDED = pathlib.Path(__file__).parent.parent / "data" / "claude_code_2.1.332_default_request.json"
COUNTED = ("model", "messages", "system", "tools", "tool_choice", "thinking")
TOO_LONG = re.compile(r"prompt is too long: (\d+) tokens > (\d+) maximum")
LONG_TEXT = "hello world " * 6000  # more tokens than the tiny model's window


def _recorded() -> dict:
    """The recorded body, its tools cut to two and the deferred one (the whole fits no tiny model's window)."""
    body = copy.deepcopy(json.loads(RECORDED.read_text())["body"])
    body["model"] = "tiny"
    body["tools"] = body["tools"][2:4] + [t for t in body["tools"] if t.get("defer_loading")]
    return body


def _count(http, body: dict, path: str = "/v1/messages/count_tokens?beta=true"):
    return http.post(path, json={k: body[k] for k in COUNTED if k in body})


def test_the_recorded_default_request_is_answered(http):
    """Claude Code's first request as it sends it, on its URL (its max_tokens lowered to keep the test cheap)."""
    body = {**_recorded(), "max_tokens": 16, "stream": False, "seed": 1, "max_denoising_steps": 2}
    headers = {"anthropic-version": "2023-06-01", "anthropic-beta": "claude-code-20250219", "x-api-key": "k"}
    r = http.post("/v1/messages?beta=true", json=body, headers=headers, timeout=300)
    assert r.status_code == 200 and r.json()["type"] == "message", r.text


def test_a_deferred_tool_is_declared_up_front_like_any_other(http):
    body = _recorded()
    deferred = [i for i, t in enumerate(body["tools"]) if t.get("defer_loading")]
    assert deferred, "the recorded request has a tool with defer_loading"
    with_flag = _count(http, body)
    assert with_flag.status_code == 200, with_flag.text
    for i in deferred:
        del body["tools"][i]["defer_loading"]
    assert _count(http, body).json() == with_flag.json()  # the same prompt: the tool is declared either way
    body["tools"][deferred[0]]["defer_loading"] = "yes"
    r = _count(http, body)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(f"tools[{deferred[0]}].defer_loading")


@pytest.mark.parametrize("display", ["summarized", "omitted", "updates"])
def test_every_thinking_display_is_accepted(http, display):
    body = _recorded()
    body["thinking"] = {"type": "adaptive", "display": display}
    r = _count(http, body)
    assert r.status_code == 200, r.text
    body["thinking"] = {"type": "enabled", "budget_tokens": 1024, "display": display}
    assert _count(http, body).status_code == 200


def test_an_unknown_thinking_display_is_named(http):
    body = {**_recorded(), "thinking": {"type": "adaptive", "display": "loud"}}
    r = _count(http, body)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("thinking.display")


def test_the_beta_query_is_accepted_on_both_routes(http):
    body = _recorded()
    assert _count(http, body, "/v1/messages/count_tokens").json() == _count(http, body).json()


def test_the_preconnect_probe_is_answered(http):
    r = http.head("/api/hello")
    assert r.status_code == 200 and r.content == b""


# ---------------------------------------------------------------------------------------------- overflow


def test_messages_overflow_is_anthropics_prompt_is_too_long(anthropic_client):
    with pytest.raises(anthropic.BadRequestError) as e:
        anthropic_client.messages.create(model="tiny", max_tokens=16, messages=[{"role": "user", "content": LONG_TEXT}])
    body = e.value.body
    assert isinstance(body, dict) and body["error"]["type"] == "invalid_request_error"
    found = TOO_LONG.search(body["error"]["message"])
    assert found and body["error"]["message"].startswith("prompt is too long: "), body
    n, m = int(found.group(1)), int(found.group(2))
    assert n > m > 0  # Claude Code compacts by the gap


def test_messages_overflow_of_a_counted_prompt_is_exact(http, url):
    """A prompt just over the window is counted whole: N is its length (count_tokens says the same)."""
    window = http.get("/v1/models").json()["data"][0]["max_model_len"]
    text = "hello world " * (window // 2)
    counted = http.post("/v1/messages/count_tokens", json={"messages": [{"role": "user", "content": text}]}).json()
    r = http.post("/v1/messages", json={"max_tokens": 16, "messages": [{"role": "user", "content": text}]})
    assert r.status_code == 400, r.text
    found = TOO_LONG.match(r.json()["error"]["message"])
    assert found, r.text
    if "at least" not in r.json()["error"]["message"]:
        assert int(found.group(1)) == counted["input_tokens"]
    assert int(found.group(2)) < window


def test_openai_doors_overflow_is_context_length_exceeded(openai_client):
    calls = [
        lambda: openai_client.chat.completions.create(
            model="tiny", max_tokens=16, messages=[{"role": "user", "content": LONG_TEXT}]
        ),
        lambda: openai_client.completions.create(model="tiny", max_tokens=16, prompt=LONG_TEXT),
        lambda: openai_client.responses.create(model="tiny", max_output_tokens=16, input=LONG_TEXT),
    ]
    for call in calls:
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.code == "context_length_exceeded", e.value.body
        assert re.search(r"\d+ tokens.*\d+", e.value.message), e.value.message


def test_grpc_overflow_carries_the_reason_and_the_numbers(stub):
    with pytest.raises(grpc.RpcError) as e:
        list(
            stub.Generate(pb.GenerateRequest(prompt=LONG_TEXT, params=pb.SamplingParams(max_new_tokens=16)), timeout=60)
        )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    status = rpc_status.from_call(e.value)
    assert status is not None
    infos = []
    for d in status.details:
        if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            d.Unpack(info)
            infos.append(info)
    assert infos and infos[0].reason == "CONTEXT_LENGTH_EXCEEDED"
    meta = infos[0].metadata
    assert int(meta["prompt_tokens"]) > int(meta["max_prompt_tokens"]) > 0
    assert meta["at_least"] in ("true", "false")
