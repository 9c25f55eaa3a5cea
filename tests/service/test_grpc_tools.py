"""Agents over gRPC: Chat.tools / tool_choice / parallel_tool_calls, tool turns in ChatMessage, calls streamed in
Block.tool_calls and whole in Finished.tool_calls with FINISH_REASON_TOOL_CALLS; the same call the HTTP door
returns for the same seeded request; bad tools are INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import json

import grpc
import pytest
from service_helpers import params

from dgserve.v1 import text_generation_pb2 as pb

SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = pb.Tool(name="get_weather", description="The weather in a city", parameters_json=json.dumps(SCHEMA))
ASK = pb.ChatMessage(role="user", content="weather in Paris?")


def _generate(stub, chat: pb.Chat, **kw):
    req = pb.GenerateRequest(chat=chat, params=params(max_new_tokens=64, seed=1, **kw))
    return list(stub.Generate(req, timeout=120))


def test_a_named_call_streams_and_finishes_whole(stub, http):
    chat = pb.Chat(
        messages=[ASK],
        tools=[WEATHER],
        tool_choice=pb.ToolChoice(function="get_weather"),
        parallel_tool_calls=False,
    )
    events = _generate(stub, chat)
    fin = events[-1].finished
    assert fin.finish_reason == pb.FINISH_REASON_TOOL_CALLS and len(fin.tool_calls) == 1
    call = fin.tool_calls[0]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Rome")
    pieces = [d for e in events if e.HasField("block") for d in e.block.tool_calls]
    assert pieces and pieces[0].id == call.id and pieces[0].name == call.name
    assert "".join(d.arguments for d in pieces) == call.arguments
    assert all("<|tool_call>" not in e.block.text for e in events if e.HasField("block"))
    # the HTTP door gives the same call for the same seeded request
    body = {
        "messages": [{"role": "user", "content": "weather in Paris?"}],
        "tools": [
            {
                "type": "function",
                "function": {"name": "get_weather", "description": "The weather in a city", "parameters": SCHEMA},
            }
        ],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": False,
        "max_tokens": 64,
        "seed": 1,
        "max_denoising_steps": 4,
    }
    got = http.post("/v1/chat/completions", json=body, timeout=120).json()["choices"][0]["message"]["tool_calls"][0]
    assert (got["id"], got["function"]["arguments"]) == (call.id, call.arguments)


def test_a_conversation_with_tool_turns_and_a_developer_message(stub):
    first = _generate(stub, pb.Chat(messages=[ASK], tools=[WEATHER], tool_choice=pb.ToolChoice(mode="required")))
    call = first[-1].finished.tool_calls[0]
    turns = [
        pb.ChatMessage(role="developer", content="be brief"),
        ASK,
        pb.ChatMessage(role="assistant", tool_calls=[call]),
        pb.ChatMessage(role="tool", tool_call_id=call.id, content='{"temperature_c": 18}'),
    ]
    events = _generate(stub, pb.Chat(messages=turns, tools=[WEATHER], tool_choice=pb.ToolChoice(mode="auto")))
    fin = events[-1].finished
    assert fin.finish_reason in (pb.FINISH_REASON_EOS, pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_TOOL_CALLS)
    for c in fin.tool_calls:
        assert json.loads(c.arguments)["city"] in ("Paris", "Rome")


@pytest.mark.parametrize(
    "chat, field",
    [
        (pb.Chat(messages=[ASK], tools=[WEATHER, WEATHER]), "chat.tools"),
        (pb.Chat(messages=[ASK], tools=[pb.Tool(name="bad name")]), "chat.tools[0].function.name"),
        (pb.Chat(messages=[ASK], tools=[pb.Tool(name="f", parameters_json="{")]), "chat.tools[0].parameters_json"),
        (pb.Chat(messages=[ASK], tools=[WEATHER], tool_choice=pb.ToolChoice(function="nope")), "chat.tool_choice"),
        (
            pb.Chat(messages=[ASK, pb.ChatMessage(role="tool", tool_call_id="call_x", content="18")], tools=[WEATHER]),
            "messages[1].tool_call_id",
        ),
    ],
)
def test_bad_tools_are_invalid_argument_naming_the_field(stub, chat, field):
    with pytest.raises(grpc.RpcError) as e:
        _generate(stub, chat)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in e.value.details(), e.value.details()
