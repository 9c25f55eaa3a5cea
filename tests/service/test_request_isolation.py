"""Against a real ``dgserve serve`` process (auth on, two callers): a request fails alone — schemas that admit no
document are refused before admission, a grammar that fails inside the engine step ends only its own request (with
an error naming response_format on both doors), and the server stays live and ready with nothing of that request
shown to others; stop strings with a response_format are refused; one request's total denoising work is capped;
request ids are scoped per caller."""

from __future__ import annotations

import json
import threading

import grpc
import httpx
import pytest
from storm import ServerProcess

from dgserve.client import Client
from dgserve.v1 import text_generation_pb2 as pb
from dgserve.v1 import text_generation_pb2_grpc as pb_grpc

A, B = (("authorization", "Bearer token-a"),), (("authorization", "Bearer token-b"),)
HA, HB = {"Authorization": "Bearer token-a"}, {"Authorization": "Bearer token-b"}
NO_DOCUMENT = {"type": "array", "minItems": 1, "items": {"$ref": "#"}}  # every document would contain itself
# the same ring through an "$id" reference: not judged before admission; it fails inside the engine step
FAILS_IN_STEP = {
    "$defs": {
        "a": {"$id": "http://example.com/a", "type": "array", "minItems": 1, "items": {"$ref": "http://example.com/a"}}
    },
    "$ref": "http://example.com/a",
}
GOOD = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def proc(model_dir, tmp_path_factory):
    tokens = tmp_path_factory.mktemp("iso") / "tokens"
    tokens.write_text("token-a\ntoken-b\n")
    p = ServerProcess(model_dir, "--auth-token-file", str(tokens), "--max-num-seqs", "4")
    yield p
    p.kill()


@pytest.fixture(scope="module")
def stub(proc):
    ch = grpc.insecure_channel(proc.target)
    yield pb_grpc.TextGenerationStub(ch)
    ch.close()


def url(proc) -> str:
    return f"http://127.0.0.1:{proc.http_port}"


def schema_request(schema: dict, **kw) -> pb.GenerateRequest:
    p = pb.SamplingParams(max_new_tokens=32, max_denoising_steps=4, seed=1, **kw)
    fmt = pb.ResponseFormat(json_schema=pb.JsonSchemaFormat(schema=json.dumps(schema)))
    return pb.GenerateRequest(prompt="x", params=p, response_format=fmt)


def chat_body(schema: dict, **kw) -> dict:
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}
    return {"messages": [{"role": "user", "content": "x"}], "max_tokens": 32, "seed": 1, "response_format": fmt, **kw}


def grpc_error(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value


def assert_healthy(proc, stub):
    assert proc.alive
    with Client(proc.target) as c:
        assert c.health("") == "SERVING" and c.health("liveness") == "SERVING"
    for path in ("/v1/health/live", "/v1/health/ready"):
        assert httpx.get(url(proc) + path, timeout=10).status_code == 200
    events = list(stub.Generate(schema_request(GOOD), metadata=A, timeout=60))
    assert events[-1].HasField("finished")


def test_a_schema_with_no_document_is_refused_before_admission(proc, stub):
    err = grpc_error(lambda: list(stub.Generate(schema_request(NO_DOCUMENT), metadata=A, timeout=30)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "admits no finite JSON document" in err.details()
    r = httpx.post(url(proc) + "/v1/chat/completions", json=chat_body(NO_DOCUMENT), headers=HA, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    raw = pb.ResponseFormat(json_schema=pb.JsonSchemaFormat(schema="[" * 30_000))  # deeper than a parser recurses
    err = grpc_error(lambda: list(stub.Generate(pb.GenerateRequest(prompt="x", response_format=raw), metadata=A)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "nests too deep" in err.details()
    deep: dict = {"type": "array"}
    for _ in range(100):
        deep = {"type": "array", "items": deep}
    r = httpx.post(url(proc) + "/v1/chat/completions", json=chat_body(deep), headers=HA, timeout=30)
    assert r.status_code == 400 and "nests too deep; at most 64" in r.json()["error"]["message"]
    assert_healthy(proc, stub)


def test_a_grammar_failing_in_the_step_fails_alone(proc, stub):
    """A neighbour streaming at the same time completes; the failing call gets INVALID_ARGUMENT / 400 naming
    response_format; the server stays live and ready and later errors carry nothing of the schema."""
    long = pb.GenerateRequest(
        prompt="neighbour",
        params=pb.SamplingParams(max_new_tokens=16 * 30, max_denoising_steps=4, seed=2, ignore_eos=True),
    )
    neighbour: list = []
    t = threading.Thread(target=lambda: neighbour.extend(stub.Generate(long, metadata=B, timeout=120)))
    t.start()
    err = grpc_error(lambda: list(stub.Generate(schema_request(FAILS_IN_STEP), metadata=A, timeout=60)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith("response_format: the grammar failed during generation")
    r = httpx.post(url(proc) + "/v1/chat/completions", json=chat_body(FAILS_IN_STEP), headers=HA, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    with httpx.stream(
        "POST", url(proc) + "/v1/chat/completions", json=chat_body(FAILS_IN_STEP, stream=True), headers=HA, timeout=60
    ) as s:
        lines = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert json.loads(lines[-2][6:])["error"]["param"] == "response_format" and lines[-1] == "data: [DONE]"
    t.join(120)
    assert neighbour[-1].finished.finish_reason == pb.FINISH_REASON_LENGTH
    assert_healthy(proc, stub)
    other = grpc_error(
        lambda: list(stub.Generate(pb.GenerateRequest(prompt="", params=pb.SamplingParams()), metadata=B))
    )
    assert "example.com" not in other.details()


def test_stop_strings_with_a_response_format_are_refused(proc, stub):
    err = grpc_error(lambda: list(stub.Generate(schema_request(GOOD, stop=["}"]), metadata=A, timeout=30)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("stop: cannot be combined")
    r = httpx.post(url(proc) + "/v1/chat/completions", json=chat_body(GOOD, stop=["}"]), headers=HA, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"


def test_one_requests_total_work_is_capped(proc, stub):
    """A large max_new_tokens is no longer refused for its steps x canvases: --max-request-steps ends the request
    with "length" while it runs (tests/service/test_context_contract.py). The same length at a modest step budget
    is served."""
    body = {"prompt": "x", "max_tokens": 16, "max_denoising_steps": 8}
    assert httpx.post(url(proc) + "/v1/completions", json=body, headers=HA, timeout=60).status_code == 200


def test_request_ids_are_scoped_per_caller(proc, stub):
    """A's id cannot be learnt or squatted by B: B's equal id is a different request; A's own duplicate is
    ALREADY_EXISTS / 409; B's Abort of it reaches only B's request."""
    long = pb.SamplingParams(max_new_tokens=16 * 200, max_denoising_steps=8, seed=1, ignore_eos=True)
    call_a = stub.Generate(pb.GenerateRequest(request_id="shared-id", prompt="a", params=long), metadata=A, timeout=120)
    assert next(call_a).HasField("started")
    call_b = stub.Generate(pb.GenerateRequest(request_id="shared-id", prompt="b", params=long), metadata=B, timeout=120)
    assert next(call_b).HasField("started")
    dup = grpc_error(
        lambda: list(stub.Generate(pb.GenerateRequest(request_id="shared-id", prompt="a", params=long), metadata=A))
    )
    assert dup.code() == grpc.StatusCode.ALREADY_EXISTS
    r = httpx.post(
        url(proc) + "/v1/completions", json={"prompt": "a"}, headers={**HA, "X-Request-Id": "shared-id"}, timeout=30
    )
    assert r.status_code == 409
    assert stub.Abort(pb.AbortRequest(request_id="shared-id"), metadata=B).outcome == pb.ABORT_OUTCOME_CANCELLED
    assert list(call_b)[-1].finished.finish_reason == pb.FINISH_REASON_CANCELLED
    assert next(call_a).HasField("block")  # A's request runs on
    assert stub.Abort(pb.AbortRequest(request_id="shared-id"), metadata=A).outcome == pb.ABORT_OUTCOME_CANCELLED
    assert list(call_a)[-1].finished.finish_reason == pb.FINISH_REASON_CANCELLED
