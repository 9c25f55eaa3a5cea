"""The Responses API door with the official openai client: plain, streamed (OpenAI's event sequence with sequence
numbers), function tools and a function_call_output round trip, previous_response_id, text.format, the store (GET,
DELETE, per caller, bounded), bad input named in a 400, and the drain ending a stream with response.incomplete."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from service_helpers import auth_config, base_config, running

from dgserve.service.http.responses.store import ResponseStore

KNOBS = {"max_denoising_steps": 4}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def _create(openai_client, **kw):
    kw.setdefault("input", "Say hi")
    extra = {"seed": 1, **KNOBS, **kw.pop("extra_body", {})}
    return openai_client.responses.create(model="tiny", extra_body=extra, **kw)


def test_a_plain_response_has_a_message_usage_and_is_stored(openai_client):
    r = _create(openai_client, instructions="Be brief.", max_output_tokens=32)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "tiny"
    assert r.status in ("completed", "incomplete")
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in r.output] == ["message"]
    message = r.output[0]
    assert message.role == "assistant" and message.content[0].type == "output_text"
    assert r.output_text == message.content[0].text
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 32
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens >= 0
    assert r.instructions == "Be brief." and r.max_output_tokens == 32
    again = openai_client.responses.retrieve(r.id)
    assert again.id == r.id and again.output_text == r.output_text
    same = _create(openai_client, instructions="Be brief.", max_output_tokens=32)  # seeded: the same output
    assert same.output_text == r.output_text and same.id != r.id


def test_the_token_limit_makes_an_incomplete_response(openai_client):
    r = _create(openai_client, max_output_tokens=16, extra_body={"ignore_eos": True})
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 16


def test_the_stream_is_openais_event_sequence_and_ends_with_the_same_response(openai_client):
    whole = _create(openai_client, max_output_tokens=48)
    got = list(_create(openai_client, max_output_tokens=48, stream=True))
    kinds = [e.type for e in got]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response." + ("completed" if whole.status == "completed" else "incomplete")
    assert [e.sequence_number for e in got] == list(range(len(got)))
    assert kinds[2:5] == ["response.output_item.added", "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert set(kinds[5:-4]) <= {"response.output_text.delta"}
    text = "".join(e.delta for e in got if e.type == "response.output_text.delta")
    done = next(e for e in got if e.type == "response.output_text.done")
    final = got[-1].response
    assert text == done.text == final.output_text == whole.output_text
    assert got[0].response.status == "in_progress" and got[0].response.id == final.id


YES = {"format": {"type": "json_schema", "name": "yes", "schema": {"enum": ["yes", "no"]}}}


def test_the_sdks_stream_helper_accumulates_the_events(openai_client):
    """``responses.stream`` checks the events' item ids and indices as it builds the response (it needs one that
    completes: a short schema ends it)."""
    extra = {"seed": 1, **KNOBS}
    with openai_client.responses.stream(model="tiny", input="Say hi", text=YES, extra_body=extra) as s:
        for _ in s:
            pass
        final = s.get_final_response()
    assert final.status == "completed" and json.loads(final.output_text) in ("yes", "no")
    assert final.output_text == _create(openai_client, text=YES).output_text


def test_a_function_call_and_its_output_round_trip(openai_client):
    r = _create(openai_client, input="weather in Paris?", tools=[WEATHER], tool_choice="required", max_output_tokens=64)
    calls = [item for item in r.output if item.type == "function_call"]
    assert r.status == "completed" and len(calls) >= 1
    call = calls[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome")
    # the whole conversation sent back, as the Agents SDK does without previous_response_id
    history = [{"role": "user", "content": "weather in Paris?"}, *[c.model_dump() for c in calls]]
    history += [{"type": "function_call_output", "call_id": c.call_id, "output": "sunny, 21 C"} for c in calls]
    after = _create(openai_client, input=history, tools=[WEATHER], max_output_tokens=32)
    assert after.status in ("completed", "incomplete") and after.usage.input_tokens > r.usage.input_tokens
    # the same turn by previous_response_id: only the outputs are sent
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": "sunny, 21 C"} for c in calls]
    chained = _create(openai_client, input=outputs, previous_response_id=r.id, tools=[WEATHER], max_output_tokens=32)
    assert chained.previous_response_id == r.id
    assert chained.usage.input_tokens == after.usage.input_tokens  # the same conversation, rendered alike


def test_a_named_function_streams_arguments_deltas(openai_client):
    named = {"type": "function", "name": "get_weather"}
    whole = _create(openai_client, input="weather?", tools=[WEATHER], tool_choice=named, parallel_tool_calls=False)
    got = list(
        _create(
            openai_client, input="weather?", tools=[WEATHER], tool_choice=named, parallel_tool_calls=False, stream=True
        )
    )
    kinds = [e.type for e in got]
    added = next(e for e in got if e.type == "response.output_item.added" and e.item.type == "function_call")
    args = "".join(e.delta for e in got if e.type == "response.function_call_arguments.delta")
    done = next(e for e in got if e.type == "response.function_call_arguments.done")
    call = next(item for item in whole.output if item.type == "function_call")
    assert added.item.call_id == call.call_id and args == done.arguments == call.arguments
    assert kinds[-1] == "response.completed" and "response.output_text.delta" not in kinds
    assert got[-1].response.output[-1].arguments == call.arguments


def test_previous_response_id_continues_the_conversation(openai_client):
    first = _create(openai_client, input="My name is Ada.", max_output_tokens=16)
    second = _create(openai_client, input="What is my name?", previous_response_id=first.id, max_output_tokens=16)
    alone = _create(openai_client, input="What is my name?", max_output_tokens=16)
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens // 2
    assert second.previous_response_id == first.id


def test_reasoning_effort_gives_a_reasoning_item_or_none(openai_client):
    r = _create(openai_client, reasoning={"effort": "low"}, max_output_tokens=32)
    assert r.reasoning.effort == "low"
    assert all(item.type in ("reasoning", "message") for item in r.output)


def test_text_format_json_schema_gives_a_valid_document(openai_client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}}
    r = _create(openai_client, text=fmt)
    assert r.status == "completed" and isinstance(json.loads(r.output_text)["ok"], bool)
    assert r.text.format.type == "json_schema"
    obj = _create(openai_client, text={"format": {"type": "json_object"}}, max_output_tokens=64)
    if obj.status == "completed":
        assert isinstance(json.loads(obj.output_text), dict)


def test_store_false_and_delete(openai_client, url):
    r = _create(openai_client, store=False, max_output_tokens=8)
    assert httpx.get(f"{url}/v1/responses/{r.id}").status_code == 404
    kept = _create(openai_client, max_output_tokens=8)
    assert openai_client.responses.delete(kept.id) is None
    gone = httpx.get(f"{url}/v1/responses/{kept.id}")
    assert gone.status_code == 404 and gone.json()["error"]["type"] == "not_found_error"
    assert httpx.delete(f"{url}/v1/responses/{kept.id}").status_code == 404


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": [{"type": "web_search_call"}]}, "input[0].type"),
        ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, "input[0].call_id"),
        ({"input": "hi", "previous_response_id": "resp_unknown"}, "previous_response_id"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
        ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0].text"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
        ({"input": [7]}, "input[0]"),
        ({"input": []}, "input"),
        ({"input": "hi", "tools": [{"type": "custom", "name": "apply_patch"}]}, "tools[0].type"),
        (
            {"input": "hi", "tools": [{"type": "namespace", "name": "ns", "tools": [{"type": "web_search"}]}]},
            "tools[0].tools[0].type",
        ),
        ({"input": "hi", "tools": [{"type": "function"}]}, "tools[0].name"),
        ({"input": "hi", "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"input": "hi", "text": {"format": {"type": "json_schema"}}}, "text.format"),
        ({"input": "hi", "reasoning": {"effort": "max"}}, "reasoning.effort"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "hi", "top_k": 5}, "top_k"),
        ({"input": "hi", "store": "yes"}, "store"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(url, body, param):
    r = httpx.post(url + "/v1/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param), r.text


def test_a_function_call_output_must_follow_its_turn(url):
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"}
    body = {
        "input": [
            {"role": "user", "content": "a"},
            call,
            {"role": "user", "content": "b"},
            {"type": "function_call_output", "call_id": "call_1", "output": "x"},
        ],
        "tools": [WEATHER],
    }
    r = httpx.post(url + "/v1/responses", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[3].call_id", r.text


# ---------------------------------------------------------------------------------------------- store and callers


def test_the_store_is_bounded_by_entries_and_bytes_least_recently_used_first():
    store = ResponseStore(max_entries=2, max_bytes=400)
    for rid in ("a", "b"):
        assert store.put(None, {"id": rid}, [{"role": "user", "content": rid}])
    assert store.get(None, "a") is not None  # a is now the most recently used
    store.put(None, {"id": "c"}, [])
    assert store.get(None, "b") is None and store.get(None, "a") and store.get(None, "c")
    assert not store.put(None, {"id": "big", "pad": "x" * 500}, [])  # larger than the whole store
    store.put(None, {"id": "d", "pad": "x" * 370}, [])  # 391 bytes: it fits only alone
    assert len(store) == 1 and store.bytes <= 400 and store.get(None, "d") is not None
    assert store.get("someone", "d") is None and not store.delete("someone", "d")


def test_one_callers_puts_never_evict_another_callers_response():
    store = ResponseStore(max_entries=100, max_bytes=1000)
    assert store.put("a", {"id": "a1"}, [])
    for i in range(20):  # b fills the store many times over: b's own oldest go, never a's
        assert store.put("b", {"id": f"b{i}", "pad": "x" * 200}, [])
        assert store.held("a")[0] == 1 and store.bytes <= 1000  # (held: a get would refresh a1's use)
    assert store.held("b")[0] < 20 and store.get("b", "b19") is not None and store.get("b", "b0") is None
    # a's put now takes from b (over its fair share of 500 bytes), not from a
    assert store.put("a", {"id": "a2", "pad": "x" * 300}, [])
    assert store.get("a", "a1") and store.get("a", "a2") and store.bytes <= 1000 and store.held("b")[1] <= 1000 - 300


def test_the_caller_holding_the_most_gives_way_and_a_caller_within_its_share_keeps_all():
    store = ResponseStore(max_entries=6, max_bytes=10_000)
    for owner, n in (("a", 1), ("b", 2), ("c", 3)):
        for i in range(n):
            assert store.put(owner, {"id": f"{owner}{i}"}, [])
    assert store.put("a", {"id": "a1"}, [])  # 7 entries > 6: c (3, the most) gives its least recently used
    assert [store.held(o)[0] for o in "abc"] == [2, 2, 2] and store.get("c", "c0") is None
    assert store.put("d", {"id": "d0"}, [])  # a tie at 2 each: the first of the largest gives way, never d's
    assert store.held("d")[0] == 1 and len(store) == 6


def test_a_response_that_only_fits_by_taking_others_shares_is_not_kept():
    store = ResponseStore(max_entries=100, max_bytes=300)
    for owner in "abc":  # three callers, each within its share of 100 bytes
        assert store.put(owner, {"id": owner, "pad": "x" * 70}, [])
    assert not store.put("d", {"id": "d", "pad": "x" * 200}, [])  # d would hold the most: it is refused
    assert store.held("d") == (0, 0) and all(store.get(o, o) for o in "abc")


def test_the_per_caller_caps_bound_each_caller_alone():
    store = ResponseStore(max_entries=100, max_bytes=10_000, max_entries_per_caller=2, max_bytes_per_caller=250)
    for i in range(3):
        assert store.put("a", {"id": f"a{i}"}, [])
    assert store.held("a")[0] == 2 and store.get("a", "a0") is None  # a's own least recently used
    assert store.put("b", {"id": "b0", "pad": "x" * 150}, []) and store.put("b", {"id": "b1", "pad": "x" * 150}, [])
    assert store.held("b")[0] == 1 and store.get("b", "b1") and store.held("a")[0] == 2
    assert not store.put("b", {"id": "big", "pad": "x" * 300}, [])  # larger than one caller's byte cap
    assert ResponseStore(10, 100, max_bytes_per_caller=1000).caller_bytes == 100  # never above the global cap
    assert not ResponseStore(10, 100, max_entries_per_caller=0).put("a", {"id": "x"}, [])


@pytest.fixture(scope="module")
def auth_url(model_dir, tmp_path_factory):
    with running(auth_config(model_dir, tmp_path_factory.mktemp("auth"), ("token-a", "token-b"))) as s:
        yield s.http_url


def test_a_stored_response_is_only_its_callers(auth_url):
    a = openai.OpenAI(base_url=auth_url + "/v1", api_key="token-a", max_retries=0, timeout=120)
    b = openai.OpenAI(base_url=auth_url + "/v1", api_key="token-b", max_retries=0, timeout=120)
    r = a.responses.create(model="tiny", input="hi", max_output_tokens=8, extra_body=KNOBS)
    assert a.responses.retrieve(r.id).id == r.id
    for attempt in (lambda: b.responses.retrieve(r.id), lambda: b.responses.delete(r.id)):
        with pytest.raises(openai.NotFoundError):
            attempt()
    with pytest.raises(openai.BadRequestError) as err:
        b.responses.create(model="tiny", input="hi", previous_response_id=r.id, extra_body=KNOBS)
    assert err.value.body["param"] == "previous_response_id"
    assert httpx.get(f"{auth_url}/v1/responses/{r.id}").status_code == 401
    assert a.responses.retrieve(r.id).id == r.id  # untouched


def test_another_callers_traffic_never_evicts_a_callers_stored_response(model_dir, tmp_path):
    # a small store: B's responses fill it several times over; before per-caller space B evicted A's response
    cfg = auth_config(model_dir, tmp_path, ("token-a", "token-b"), responses_store_max_bytes=24_000)
    with running(cfg) as s:
        a = openai.OpenAI(base_url=s.http_url + "/v1", api_key="token-a", max_retries=0, timeout=120)
        b = openai.OpenAI(base_url=s.http_url + "/v1", api_key="token-b", max_retries=0, timeout=120)
        kept = _create(a, input="mine", max_output_tokens=8)
        big = "lorem ipsum dolor sit amet " * 200  # ~5 KB of input kept with each of B's responses
        ids = [_create(b, input=f"{i} {big}", max_output_tokens=8).id for i in range(10)]
        assert b.responses.retrieve(ids[-1]).id == ids[-1]
        with pytest.raises(openai.NotFoundError):
            b.responses.retrieve(ids[0])  # B's own oldest went
        r = httpx.get(f"{s.http_url}/v1/responses/{kept.id}", headers={"Authorization": "Bearer token-a"})
        assert r.status_code == 200 and r.json()["id"] == kept.id, r.text
        follow = _create(a, input="and then?", previous_response_id=kept.id, max_output_tokens=8)
        assert follow.previous_response_id == kept.id


def test_the_drain_ends_a_stream_with_response_incomplete(model_dir):
    body = {"input": "drain", "stream": True, "max_output_tokens": 16 * 200, "ignore_eos": True, **KNOBS}
    with running(base_config(model_dir)) as s:
        with httpx.Client(timeout=60) as c, c.stream("POST", s.http_url + "/v1/responses", json=body) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            drained = asyncio.run_coroutine_threadsafe(s.server.drain(0.5), s.loop)
            rest = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
        assert rest[-1]["type"] == "response.incomplete"
        assert rest[-1]["response"]["incomplete_details"] == {"reason": "cancelled"}
        drained.result(30)


# ---------------------------------------------------------------------------------------------- units


def test_reasoning_text_and_calls_become_items_in_order_with_their_events():
    """A thinking output with text and a call, in two blocks split inside the call: reasoning, message and
    function_call items, each opened, written and closed by its events; the call is sent once whole."""
    from dgserve import SamplingParams
    from dgserve.outputs import FINISH_EOS
    from dgserve.service import events
    from dgserve.service.http.responses.input import responses_request
    from dgserve.service.http.responses.output import ResponseOutput
    from dgserve.structured.chat_output import ChatOutputParser
    from dgserve.text.gemma4 import CHANNEL_BEGIN, CHANNEL_END, TOOL_CALL_BEGIN, TOOL_CALL_END

    text = (
        f'{CHANNEL_BEGIN}thought\nplan{CHANNEL_END}Hi{TOOL_CALL_BEGIN}call:get_weather{{"city":"Paris"}}{TOOL_CALL_END}'
    )
    cut = text.index("Paris")
    rc = responses_request({"input": "x", "tools": [WEATHER]}, SamplingParams(), None, lambda _: None)
    out, chat = ResponseOutput(rc, "tiny", "r-1", 1), events.ChatOutput(ChatOutputParser(True, True, b"k"))
    stats = events.BlockReport(1, 1.0, 0.0, 0.0, 0.0)
    got = []
    for i, piece in enumerate((text[:cut], text[cut:])):
        got += out.add(chat.block(events.BlockEvent(i, [], piece, stats)))
    end = events.FinishEvent(FINISH_EOS, events.Usage(3, 9, 2, 8), events.Timing(0.0, 1.0, 2.0))
    got += out.add(chat.finish(end))
    assert [(e["type"], e.get("output_index")) for e in got] == [
        ("response.output_item.added", 0),
        ("response.content_part.added", 0),
        ("response.reasoning_text.delta", 0),
        ("response.reasoning_text.done", 0),
        ("response.content_part.done", 0),
        ("response.output_item.done", 0),
        ("response.output_item.added", 1),
        ("response.content_part.added", 1),
        ("response.output_text.delta", 1),
        ("response.output_text.done", 1),
        ("response.content_part.done", 1),
        ("response.output_item.done", 1),
        ("response.output_item.added", 2),
        ("response.function_call_arguments.delta", 2),  # a call is sent only whole (docs/tools.md)
        ("response.function_call_arguments.done", 2),
        ("response.output_item.done", 2),
    ]
    body = out.body()
    assert body["status"] == "completed" and body["usage"]["output_tokens"] == 9
    reasoning, message, call = body["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "plan"}]
    assert message["content"][0]["text"] == "Hi"
    assert call["call_id"].startswith("call_") and json.loads(call["arguments"]) == {"city": "Paris"}
    assert out.assistant_message() == {
        "role": "assistant",
        "content": "Hi",
        "reasoning_content": "plan",
        "tool_calls": [
            {
                "id": call["call_id"],
                "type": "function",
                "function": {"name": "get_weather", "arguments": call["arguments"]},
            }
        ],
    }


def test_items_become_chat_messages():
    """Reasoning goes to the next assistant message, a turn's calls share one, outputs become tool messages,
    instructions and a developer item make one system message."""
    from dgserve.service.http.responses.conversation import Conversation

    convo = Conversation()
    items = [
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "go"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "t"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}", "id": "fc_1", "status": "completed"},
        {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "2"}]},
    ]
    convo.add_input(items, None)
    messages = convo.prompt_messages("Be brief.")
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool"]
    assert messages[0]["content"] == "Be brief.\n\nUse tools."
    assert messages[2]["reasoning_content"] == "t" and [c["id"] for c in messages[2]["tool_calls"]] == ["c1", "c2"]
    assert messages[4] == {"role": "tool", "tool_call_id": "c2", "content": "2"}
    assert convo.messages[0] == {"role": "system", "content": "Use tools."}  # the instructions are not history
