"""Agents over the OpenAI door, with the official client: tools / tool_choice / parallel_tool_calls, tool turns in
the conversation, tool calls in the message and streamed as OpenAI's delta.tool_calls chunks, finish_reason
"tool_calls"; reasoning_effort / enable_thinking; the developer role; bad tools named in a 400."""

from __future__ import annotations

import json

import httpx
import pytest

KNOBS = {"max_denoising_steps": 4}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "weather in Paris?"}]


def _call(openai_client, **kw):
    messages, extra = kw.pop("messages", ASK), kw.pop("extra_body", KNOBS)
    return openai_client.chat.completions.create(model="tiny", messages=messages, seed=1, extra_body=extra, **kw)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_required_and_named_calls_are_valid_tool_calls(openai_client, choice):
    r = _call(openai_client, tools=[WEATHER], tool_choice=choice, parallel_tool_calls=False, max_tokens=64)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    assert c.message.content is None and len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")


def test_streamed_calls_arrive_as_tool_call_deltas(openai_client):
    whole = _call(openai_client, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, max_tokens=64)
    stream = _call(
        openai_client, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, max_tokens=64, stream=True
    )
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in stream:
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        assert not d.content or "<|tool_call>" not in d.content  # no marker leaks into content
        for tc in d.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            slot["id"] = tc.id or slot["id"]
            slot["name"] = (tc.function.name if tc.function else None) or slot["name"]
            slot["arguments"] += (tc.function.arguments or "") if tc.function else ""
        reasons.append(chunk.choices[0].finish_reason)
    want = whole.choices[0].message.tool_calls[0]
    assert calls == {0: {"id": want.id, "name": "get_weather", "arguments": want.function.arguments}}
    assert reasons[-1] == "tool_calls"


def test_auto_may_write_text_and_a_conversation_with_tool_turns_renders(openai_client):
    first = _call(openai_client, tools=[WEATHER], tool_choice="required", max_tokens=64).choices[0].message
    call = first.tool_calls[0]
    turns = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 18}'},
    ]
    r = _call(openai_client, messages=turns, tools=[WEATHER], tool_choice="auto", max_tokens=32)
    c = r.choices[0]
    assert c.finish_reason in ("stop", "length", "tool_calls")
    for tc in c.message.tool_calls or []:  # any call the model chose to make is valid
        assert json.loads(tc.function.arguments)["city"] in ("Paris", "Rome")


def test_developer_role_is_the_system_role(openai_client):
    dev = _call(openai_client, messages=[{"role": "developer", "content": "be brief"}, *ASK], max_tokens=16)
    sys_ = _call(openai_client, messages=[{"role": "system", "content": "be brief"}, *ASK], max_tokens=16)
    assert dev.choices[0].message.content == sys_.choices[0].message.content
    assert dev.usage.prompt_tokens == sys_.usage.prompt_tokens


def test_reasoning_effort_enables_thinking(openai_client, url):
    on = _call(openai_client, reasoning_effort="low", max_tokens=16)
    kw = _call(openai_client, max_tokens=16, extra_body={**KNOBS, "chat_template_kwargs": {"enable_thinking": True}})
    assert on.usage.prompt_tokens == kw.usage.prompt_tokens  # the same prompt: thinking on
    off = _call(openai_client, max_tokens=16)
    assert off.usage.prompt_tokens != on.usage.prompt_tokens
    r = httpx.post(
        url + "/v1/chat/completions",
        json={"messages": ASK, "max_tokens": 8, "reasoning_effort": "extreme"},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {
                "tools": [WEATHER],
                "messages": [*ASK, {"role": "tool", "tool_call_id": "call_x", "content": "18"}],
            },
            "messages[1].tool_call_id",
        ),
        ({"functions": [{"name": "f"}]}, "functions"),
    ],
)
def test_bad_tools_are_400_naming_the_field(url, extra, param):
    body = {"messages": ASK, "max_tokens": 8, **extra}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param), r.text


def test_reasoning_content_is_split_from_content_in_both_shapes():
    """The door's encoding of a thinking output: message.reasoning_content apart from content, and the same split
    in the streamed deltas, whatever the block boundaries."""
    from dgserve.service import events
    from dgserve.service.http.openai import output as responses
    from dgserve.structured.chat_output import ChatOutputParser

    text = "<|channel>thought\nthe user wants Paris<channel|>It is sunny."
    stats = events.BlockReport(1, 1.0, 0.0, 0.0, 0.0)
    end = events.FinishEvent("eos", events.Usage(1, 1, 1, 1), events.Timing(0.0, 0.0, 0.0))
    for cut in range(len(text) + 1):
        chat, transcript = events.ChatOutput(ChatOutputParser(tools=False, thinking=True)), events.Transcript()
        read = [chat.block(events.BlockEvent(i, [], piece, stats)) for i, piece in enumerate((text[:cut], text[cut:]))]
        read.append(chat.finish(end))
        for e in read:
            transcript.add(e)
        deltas = [responses.chat_delta(e) for e in read]
        assert "".join(d.get("reasoning_content", "") for d in deltas).strip() == "the user wants Paris"
        assert "".join(d.get("content", "") for d in deltas) == "It is sunny."
        m = responses.message(transcript)
        assert m["content"] == "It is sunny." and m["reasoning_content"].strip() == "the user wants Paris"
