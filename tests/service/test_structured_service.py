"""Structured output through both front doors on the shared tiny server: a JSON-schema request over gRPC and over
HTTP (the official openai client, chat and completions) returns a document that parses and validates; the same
seed gives the same document over both; bad formats are INVALID_ARGUMENT / 400 naming response_format, and the
server keeps serving."""

from __future__ import annotations

import json

import grpc
import httpx
import jsonschema
import pytest
from service_helpers import params

from dgserve.v1 import text_generation_pb2 as pb

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[A-Z][a-z]{2,8}$"},
        "population": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"enum": ["big", "old", "port"]}, "maxItems": 3},
    },
    "required": ["city", "population", "tags"],
    "additionalProperties": False,
}
KNOBS = {"max_denoising_steps": 4}


def grpc_generate(stub, fmt: pb.ResponseFormat, seed: int, **kw) -> tuple[str, pb.Finished]:
    req = pb.GenerateRequest(
        prompt="City as JSON:", params=params(max_new_tokens=96, seed=seed, **kw), response_format=fmt
    )
    events = list(stub.Generate(req, timeout=120))
    return "".join(e.block.text for e in events if e.HasField("block")), events[-1].finished


def schema_format() -> pb.ResponseFormat:
    return pb.ResponseFormat(json_schema=pb.JsonSchemaFormat(schema=json.dumps(SCHEMA), name="city", strict=True))


def test_grpc_json_schema_is_valid_every_time(stub):
    for seed in range(4):
        text, fin = grpc_generate(stub, schema_format(), seed)
        assert fin.finish_reason == pb.FINISH_REASON_EOS, text
        jsonschema.validate(json.loads(text), SCHEMA)


def test_grpc_regex_and_choice(stub):
    text, _ = grpc_generate(stub, pb.ResponseFormat(regex="[a-c]{2}-[0-9]{1,3}"), 1)
    assert text[:2].strip("abc") == "" and text[2] == "-" and text[3:].isdigit()
    text, _ = grpc_generate(stub, pb.ResponseFormat(choice=pb.ChoiceFormat(choices=["left", "right"])), 2)
    assert text in ("left", "right")


def test_http_chat_and_completion_json_schema_match_grpc(openai_client, stub):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    for seed in range(3):
        chat = openai_client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "City as JSON"}],
            max_tokens=96,
            seed=seed,
            response_format=fmt,
            extra_body=KNOBS,
        )
        jsonschema.validate(json.loads(chat.choices[0].message.content), SCHEMA)
        assert chat.choices[0].finish_reason == "stop"
    done = openai_client.completions.create(
        model="tiny", prompt="City as JSON:", max_tokens=96, seed=5, extra_body={**KNOBS, "response_format": fmt}
    )
    text, _ = grpc_generate(stub, schema_format(), 5)
    assert done.choices[0].text == text  # the same seeded document over both front doors
    obj = openai_client.completions.create(
        model="tiny",
        prompt="x",
        max_tokens=64,
        seed=1,
        extra_body={**KNOBS, "response_format": {"type": "choice", "choice": ["a", "b"]}},
    )
    assert obj.choices[0].text in ("a", "b")


@pytest.mark.parametrize(
    "fmt, problem",
    [
        (pb.ResponseFormat(json_schema=pb.JsonSchemaFormat(schema="{nope")), "not valid JSON"),
        (pb.ResponseFormat(json_schema=pb.JsonSchemaFormat(schema='{"type": "objectx"}')), "invalid json_schema"),
        (pb.ResponseFormat(json_schema=pb.JsonSchemaFormat(schema=json.dumps({"description": "x" * 40000}))), "bytes"),
        (pb.ResponseFormat(regex="(unclosed"), "invalid regex"),
        (pb.ResponseFormat(), "set one of"),
    ],
)
def test_grpc_bad_format_is_invalid_argument_and_server_stays_healthy(stub, fmt, problem):
    with pytest.raises(grpc.RpcError) as e:
        grpc_generate(stub, fmt, 0)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "response_format" in e.value.details() and problem in e.value.details()
    text, fin = grpc_generate(stub, schema_format(), 9)  # still serving, structured requests included
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize(
    "fmt, problem",
    [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}, "invalid json_schema"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema"),
        ({"type": "yaml"}, "response_format.type"),
        ({"type": "regex", "regex": "[a-"}, "invalid regex"),
        ({"type": "json_schema", "json_schema": {"schema": {"description": "x" * 40000}}}, "bytes"),
    ],
)
def test_http_bad_format_is_400_naming_response_format(url, openai_client, fmt, problem):
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 8, "response_format": fmt}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"].startswith("response_format") and problem in err["message"]
    ok = openai_client.completions.create(model="tiny", prompt="x", max_tokens=8, seed=1, extra_body=KNOBS)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_openai_response_format_parsing():
    from dgserve.service.http.knobs import response_format

    assert response_format(None) is None and response_format({"type": "text"}) is None
    assert response_format({"type": "json_object"}).type == "json_object"
    fmt = response_format({"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}})
    assert fmt.type == "json_schema" and json.loads(fmt.schema) == SCHEMA and fmt.name == "n" and fmt.strict
    assert response_format({"type": "regex", "regex": "a+"}).regex == "a+"
    assert response_format({"type": "choice", "choice": ["x", "y"]}).choices == ("x", "y")
    for bad, problem in [
        ("json", 'an object with a "type"'),
        ({"type": "json_object", "regex": "a"}, "response_format.regex: not used"),
        ({"type": "json_schema", "json_schema": {"schema": 3}}, "must be a JSON object"),
        ({"type": "json_schema", "json_schema": {"schema": {}, "extra": 1}}, "json_schema.extra"),
        ({"type": "choice", "choice": "x"}, "list of strings"),
        ({"type": "choice", "choice": [""]}, "choices[0]"),
    ]:
        with pytest.raises(ValueError, match="response_format") as e:
            response_format(bad)
        assert problem in str(e.value)
