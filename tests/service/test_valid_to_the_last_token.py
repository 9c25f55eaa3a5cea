"""Valid to the last token, on every door (docs/tools.md): a call the token budget cuts is no call (finish reason
length / incomplete, no tool_calls, nothing of it streamed, no piece of its marker in the content); a document or
required call whose budget ends is steered to a complete, valid end; a history call whose arguments are not JSON is
rendered, not refused."""

from __future__ import annotations

import json

import httpx
import jsonschema
from service_helpers import params

from dgserve.v1 import text_generation_pb2 as pb

KNOBS = {"max_denoising_steps": 4}
SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather", "parameters": SCHEMA}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ASK = [{"role": "user", "content": "weather in Paris?"}]
CUT = 16  # tokens: the tiny model spells <|tool_call> in text, so a call is cut inside its forced head
MARKER_PIECES = ("<", "|")


def _chat(client, **kw):
    kw.setdefault("messages", ASK)
    return client.chat.completions.create(model="tiny", seed=1, extra_body=KNOBS, **kw)


def test_chat_a_cut_call_is_no_call(openai_client):
    r = _chat(openai_client, tools=[WEATHER], tool_choice=NAMED, max_tokens=CUT)
    c = r.choices[0]
    assert c.finish_reason == "length" and not c.message.tool_calls
    assert not any(p in (c.message.content or "") for p in MARKER_PIECES)


def test_chat_stream_a_cut_call_sends_nothing_of_it(openai_client):
    stream = _chat(openai_client, tools=[WEATHER], tool_choice=NAMED, max_tokens=CUT, stream=True)
    reasons, content = [], ""
    for chunk in stream:
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        assert not d.tool_calls
        content += d.content or ""
        reasons.append(chunk.choices[0].finish_reason)
    assert reasons[-1] == "length" and not any(p in content for p in MARKER_PIECES)


def test_responses_a_cut_call_is_incomplete_without_a_function_call(openai_client):
    r = openai_client.responses.create(
        model="tiny",
        input="weather in Paris?",
        tools=[{"type": "function", "name": "get_weather", "parameters": SCHEMA}],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=CUT,
        extra_body={"seed": 1, **KNOBS},
    )
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert all(item.type != "function_call" for item in r.output)
    assert not any(p in r.output_text for p in MARKER_PIECES)


def test_grpc_a_cut_call_is_no_call(stub):
    tool = pb.Tool(name="get_weather", parameters_json=json.dumps(SCHEMA))
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="weather?")], tools=[tool])
    chat.tool_choice.function = "get_weather"
    req = pb.GenerateRequest(chat=chat, params=params(max_new_tokens=CUT, seed=1))
    events = list(stub.Generate(req, timeout=120))
    fin = events[-1].finished
    assert fin.finish_reason == pb.FINISH_REASON_LENGTH and not fin.tool_calls
    blocks = [e.block for e in events if e.HasField("block")]
    assert not any(b.tool_calls for b in blocks)
    assert not any(p in "".join(b.text for b in blocks) + fin.text for p in MARKER_PIECES)


def test_a_budget_that_holds_a_call_ends_with_complete_valid_calls(openai_client):
    """required, parallel calls allowed, a free string (the random model writes it until the budget ends when
    nothing steers it): steered to end inside the budget, no call started that cannot finish."""
    schema = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
    note = {"type": "function", "function": {"name": "note", "parameters": schema}}
    for seed in (1, 2):
        r = openai_client.chat.completions.create(
            model="tiny", messages=ASK, seed=seed, tools=[note], tool_choice="required", max_tokens=64, extra_body=KNOBS
        )
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.tool_calls, seed
        for call in c.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schema)


def test_completions_a_document_at_its_budget_ends_complete(url):
    schema = {"type": "object", "properties": {"note": {"type": "string"}}, "required": ["note"]}
    body = {
        "model": "tiny",
        "prompt": "A note:",
        "max_tokens": 24,
        "seed": 3,
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
        **KNOBS,
    }
    r = httpx.post(url + "/v1/completions", json=body, timeout=120).json()
    assert r["choices"][0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(r["choices"][0]["text"]), schema)
    short = httpx.post(url + "/v1/completions", json={**body, "max_tokens": 2}, timeout=120).json()
    assert short["choices"][0]["finish_reason"] == "length"  # no document fits: cut, and said so


def test_a_history_call_with_arguments_that_are_not_json_is_rendered(openai_client):
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city"'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    r = _chat(openai_client, messages=messages, tools=[WEATHER], max_tokens=16)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
