"""The Messages API door with the official anthropic client: create, the raw stream and the SDK's stream helper,
tools and a tool_result round trip, count_tokens equal to create's input tokens, stop sequences, thinking, the
pings, errors in Anthropic's shape as the SDK's exception classes (400, 401, 404, 413, 529), x-api-key and bearer
auth, bad input named in a 400, and the drain ending a stream with max_tokens."""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import pytest
from service_helpers import auth_config, base_config, running

KNOBS = {"max_denoising_steps": 4}
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
HI = [{"role": "user", "content": "Say hi"}]


def _create(anthropic_client, **kw):
    kw.setdefault("messages", HI)
    kw.setdefault("max_tokens", 32)
    extra = {"seed": 1, **KNOBS, **kw.pop("extra_body", {})}
    return anthropic_client.messages.create(model="tiny", extra_body=extra, **kw)


def _text(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_a_message_has_text_blocks_a_stop_reason_and_usage(anthropic_client):
    m = _create(anthropic_client, system="Be brief.")
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == "tiny"
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    assert all(b.type == "text" and b.text for b in m.content)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens > 0 and 0 < m.usage.output_tokens <= 32
    same = _create(anthropic_client, system="Be brief.")  # seeded: the same output
    assert _text(same) == _text(m) and same.id != m.id


def test_the_token_limit_is_stop_reason_max_tokens(anthropic_client):
    m = _create(anthropic_client, max_tokens=16, extra_body={"ignore_eos": True})
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 16


def test_a_stop_sequence_ends_the_message_and_is_named(anthropic_client):
    whole = _text(_create(anthropic_client, max_tokens=64, extra_body={"ignore_eos": True}))
    stop = next(whole[i : i + 3] for i in range(4, len(whole) - 3) if whole[i : i + 3].strip())
    m = _create(anthropic_client, max_tokens=64, stop_sequences=["\x00never", stop], extra_body={"ignore_eos": True})
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert _text(m) == whole[: whole.index(stop)]


def test_the_raw_stream_is_anthropics_event_sequence_and_ends_with_the_same_message(anthropic_client):
    whole = _create(anthropic_client, max_tokens=48)
    got = list(_create(anthropic_client, max_tokens=48, stream=True))
    kinds = [e.type for e in got]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert got[0].message.id.startswith("msg_") and got[0].message.content == []
    assert got[0].message.usage.input_tokens > 0
    assert kinds[1] == "content_block_start" and kinds[-3] == "content_block_stop"
    assert set(kinds[2:-3]) <= {"content_block_delta"}
    text = "".join(e.delta.text for e in got if e.type == "content_block_delta")
    assert text == _text(whole)
    delta = got[-2]
    assert delta.delta.stop_reason == whole.stop_reason and delta.usage.output_tokens == whole.usage.output_tokens


def test_the_sdks_stream_helper_builds_the_same_message(anthropic_client):
    whole = _create(anthropic_client, max_tokens=48)
    extra = {"seed": 1, **KNOBS}
    with anthropic_client.messages.stream(model="tiny", max_tokens=48, messages=HI, extra_body=extra) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == _text(final) == _text(whole)
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_pings_open_the_stream_and_keep_it_alive(url, monkeypatch):
    from dgserve.service.http.messages import output as messages_api

    monkeypatch.setattr(messages_api, "PING_INTERVAL_S", 0.005)
    body = {"model": "tiny", "messages": HI, "max_tokens": 32, "stream": True, "seed": 1, **KNOBS}
    with httpx.Client(timeout=60) as c, c.stream("POST", url + "/v1/messages", json=body) as r:
        names = [line[7:] for line in r.iter_lines() if line.startswith("event: ")]
    assert names[:2] == ["message_start", "ping"] and names[-1] == "message_stop"
    assert names.count("ping") >= 2  # and more while the blocks are denoised


# ---------------------------------------------------------------------------------------------- tools


def test_a_tool_use_and_its_tool_result_round_trip(anthropic_client):
    asked = [{"role": "user", "content": "weather in Paris?"}]
    m = _create(anthropic_client, messages=asked, tools=[WEATHER], tool_choice={"type": "any"}, max_tokens=64)
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and uses
    use = uses[0]
    assert use.id.startswith("toolu_") and use.name == "get_weather" and use.input["city"] in ("Paris", "Rome")
    results = [{"type": "tool_result", "tool_use_id": u.id, "content": "sunny, 21 C"} for u in uses]
    turn = [*asked, {"role": "assistant", "content": [b.model_dump() for b in m.content]}]
    turn.append({"role": "user", "content": results})
    after = _create(anthropic_client, messages=turn, tools=[WEATHER], max_tokens=32)
    assert after.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert _prompt_tokens(after) > _prompt_tokens(m)
    failed = [{**r, "is_error": True, "content": [{"type": "text", "text": "no network"}]} for r in results]
    turn[-1] = {"role": "user", "content": [*failed, {"type": "text", "text": "try again"}]}
    assert _create(anthropic_client, messages=turn, tools=[WEATHER], max_tokens=16).usage.output_tokens > 0


def _prompt_tokens(m) -> int:
    return m.usage.input_tokens + m.usage.cache_read_input_tokens


def test_a_named_tool_streams_input_json_deltas(anthropic_client):
    kw = {"messages": [{"role": "user", "content": "weather?"}], "tools": [WEATHER], "max_tokens": 64}
    choice = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
    whole = _create(anthropic_client, tool_choice=choice, **kw)
    got = list(_create(anthropic_client, tool_choice=choice, stream=True, **kw))
    start = next(e for e in got if e.type == "content_block_start" and e.content_block.type == "tool_use")
    args = "".join(e.delta.partial_json for e in got if e.type == "content_block_delta")
    (use,) = [b for b in whole.content if b.type == "tool_use"]
    assert start.content_block.id == use.id and start.content_block.input == {}
    assert json.loads(args) == use.input and got[-2].delta.stop_reason == "tool_use"
    extra = {"seed": 1, **KNOBS}
    with anthropic_client.messages.stream(model="tiny", tool_choice=choice, extra_body=extra, **kw) as s:
        final = s.get_final_message()
    assert [b.input for b in final.content if b.type == "tool_use"] == [use.input]


def test_count_tokens_equals_the_input_tokens_create_reports(anthropic_client):
    kw = {
        "system": [{"type": "text", "text": "You answer weather questions."}],
        "messages": [{"role": "user", "content": "weather in Rome?"}],
        "tools": [WEATHER],
    }
    counted = anthropic_client.messages.count_tokens(model="tiny", **kw).input_tokens
    salt = {"cache_salt": "count-tokens-test"}  # a salt nothing else used: the prompt is not in the prefix cache
    m = _create(anthropic_client, max_tokens=16, extra_body=salt, **kw)
    assert counted == m.usage.input_tokens and m.usage.cache_read_input_tokens == 0
    again = _create(anthropic_client, max_tokens=16, extra_body=salt, **kw)
    assert counted == again.usage.input_tokens + again.usage.cache_read_input_tokens
    plain = anthropic_client.messages.count_tokens(model="tiny", messages=kw["messages"]).input_tokens
    assert plain < counted  # the system prompt and the tool declarations count
    thinking = {"type": "enabled", "budget_tokens": 1024}
    with_thinking = anthropic_client.messages.count_tokens(model="tiny", messages=kw["messages"], thinking=thinking)
    assert with_thinking.input_tokens > plain


def test_thinking_gives_thinking_blocks_or_none(anthropic_client):
    m = _create(anthropic_client, thinking={"type": "enabled", "budget_tokens": 1024}, max_tokens=32)
    assert all(b.type in ("thinking", "text") for b in m.content)
    assert all(b.signature == "" for b in m.content if b.type == "thinking")
    said = [{"type": "thinking", "thinking": "greet", "signature": ""}, {"type": "text", "text": "hi"}]
    history = [*HI, {"role": "assistant", "content": said}, {"role": "user", "content": "again"}]
    assert _create(anthropic_client, messages=history, max_tokens=8).usage.output_tokens > 0


def test_output_config_format_gives_a_valid_document(anthropic_client):
    fmt = {"format": {"type": "json_schema", "schema": {"enum": ["yes", "no"]}}}
    m = _create(anthropic_client, max_tokens=64, extra_body={"output_config": fmt})
    assert m.stop_reason == "end_turn" and json.loads(_text(m)) in ("yes", "no")


def test_a_claude_code_shaped_request_is_accepted(url):
    """The fields Claude Code sends (docs/messages-api.md, "Claude Code"), on its beta URL."""
    body = {
        "model": "tiny",
        "max_tokens": 16,
        "system": [{"type": "text", "text": "You are an agent."}, {"type": "text", "text": "Be brief."}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Say hi", "cache_control": {"type": "ephemeral"}}]},
            {"role": "system", "content": [{"type": "text", "text": "# Environment"}]},
        ],
        "tools": [{**WEATHER, "cache_control": {"type": "ephemeral"}}],
        "thinking": {"type": "adaptive", "display": "omitted"},
        "output_config": {"effort": "high"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "metadata": {"user_id": json.dumps({"device_id": "d" * 64, "session_id": "s"})},
        "seed": 1,
        **KNOBS,
    }
    headers = {"anthropic-version": "2023-06-01", "anthropic-beta": "claude-code-20250219", "x-api-key": "k"}
    r = httpx.post(url + "/v1/messages?beta=true", json=body, headers=headers, timeout=60)
    assert r.status_code == 200 and r.json()["type"] == "message", r.text
    body["context_management"] = {"edits": [{"type": "clear_tool_uses_20250919"}]}
    r = httpx.post(url + "/v1/messages", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("context_management.edits[0]")


# ---------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages[0].content[0].source.type",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "messages[0].content[0].type"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x"}]}]},
            "messages[0].content[0].tool_use_id",
        ),
        ({"messages": [{"role": "system", "content": "hi"}]}, "messages[0].role"),
        ({"messages": [*HI, {"role": "assistant", "content": "Hel"}]}, "messages[1].role"),
        ({"messages": HI, "max_tokens": 0}, "max_tokens"),  # absent: the server's default (test_context_contract)
        ({"messages": HI, "max_tokens": 0}, "max_tokens"),
        ({"messages": HI, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
        ({"messages": HI, "tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
        ({"messages": HI, "tools": [{"name": "f"}]}, "tools[0].input_schema"),
        ({"messages": HI, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
        ({"messages": HI, "tools": [{"name": "f g", "input_schema": {}}]}, "tools[0].name"),
        ({"messages": HI, "top_k": 5}, "top_k"),
        ({"messages": HI, "thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
        ({"messages": HI, "stop_sequences": "x"}, "stop_sequences"),
        ({"messages": HI, "metadata": {"user_id": 7}}, "metadata.user_id"),
        ({"messages": HI, "system": [{"type": "image"}]}, "system[0]"),
        ({"messages": []}, "messages"),
        ({"messages": HI, "tools": [WEATHER], "stop_sequences": ["."]}, "stop_sequences"),
        (
            {
                "messages": [
                    *HI,
                    {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": 1}]},
                    HI[0],
                ]
            },
            "messages[1].content[0].input",
        ),
        (
            {
                "messages": [
                    *HI,
                    {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]},
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "first"},
                            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "1"},
                        ],
                    },
                ]
            },
            "messages[2].content[1]",
        ),
        (
            {
                "messages": [
                    *HI,
                    {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]},
                    {"role": "user", "content": "no result"},
                    {"role": "assistant", "content": "ok"},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "1"}]},
                ]
            },
            "messages[4].content[0].tool_use_id",
        ),
    ],
)
def test_bad_input_is_a_400_in_anthropics_shape_naming_the_field(url, body, field):
    body = {"model": "tiny", "max_tokens": 8, **body}
    r = httpx.post(url + "/v1/messages", json={k: v for k, v in body.items() if v is not None}, timeout=30)
    assert r.status_code == 400, r.text
    got = r.json()
    assert got["type"] == "error" and got["error"]["type"] == "invalid_request_error"
    assert got["error"]["message"].startswith(field), got
    assert "Traceback" not in r.text


@pytest.mark.parametrize("raw", [b"{not json", b"[" * 200 + b"]" * 200, json.dumps({"messages": HI}).encode()[:-1]])
def test_a_body_that_is_not_a_bounded_json_object_is_a_400_in_anthropics_shape(url, raw):
    r = httpx.post(url + "/v1/messages", content=raw, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert r.json()["error"]["message"].startswith("body"), r.text


def test_the_sdk_sees_its_exception_classes(anthropic_client, url):
    with pytest.raises(anthropic.BadRequestError) as bad:
        anthropic_client.messages.create(model="tiny", max_tokens=8, messages=[{"role": "robot", "content": "x"}])
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError) as missing:
        anthropic_client.messages.create(model="gpt-5", max_tokens=8, messages=HI)
    assert missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.NotFoundError):
        anthropic_client.messages.count_tokens(model="gpt-5", messages=HI)
    wrong = httpx.get(url + "/v1/messages", timeout=30)  # a route error, in the same shape
    assert wrong.status_code == 405 and wrong.json()["type"] == "error"


def test_error_types_follow_anthropics_statuses():
    from dgserve.engine.scheduler import QueueFullError
    from dgserve.service.errors import DrainingError
    from dgserve.service.http.errors import HttpError, anthropic_error_body

    cases = [
        (QueueFullError("queue is full", retry_after_s=2.0), 529, "overloaded_error"),
        (DrainingError("draining"), 503, "overloaded_error"),
        (HttpError("REQUEST_TOO_LARGE", "body: too large"), 413, "request_too_large"),
        (HttpError("UNAUTHENTICATED", "no token"), 401, "authentication_error"),
        (RuntimeError("secret details"), 500, "api_error"),
    ]
    for exc, status, kind in cases:
        got_status, body, headers = anthropic_error_body(exc)
        assert (got_status, body["type"], body["error"]["type"]) == (status, "error", kind)
        assert "secret" not in body["error"]["message"]
        if status == 529:
            assert headers["Retry-After"] == "2"


@pytest.fixture(scope="module")
def auth_url(model_dir, tmp_path_factory):
    config = auth_config(model_dir, tmp_path_factory.mktemp("auth"), ("token-a",), max_message_bytes=64 << 10)
    with running(config) as s:
        yield s.http_url


def test_auth_takes_x_api_key_or_a_bearer_token(auth_url):
    with anthropic.Anthropic(base_url=auth_url, api_key="token-a", max_retries=0, timeout=120) as by_key:
        assert by_key.messages.count_tokens(model="tiny", messages=HI).input_tokens > 0
        assert by_key.messages.create(model="tiny", max_tokens=8, messages=HI, extra_body=KNOBS).content is not None
        with pytest.raises(anthropic.ContentTooLargeError) as big:  # 413, in Anthropic's shape
            by_key.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": "x" * (70 << 10)}])
        assert big.value.body["error"]["type"] == "request_too_large"
    with anthropic.Anthropic(base_url=auth_url, auth_token="token-a", max_retries=0, timeout=120) as by_bearer:
        assert by_bearer.messages.count_tokens(model="tiny", messages=HI).input_tokens > 0
    with anthropic.Anthropic(base_url=auth_url, api_key="token-b", max_retries=0, timeout=120) as wrong:
        with pytest.raises(anthropic.AuthenticationError) as denied:
            wrong.messages.create(model="tiny", max_tokens=8, messages=HI)
        assert denied.value.body["error"]["type"] == "authentication_error"
    r = httpx.get(auth_url + "/v1/models", headers={"x-api-key": "token-a"}, timeout=30)
    assert r.status_code == 200  # the same token, on every route
    assert httpx.get(auth_url + "/v1/models", headers={"x-api-key": "token-b"}, timeout=30).status_code == 401


def test_the_drain_ends_a_stream_with_max_tokens(model_dir):
    body = {"model": "tiny", "messages": HI, "stream": True, "max_tokens": 16 * 200, "ignore_eos": True, **KNOBS}
    with running(base_config(model_dir)) as s:
        with httpx.Client(timeout=60) as c, c.stream("POST", s.http_url + "/v1/messages", json=body) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            drained = asyncio.run_coroutine_threadsafe(s.server.drain(0.5), s.loop)
            rest = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
        assert [e["type"] for e in rest[-2:]] == ["message_delta", "message_stop"]
        assert rest[-2]["delta"]["stop_reason"] == "max_tokens"
        drained.result(30)


# ---------------------------------------------------------------------------------------------- units


def test_thinking_text_and_calls_become_blocks_in_order_with_their_events():
    """A thinking output with text and a call, in two blocks split inside the call: thinking, text and tool_use
    blocks, each started, written and stopped by its events, the input whole at the end."""
    from dgserve.outputs import FINISH_EOS
    from dgserve.service import events
    from dgserve.service.http.messages.output import MessageOutput
    from dgserve.structured.chat_output import ChatOutputParser
    from dgserve.text.gemma4 import CHANNEL_BEGIN, CHANNEL_END, TOOL_CALL_BEGIN, TOOL_CALL_END

    text = (
        f'{CHANNEL_BEGIN}thought\nplan{CHANNEL_END}Hi{TOOL_CALL_BEGIN}call:get_weather{{"city":"Paris"}}{TOOL_CALL_END}'
    )
    cut = text.index("Paris")
    out, chat = MessageOutput("tiny", "r-1", 1, 3), events.ChatOutput(ChatOutputParser(True, True, b"k"))
    stats = events.BlockReport(1, 1.0, 0.0, 0.0, 0.0)
    got = []
    for i, piece in enumerate((text[:cut], text[cut:])):
        got += out.add(chat.block(events.BlockEvent(i, [], piece, stats)))
    end = events.FinishEvent(FINISH_EOS, events.Usage(3, 9, 2, 8, 1), events.Timing(0.0, 1.0, 2.0))
    got += out.add(chat.finish(end))
    assert [(name, data["index"], data.get("delta", {}).get("type")) for name, data in got] == [
        ("content_block_start", 0, None),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, None),
        ("content_block_delta", 1, "text_delta"),
        ("content_block_stop", 1, None),
        ("content_block_start", 2, None),
        ("content_block_delta", 2, "input_json_delta"),  # a call is sent only whole (docs/tools.md)
        ("content_block_stop", 2, None),
    ]
    body = out.body()
    assert body["stop_reason"] == "tool_use" and body["stop_sequence"] is None
    assert body["usage"] == {
        "input_tokens": 2,
        "output_tokens": 9,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 1,
    }
    thinking, said, use = body["content"]
    assert thinking == {"type": "thinking", "thinking": "plan", "signature": ""}
    assert said == {"type": "text", "text": "Hi"}
    assert use["type"] == "tool_use" and use["id"].startswith("toolu_") and use["input"] == {"city": "Paris"}


def test_a_conversation_becomes_chat_messages():
    """system blocks join in one system message; tool_result blocks become tool messages before the user's text;
    thinking is the assistant message's reasoning_content and tool_use its tool_calls; is_error marks the
    result."""
    from dgserve.service.http.messages.conversation import Conversation

    convo = Conversation()
    convo.add_system(
        [{"type": "text", "text": "A", "cache_control": {"type": "ephemeral"}}, {"type": "text", "text": "B"}]
    )
    convo.add_messages(
        [
            {"role": "user", "content": "go"},
            {"role": "system", "content": [{"type": "text", "text": "C"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "t", "signature": "sig"},
                    {"type": "text", "text": "calling"},
                    {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": 1}},
                    {"type": "tool_use", "id": "toolu_2", "name": "f", "input": {}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "1"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_2",
                        "content": [{"type": "text", "text": "x"}],
                        "is_error": True,
                    },
                    {"type": "text", "text": "and?"},
                ],
            },
        ],
        None,
    )
    m = convo.messages
    assert [x["role"] for x in m] == ["system", "user", "assistant", "tool", "tool", "user"]
    assert m[0]["content"] == "A\n\nB\n\nC"  # a system message among the messages joins the system prompt
    assert m[2]["content"] == "calling" and m[2]["reasoning_content"] == "t"
    assert [c["function"]["arguments"] for c in m[2]["tool_calls"]] == ['{"a":1}', "{}"]
    assert m[3] == {"role": "tool", "tool_call_id": "toolu_1", "content": "1"}
    assert m[4]["content"] == "Error: x" and m[5]["content"] == [{"type": "text", "text": "and?"}]
