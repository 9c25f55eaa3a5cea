"""Every place a client's JSON is read goes through one bounded reader (dgserve.text.client_json): request bodies,
a tool call's ``arguments`` (chat and /tokenize on HTTP; Generate and Tokenize on gRPC), tool schemas (HTTP
``tools[i].function.parameters``, gRPC ``Tool.parameters_json``) and ``response_format`` schemas. Too deep (1,000,
5,000, 100,000 levels) or too big is 400 / INVALID_ARGUMENT naming the field, never a 500 / INTERNAL with a
traceback (json's RecursionError), and the server keeps serving."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest
from service_helpers import bad_request_field, params

from dgserve.structured.response_format import MAX_SCHEMA_BYTES
from dgserve.text import client_json
from dgserve.text.messages import MAX_ARGUMENTS_BYTES
from dgserve.v1 import text_generation_pb2 as pb

DEPTHS = [1_000, 5_000, 100_000]
ARGS_FIELD = "messages[1].tool_calls[0].function.arguments"


def deep(depth: int) -> str:
    """A JSON object ``depth`` levels deep: {"a": [[...]]}."""
    return '{"a": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}"


def history(arguments: str) -> list[dict]:
    """A chat whose assistant turn called a tool with ``arguments`` (text), then the tool's answer."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]


def grpc_chat(arguments: str) -> pb.Chat:
    call = pb.ToolCall(id="c1", name="f", arguments=arguments)
    return pb.Chat(
        messages=[
            pb.ChatMessage(role="user", content="hi"),
            pb.ChatMessage(role="assistant", tool_calls=[call]),
            pb.ChatMessage(role="tool", tool_call_id="c1", content="ok"),
        ]
    )


def http_400(r: httpx.Response, field: str, words: str) -> None:
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == field and words in error["message"], error


def grpc_invalid(call, field: str, words: str) -> None:
    with pytest.raises(grpc.RpcError) as e:
        call()
    err = e.value
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert words in err.details() and bad_request_field(err) == field, (err.details()[:300], bad_request_field(err))


# ---------------------------------------------------------------------------------------------- the reader


@pytest.mark.parametrize("depth", [129, *DEPTHS])
def test_reader_refuses_deep_text_naming_the_field(depth):
    with pytest.raises(ValueError, match=r"^x\.arguments: JSON nests too deep; at most 128 levels are allowed$"):
        client_json.loads(deep(depth), "x.arguments")


def test_reader_limits():
    assert client_json.loads(deep(128), "x") == {"a": json.loads(deep(128))["a"]}
    four = '"' + "é" * 4 + '"'  # 6 characters, 10 bytes: counted in bytes
    assert client_json.loads(four, "x", max_bytes=10) == "é" * 4
    with pytest.raises(ValueError, match=r"^x: 10 bytes; at most 9 are allowed$"):
        client_json.loads(four, "x", max_bytes=9)
    with pytest.raises(ValueError, match=r"^x: more than 4 JSON values$"):
        client_json.loads("[1, 2, 3, 4, 5]", "x", max_values=4)
    with pytest.raises(ValueError, match=r"^x: not valid JSON"):
        client_json.loads("{", "x")
    with pytest.raises(ValueError, match=r"^x\.a\[1\]: text is not valid Unicode \(lone surrogate U\+D800"):
        client_json.loads('{"a": [1, "\\ud800"]}', "x")
    with pytest.raises(ValueError, match=r"^messages\[0\]: field name is not valid Unicode"):
        client_json.loads(b'{"messages": [{"\\udc00": 1}]}')
    with pytest.raises(ValueError, match=r"^body: not valid UTF-8"):
        client_json.loads(b'"\xed\xa0\x80"')


# ---------------------------------------------------------------------------------------------- tool call arguments


@pytest.mark.parametrize("depth", DEPTHS)
def test_deep_tool_call_arguments_are_a_400_on_http(http, no_traceback, depth):
    body = {"messages": history(deep(depth)), "max_tokens": 8, "max_denoising_steps": 2}
    http_400(http.post("/v1/chat/completions", json=body), ARGS_FIELD, "nests too deep; at most 128 levels")
    body = {"messages": history(deep(depth))}
    http_400(http.post("/tokenize", json=body), ARGS_FIELD, "nests too deep; at most 128 levels")


@pytest.mark.parametrize("depth", DEPTHS)
def test_deep_tool_call_arguments_are_invalid_argument_on_grpc(stub, no_traceback, depth):
    chat = grpc_chat(deep(depth))
    words = "nests too deep; at most 128 levels"
    grpc_invalid(
        lambda: list(stub.Generate(pb.GenerateRequest(chat=chat, params=params()), timeout=60)), ARGS_FIELD, words
    )
    grpc_invalid(lambda: stub.Tokenize(pb.TokenizeRequest(chat=chat), timeout=60), ARGS_FIELD, words)


def test_oversized_tool_call_arguments_are_refused_on_both_doors(http, stub, no_traceback):
    big = json.dumps({"text": "x" * MAX_ARGUMENTS_BYTES})
    words = f"bytes; at most {MAX_ARGUMENTS_BYTES} are allowed"
    http_400(http.post("/v1/chat/completions", json={"messages": history(big)}), ARGS_FIELD, words)
    http_400(http.post("/tokenize", json={"messages": history(big)}), ARGS_FIELD, words)
    chat = grpc_chat(big)
    grpc_invalid(
        lambda: list(stub.Generate(pb.GenerateRequest(chat=chat, params=params()), timeout=60)), ARGS_FIELD, words
    )
    grpc_invalid(lambda: stub.Tokenize(pb.TokenizeRequest(chat=chat), timeout=60), ARGS_FIELD, words)


def test_moderately_nested_arguments_are_served_on_both_doors(http, stub):
    """128 levels is the bound, not a refusal: the history renders and the call runs."""
    body = {"messages": history(deep(100)), "max_tokens": 8, "max_denoising_steps": 2}
    assert http.post("/v1/chat/completions", json=body).status_code == 200
    assert http.post("/tokenize", json={"messages": history(deep(128))}).status_code == 200
    events = list(stub.Generate(pb.GenerateRequest(chat=grpc_chat(deep(100)), params=params()), timeout=60))
    assert events[-1].HasField("finished")


# ---------------------------------------------------------------------------------------------- tool schemas


def _tool(parameters) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


@pytest.mark.parametrize("depth", DEPTHS)
def test_deep_tool_parameters_are_refused_on_both_doors(http, stub, no_traceback, depth):
    """HTTP's parameters are an object inside the body (the body's own bound, 128 levels, comes first); gRPC's are
    JSON text, read with the schema bounds."""
    text = '{"type": "object", "properties": {"a": ' + "[" * depth + "]" * depth + "}}"
    raw = b'{"messages": [{"role": "user", "content": "hi"}], "tools": [' + _tool_text(text) + b"]}"
    r = http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    http_400(r, "body", "nests too deep; at most 128 levels")
    chat = pb.Chat(
        messages=[pb.ChatMessage(role="user", content="hi")], tools=[pb.Tool(name="f", parameters_json=text)]
    )
    field = "chat.tools[0].parameters_json"
    call = lambda: list(stub.Generate(pb.GenerateRequest(chat=chat, params=params()), timeout=60))  # noqa: E731
    grpc_invalid(call, field, _schema_words(text))


def _schema_words(text: str) -> str:
    """What a deep schema's refusal says: its size comes first (100,000 levels are 200 KB)."""
    return "bytes; at most" if len(text) > MAX_SCHEMA_BYTES else "schema nests too deep; at most 64 levels"


def _tool_text(parameters: str) -> bytes:
    return b'{"type": "function", "function": {"name": "f", "parameters": ' + parameters.encode() + b"}}"


def test_tool_parameters_past_the_schema_depth_are_refused_on_http(http, no_traceback):
    params_ = json.loads('{"type": "object", "properties": {"a": ' + "[" * 100 + "]" * 100 + "}}")
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [_tool(params_)]}
    r = http.post("/v1/chat/completions", json=body)
    http_400(r, "tools[0].function.parameters", "schema nests too deep; at most 64 levels")


def test_oversized_tool_parameters_are_refused_on_both_doors(http, stub, no_traceback):
    schema = {"type": "object", "description": "x" * MAX_SCHEMA_BYTES}
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [_tool(schema)]}
    words = f"bytes; at most {MAX_SCHEMA_BYTES} are allowed"
    http_400(http.post("/v1/chat/completions", json=body), "tools[0].function.parameters", words)
    tool = pb.Tool(name="f", parameters_json=json.dumps(schema))
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="hi")], tools=[tool])
    call = lambda: list(stub.Generate(pb.GenerateRequest(chat=chat, params=params()), timeout=60))  # noqa: E731
    grpc_invalid(call, "chat.tools[0].parameters_json", words)


# ---------------------------------------------------------------------------------------------- response_format


@pytest.mark.parametrize("depth", DEPTHS)
def test_deep_response_format_schema_over_grpc(stub, no_traceback, depth):
    text = "[" * depth + "]" * depth
    fmt = pb.ResponseFormat(json_schema=pb.JsonSchemaFormat(schema=text))
    call = lambda: list(stub.Generate(pb.GenerateRequest(prompt="x", response_format=fmt), timeout=60))  # noqa: E731
    grpc_invalid(call, "response_format", _schema_words(text))


def test_oversized_response_format_schema_on_both_doors(http, stub, no_traceback):
    schema = {"type": "object", "description": "x" * MAX_SCHEMA_BYTES}
    body = {"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}
    words = f"bytes; at most {MAX_SCHEMA_BYTES} are allowed"
    http_400(http.post("/v1/completions", json=body), "response_format", words)
    fmt = pb.ResponseFormat(json_schema=pb.JsonSchemaFormat(schema=json.dumps(schema)))
    call = lambda: list(stub.Generate(pb.GenerateRequest(prompt="x", response_format=fmt), timeout=60))  # noqa: E731
    grpc_invalid(call, "response_format", words)


# ---------------------------------------------------------------------------------------------- bodies


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
@pytest.mark.parametrize("depth", DEPTHS)
def test_deep_bodies_are_a_400_on_every_route(http, no_traceback, path, depth):
    raw = b'{"x": ' + b"[" * depth + b"]" * depth + b"}"
    r = http.post(path, content=raw, headers={"content-type": "application/json"})
    http_400(r, "body", "nests too deep; at most 128 levels")


def test_server_still_serves(http, stub):
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 8, "max_denoising_steps": 2})
    assert r.status_code == 200
    assert list(stub.Generate(pb.GenerateRequest(prompt="hi", params=params()), timeout=60))[-1].HasField("finished")
