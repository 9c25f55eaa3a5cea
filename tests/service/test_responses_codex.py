"""Codex CLI's default requests on the Responses API (docs/responses-api.md, "Tools" and "Clients"): its recorded
request (tests/data, trimmed) is accepted by the real server; ``namespace`` tools are offered by name and their
calls come back with the tool's own name and its namespace; hosted tools are left out, said so in the response
(``tools`` echo, ``dgserve.tools_left_out``) and logged once."""

from __future__ import annotations

import copy
import json
import logging
import pathlib

import httpx
import pytest

from dgserve import SamplingParams
from dgserve.service.http.responses.api import RESPONSES
from dgserve.service.http.responses.input import responses_request
from dgserve.service.http.responses.tools import read_tools

CODEX = pathlib.Path(__file__).parents[1] / "data" / "codex_0.171.0_default_request.json"
CITY = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}


def _fn(name: str, parameters: dict | None = None) -> dict:
    return {"type": "function", "name": name, "description": "d", "strict": False, "parameters": parameters or CITY}


def _ns(name: str, *tools: dict) -> dict:
    return {"type": "namespace", "name": name, "description": "Sub-agents.", "tools": list(tools)}


def _parse(body: dict):
    return responses_request(body, SamplingParams(), None, lambda _: None)


# ---------------------------------------------------------------------------------------------- the rules


def test_a_namespaces_tools_are_offered_by_their_own_names_unless_another_tool_has_one():
    tools = read_tools(
        {
            "tools": [
                _fn("get_goal"),
                _ns("multi_agent_v1", _fn("spawn_agent"), _fn("get_goal")),
                _ns("mcp__gh__", _fn("x")),
            ]
        }
    )
    assert tools.tools is not None
    assert [t.name for t in tools.tools.tools] == ["get_goal", "spawn_agent", "multi_agent_v1__get_goal", "x"]
    assert tools.wire("spawn_agent") == {"name": "spawn_agent", "namespace": "multi_agent_v1"}
    assert tools.wire("multi_agent_v1__get_goal") == {"name": "get_goal", "namespace": "multi_agent_v1"}
    assert tools.wire("get_goal") == {"name": "get_goal"}  # the top-level function keeps its name
    assert tools.prompt_name("multi_agent_v1", "get_goal") == "multi_agent_v1__get_goal"
    assert tools.prompt_name("mcp__other__", "y") == "mcp__other__y"  # a namespace the request no longer has


def test_hosted_tools_are_left_out_of_the_prompt_and_the_echo():
    rc = _parse({"input": "hi", "tools": [{"type": "web_search", "external_web_access": False}, _fn("f")]})
    assert rc.tools.left_out == ("web_search",)
    assert rc.echo["tools"] == [_fn("f")]
    assert [t.name for t in rc.call.submission.prompt.tools.tools] == ["f"]
    only_hosted = _parse({"input": "hi", "tools": [{"type": "file_search"}, {"type": "code_interpreter"}]})
    assert only_hosted.call.submission.prompt.tools is None  # nothing left to call: a plain chat prompt
    assert only_hosted.tools.left_out == ("file_search", "code_interpreter")


def test_hosted_tools_are_logged_once_per_request_by_type_only(caplog):
    rc = _parse({"input": "secret words", "tools": [{"type": "web_search"}, {"type": "web_search"}, _fn("f")]})
    with caplog.at_level(logging.INFO, logger="dgserve.http"):
        RESPONSES.call(rc)
    lines = [r.getMessage() for r in caplog.records if "hosted tools" in r.getMessage()]
    assert lines == ["responses: hosted tools left out of the prompt: web_search"]


def test_a_function_call_item_with_a_namespace_reads_back_as_the_prompts_name():
    body = {
        "input": [
            {"role": "user", "content": "go"},
            {"type": "function_call", "call_id": "c1", "name": "get_goal", "namespace": "ns", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        ],
        "tools": [_fn("get_goal"), _ns("ns", _fn("get_goal"))],
    }
    call = _parse(body).history[1]["tool_calls"][0]
    assert call["function"]["name"] == "ns__get_goal"


def test_a_call_of_a_namespaced_tool_is_answered_with_its_name_and_namespace():
    from dgserve.outputs import FINISH_EOS
    from dgserve.service import events
    from dgserve.service.http.responses.output import ResponseOutput
    from dgserve.structured.chat_output import ChatOutputParser
    from dgserve.text.gemma4 import TOOL_CALL_BEGIN, TOOL_CALL_END

    rc = _parse({"input": "x", "tools": [_ns("multi_agent_v1", _fn("spawn_agent"))]})
    out, chat = ResponseOutput(rc, "tiny", "r-1", 1), events.ChatOutput(ChatOutputParser(True, False, b"k"))
    text = f'{TOOL_CALL_BEGIN}call:spawn_agent{{"city":"Rome"}}{TOOL_CALL_END}'
    got = out.add(chat.block(events.BlockEvent(0, [], text, events.BlockReport(1, 1.0, 0.0, 0.0, 0.0))))
    end = events.FinishEvent(FINISH_EOS, events.Usage(3, 9, 2, 8), events.Timing(0.0, 1.0, 2.0))
    got += out.add(chat.finish(end))
    (item,) = out.body()["output"]
    assert (item["type"], item["name"], item["namespace"]) == ("function_call", "spawn_agent", "multi_agent_v1")
    assert json.loads(item["arguments"]) == {"city": "Rome"}
    added = [e["item"] for e in got if e["type"] == "response.output_item.added"]
    assert added[0]["namespace"] == "multi_agent_v1" and added[0]["name"] == "spawn_agent"


# ---------------------------------------------------------------------------------------------- the real server


def test_codex_clis_default_request_is_accepted(url):
    """Codex CLI 0.171.0's first request of ``codex exec "say hi"`` with its defaults (texts trimmed to fit the
    tiny model): 200, the stream opens, the namespace tool echoed and the hosted one said left out."""
    body = json.loads(CODEX.read_text())
    assert {t["type"] for t in body["tools"]} == {"function", "namespace", "web_search"}
    body["model"] = "tiny"
    with httpx.stream("POST", url + "/v1/responses", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = r.iter_lines()
        created = next(json.loads(line[6:]) for line in lines if line.startswith("data: "))
    response = created["response"]
    assert created["type"] == "response.created"
    assert [t["type"] for t in response["tools"]].count("web_search") == 0
    assert any(t["type"] == "namespace" and t["name"] == "multi_agent_v1" for t in response["tools"])
    assert response["dgserve"]["tools_left_out"] == ["web_search"]


def test_a_namespaced_tool_is_called_through_the_server(url):
    body = {
        "model": "tiny",
        "input": "weather?",
        "tools": [{"type": "web_search"}, _ns("multi_agent_v1", _fn("spawn_agent"))],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_output_tokens": 64,
        "seed": 1,
        "max_denoising_steps": 4,
        "store": False,
    }
    r = httpx.post(url + "/v1/responses", json=copy.deepcopy(body), timeout=120)
    assert r.status_code == 200, r.text
    calls = [item for item in r.json()["output"] if item["type"] == "function_call"]
    assert calls and r.json()["status"] == "completed", r.text
    assert (calls[0]["name"], calls[0]["namespace"]) == ("spawn_agent", "multi_agent_v1")
    assert json.loads(calls[0]["arguments"])["city"] in ("Paris", "Rome")


@pytest.mark.parametrize("kind", ["custom", "made_up"])
def test_a_tool_type_neither_function_namespace_nor_hosted_is_a_400(url, kind):
    r = httpx.post(url + "/v1/responses", json={"input": "hi", "tools": [{"type": kind, "name": "x"}]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].type", r.text


def test_a_developer_message_after_the_turns_began_is_a_user_turn():
    """Codex CLI, after compacting a conversation, sends its developer instructions again after user messages
    (docs/responses-api.md, "The request"): the opening ones join the system turn, a later one is a user turn."""
    from dgserve.service.http.responses.conversation import Conversation

    convo = Conversation()
    items = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "You are Codex."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "read this"}]},
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "<skills/>"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "say hi"}]},
    ]
    convo.add_input(items, None)
    messages = convo.prompt_messages(None)
    assert [m["role"] for m in messages] == ["system", "user", "user", "user"]
    assert messages[0]["content"] == "You are Codex."
    assert messages[2]["content"] == [{"type": "text", "text": "<skills/>"}]
