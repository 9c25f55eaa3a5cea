"""Every refusal on the Messages routes (``/v1/messages``, ``/v1/messages/count_tokens``) is Anthropic's error
object, ``{"type": "error", "error": {"type", "message"}}``, whichever layer refuses: the request-id check and the
site guard (middleware, before any route), auth, the body's Content-Type, size and JSON, the model, the queue,
readiness, the router (an unknown sub-path, a method) and the request timer (bounded.py). The OpenAI routes keep
OpenAI's shape for the same refusals (docs/messages-api.md, "Errors")."""

from __future__ import annotations

import json
import socket
import threading
import time

import grpc
import httpx
import pytest
from service_helpers import auth_config, base_config, long_params, running

from dgserve.v1 import text_generation_pb2 as pb
from dgserve.v1 import text_generation_pb2_grpc as pb_grpc

ROUTES = ("/v1/messages", "/v1/messages/count_tokens")
HI = [{"role": "user", "content": "hi"}]
TOKEN = "token-a"
LIMIT = 4096  # the auth server's body limit


def body_of(route: str) -> dict:
    return {"model": "tiny", "messages": HI} | ({"max_tokens": 4} if route == "/v1/messages" else {})


def assert_anthropic(r: httpx.Response, status: int, kind: str) -> str:
    """The response is Anthropic's error object with this status and type; its message."""
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]["message"]


@pytest.fixture(scope="module")
def guarded(model_dir, tmp_path_factory):
    """A server with auth on, a small body limit, a short request timer, and one running slot and no queue."""
    config = auth_config(
        model_dir,
        tmp_path_factory.mktemp("auth"),
        (TOKEN,),
        max_message_bytes=LIMIT,
        request_timeout=1.0,
        max_num_seqs=1,
        max_queue_len=0,
    )
    with running(config) as s:
        yield s


def auth(route: str) -> dict[str, str]:
    return {"x-api-key": TOKEN} if route == "/v1/messages" else {"authorization": f"Bearer {TOKEN}"}


# ---------------------------------------------------------------------------------------------- before any route


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("rid", [b"r" * 257, "caf\u00e9".encode(), b"tab\there"], ids=["long", "utf8", "tab"])
def test_a_bad_request_id(url, route, rid):
    r = httpx.post(url + route, json=body_of(route), headers={"x-request-id": rid})
    assert assert_anthropic(r, 400, "invalid_request_error").startswith("X-Request-Id: ")
    # the OpenAI routes keep theirs
    r = httpx.post(url + "/v1/chat/completions", json={"messages": HI}, headers={"x-request-id": "r" * 257})
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Id"


@pytest.mark.parametrize("route", ROUTES)
def test_host_and_origin(url, route):
    r = httpx.post(url + route, json=body_of(route), headers={"host": "evil.example"})
    assert assert_anthropic(r, 400, "invalid_request_error").startswith("Host: ")
    r = httpx.post(url + route, json=body_of(route), headers={"origin": "https://evil.example"})
    assert assert_anthropic(r, 403, "permission_error").startswith("Origin: ")


# ---------------------------------------------------------------------------------------------- the route's own


@pytest.mark.parametrize("route", ROUTES)
def test_unauthenticated(guarded, route):
    r = httpx.post(guarded.http_url + route, json=body_of(route), timeout=30)
    assert_anthropic(r, 401, "authentication_error")
    r = httpx.post(guarded.http_url + route, json=body_of(route), headers={"x-api-key": "wrong"}, timeout=30)
    assert_anthropic(r, 401, "authentication_error")


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("content_type", [None, "text/plain", "application/json; charset=latin-1"])
def test_wrong_content_type(url, route, content_type):
    headers = {} if content_type is None else {"content-type": content_type}
    r = httpx.post(url + route, content=json.dumps(body_of(route)).encode(), headers=headers)
    assert assert_anthropic(r, 415, "invalid_request_error").startswith("Content-Type: ")


@pytest.mark.parametrize("route", ROUTES)
def test_body_too_large(guarded, route):
    big = {**body_of(route), "messages": [{"role": "user", "content": "x" * (2 * LIMIT)}]}
    r = httpx.post(guarded.http_url + route, json=big, headers=auth(route), timeout=30)
    assert assert_anthropic(r, 413, "request_too_large").startswith("body: ")


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b'{"messages": "\\ud800"}'])
def test_bad_json(url, route, raw):
    r = httpx.post(url + route, content=raw, headers={"content-type": "application/json"})
    assert_anthropic(r, 400, "invalid_request_error")


@pytest.mark.parametrize("route", ROUTES)
def test_unknown_model(url, route):
    r = httpx.post(url + route, json={**body_of(route), "model": "gpt-5"})
    assert assert_anthropic(r, 404, "not_found_error").startswith("model: ")


def test_router_refusals(url):
    assert_anthropic(httpx.get(url + "/v1/messages"), 405, "invalid_request_error")
    assert_anthropic(httpx.get(url + "/v1/messages/count_tokens"), 405, "invalid_request_error")
    assert_anthropic(httpx.post(url + "/v1/messages/nope", json={}), 404, "not_found_error")


def test_queue_full(guarded):
    """The one slot held by a long gRPC request and no queue: /v1/messages is 529 overloaded_error with
    Retry-After (count_tokens needs no slot)."""
    channel = grpc.insecure_channel(guarded.target)
    stub = pb_grpc.TextGenerationStub(channel)
    holder = stub.Generate(
        pb.GenerateRequest(prompt="hold the slot", params=long_params()),
        metadata=(("authorization", f"Bearer {TOKEN}"),),
        timeout=120,
    )
    try:
        next(holder)  # the request has started: it holds the slot
        url = guarded.http_url
        r = httpx.post(url + "/v1/messages", json=body_of("/v1/messages"), headers=auth("/v1/messages"), timeout=30)
        assert_anthropic(r, 529, "overloaded_error")
        assert int(r.headers["retry-after"]) >= 1
        r = httpx.post(url + "/v1/chat/completions", json={"messages": HI}, headers=auth("/v1/messages"), timeout=30)
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
    finally:
        holder.cancel()
        channel.close()


def test_request_timeout(guarded):
    """A body that never completes within --request-timeout: 408 in Anthropic's shape from the request timer."""
    for route in ROUTES:
        with socket.create_connection(("127.0.0.1", guarded.server.http_port), timeout=10) as sock:
            head = f"POST {route} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            head += f"X-Api-Key: {TOKEN}\r\n"
            sock.sendall((head + "Content-Length: 100\r\n\r\n{").encode())
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        head, _, payload = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), data[:200]
        body = json.loads(payload)
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body


def test_not_ready(model_dir):
    """While the model loads: 503 overloaded_error on both routes (the OpenAI routes: not_ready)."""
    gate = threading.Event()

    def blocked_factory():
        gate.wait(60)
        raise RuntimeError("test: never loads")

    with running(base_config(model_dir), engine_factory=blocked_factory, wait_ready=False) as s:
        try:
            for route in ROUTES:
                r = httpx.post(s.http_url + route, json=body_of(route), timeout=10)
                assert_anthropic(r, 503, "overloaded_error")
            r = httpx.post(s.http_url + "/v1/completions", json={"prompt": "x"}, timeout=10)
            assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
        finally:
            gate.set()
            time.sleep(0.1)
