"""Hostile request bodies against a real server, on both doors: text that is not valid Unicode and absurdly deep
JSON are refused as 400 / INVALID_ARGUMENT naming the field (never a 500 / INTERNAL with a traceback), error
messages never echo a huge value back, and 16 MB bodies do not stall the event loop for other callers."""

from __future__ import annotations

import json
import math
import threading
import time

import grpc
import httpx
import pytest
from service_helpers import bad_request_field, params

from dgserve.service.http.body import decode_body
from dgserve.v1 import text_generation_pb2 as pb

GENERATE = "/dgserve.v1.TextGeneration/Generate"
BIG = 15 << 20  # under the 16 MB message limit, far over anything an error message should hold
SHORT = 4096  # the most an error body may take (its message is capped at 2048 characters)


def post(http, path: str, body: bytes) -> httpx.Response:
    return http.post(path, content=body, headers={"content-type": "application/json"})


def error_param(r: httpx.Response) -> str | None:
    return r.json()["error"]["param"]


def raw_generate(channel, data: bytes, timeout: float = 60) -> grpc.RpcError | None:
    """Send serialized bytes as a GenerateRequest; the error, or None when the call succeeded."""
    call = channel.unary_stream(GENERATE, request_serializer=None, response_deserializer=pb.GenerateResponse.FromString)
    try:
        list(call(data, timeout=timeout))
    except grpc.RpcError as e:
        return e
    return None


# ---------------------------------------------------------------------------------------------- invalid Unicode


@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/v1/completions", b'{"prompt": "ab\\ud800cd", "max_tokens": 16}', "prompt"),
        ("/v1/completions", b'{"prompt": ["\\udfff"], "max_tokens": 16}', "prompt[0]"),
        ("/v1/completions", b'{"prompt": "hi", "stop": ["\\ud800"], "max_tokens": 16}', "stop[0]"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\uDC00"}]}', "messages[0].content"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "x\\ud800"}]}]}',
            "messages[0].content[0].text",
        ),
        ("/v1/completions", b'{"prompt": "hi", "\\ud800": 1}', "body"),
        ("/v1/completions", b'{"prompt": "hi", "model": "\\ud800"}', "model"),
        ("/v1/completions", b'{"prompt": "hi", "response_format": {"type": "regex", "regex": "\\ud800"}}', None),
    ],
)
def test_lone_surrogate_is_a_400_naming_the_field(http, no_traceback, path, body, field):
    r = post(http, path, body)
    assert r.status_code == 400, r.text
    assert "lone surrogate" in r.json()["error"]["message"]
    assert error_param(r) == (field or "response_format.regex")


def test_utf8_encoded_surrogate_is_a_400(http, no_traceback):
    """Raw UTF-8 bytes of a surrogate (json.loads(bytes) would decode them with surrogatepass) are not UTF-8."""
    r = post(http, "/v1/completions", b'{"prompt": "\xed\xa0\x80", "max_tokens": 16}')
    assert r.status_code == 400 and error_param(r) == "body"


def test_surrogate_pair_is_ordinary_text(http):
    r = post(http, "/v1/completions", b'{"prompt": "\\ud83d\\ude00", "max_tokens": 16, "max_denoising_steps": 2}')
    assert r.status_code == 200, r.text


def test_invalid_utf8_string_field_over_grpc_is_invalid_argument(channel, no_traceback):
    """protobuf refuses a string field that is not UTF-8 (a surrogate's bytes): INVALID_ARGUMENT, not INTERNAL."""
    data = pb.GenerateRequest(prompt="abc", params=params()).SerializeToString()
    err = raw_generate(channel, data.replace(b"abc", b"\xed\xa0\x80"))
    assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_field(err) == "request"


# ---------------------------------------------------------------------------------------------- deep nesting


@pytest.mark.parametrize("depth", [129, 1_000, 100_000])
def test_deep_body_is_a_400(http, no_traceback, depth):
    body = b'{"prompt": "hi", "x": ' + b"[" * depth + b"]" * depth + b"}"
    r = post(http, "/v1/completions", body)
    assert r.status_code == 400 and error_param(r) == "body"
    assert "nests too deep; at most 128 levels" in r.json()["error"]["message"]


def test_deep_response_format_is_a_400(http, no_traceback):
    schema = b'{"type": "array", "items": ' * 900 + b"{}" + b"}" * 900
    body = b'{"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"schema": ' + schema + b"}}}"
    r = post(http, "/v1/completions", body)
    assert r.status_code == 400 and error_param(r) == "body"


def test_deep_chat_message_is_a_400(http, no_traceback):
    extra = b"[" * 1_000 + b"]" * 1_000
    body = b'{"messages": [{"role": "user", "content": "hi", "meta": ' + extra + b"}]}"
    r = post(http, "/v1/chat/completions", body)
    assert r.status_code == 400 and error_param(r) == "body"


def test_moderate_nesting_is_accepted(http):
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    body = {"prompt": "hi", "max_tokens": 16, "max_denoising_steps": 2, "response_format": {"type": "json_schema"}}
    body["response_format"]["json_schema"] = {"name": "x", "schema": schema}
    r = post(http, "/v1/completions", json.dumps(body).encode())
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------------------------------------- bounded echoes


def test_huge_model_name_gets_a_short_404(http, stub):
    name = "m" * BIG
    r = post(http, "/v1/completions", json.dumps({"model": name, "prompt": "hi"}).encode())
    assert r.status_code == 404 and len(r.content) < SHORT
    assert r.json()["error"]["message"].startswith("model: 'mmm") and f"({BIG} characters)" in r.text
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb.GenerateRequest(model=name, prompt="hi", params=params()), timeout=60))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and len(e.value.details()) < SHORT
    assert e.value.details().startswith("model: 'mmm")


def test_huge_unknown_field_gets_a_short_400(http):
    r = post(http, "/v1/completions", json.dumps({"prompt": "hi", "f" * BIG: "v" * 1000}).encode())
    assert r.status_code == 400 and len(r.content) < SHORT
    assert error_param(r).startswith("fff") and len(error_param(r)) < 100


def test_huge_path_gets_a_short_404(http):
    r = http.get("/" + "p" * 10_000)
    assert r.status_code == 404 and len(r.content) < SHORT


# ---------------------------------------------------------------------------------------------- no stalls

N = 16 << 20


def _grpc_bodies() -> list[bytes]:
    ids = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * (N // 2 - 64)), params=params())
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="")] * (N // 8 - 64))
    return [ids.SerializeToString(), pb.GenerateRequest(chat=chat, params=params()).SerializeToString()]


def _http_bodies() -> list[tuple[str, bytes]]:
    ids = json.dumps({"prompt": [1] * (N // 2 - 64)}, separators=(",", ":")).encode()
    chat = json.dumps({"messages": [{"role": "user", "content": ""}] * (N // 30)}, separators=(",", ":"))
    return [("/v1/completions", ids), ("/v1/chat/completions", chat.encode())]


def _reference_seconds(grpc_bodies: list[bytes], http_bodies: list[tuple[str, bytes]]) -> tuple[float, float]:
    """(decode, parse): the wall time, here and now (under whatever load the machine has), of the work big bodies
    cost the server: decoding the cheapest HTTP body (what the body thread does), and parsing every gRPC body the
    test sends (what grpc does on the event loop before the servicer sees a message)."""
    decode = math.inf
    for _, body in http_bodies:
        t0 = time.perf_counter()
        with pytest.raises(ValueError):  # too many values: refused, as the door refuses it
            decode_body(body)
        decode = min(decode, time.perf_counter() - t0)
    t0 = time.perf_counter()
    for data in grpc_bodies:
        pb.GenerateRequest.FromString(data)
    return decode, time.perf_counter() - t0


def _worst_small_call_while(send, bodies, small) -> float:
    """The longest a small call took while ``bodies`` were being sent (each by ``send`` in its own thread)."""
    senders = [threading.Thread(target=send, args=b if isinstance(b, tuple) else (b,)) for b in bodies]
    for t in senders:
        t.start()
    worst = 0.0
    while any(t.is_alive() for t in senders):
        worst = max(worst, small())
        time.sleep(0.02)
    for t in senders:
        t.join()
    return worst


def test_big_bodies_do_not_stall_small_calls(server, channel, stub, http):
    """While 16 MB bodies of small values (the costliest to decode: token ids, empty chat messages) arrive on
    either door, a small call does not wait for them. The bounds are ratios to the same work measured in this
    test under the same load (``_reference_seconds``), so a loaded machine slows both sides alike:

    * HTTP: a small call's worst latency stays under the time decoding one such body takes. Decoded on the event
      loop, a small call waits at least one whole decoding, and more as the bodies queue (measured: 3.7-5x the
      reference, idle and at load average 7); decoded in the body thread it waits a fraction of one (0.1-0.45x:
      the loop gets the GIL back every few ms).
    * gRPC: grpc parses each message on the event loop, so a small call may wait for the parses of the bodies
      in flight, at most all of them back to back (measured: 0.1-1.25x the time parsing them all takes); the
      bound is 3x that, for a stall of the loop well past grpc's own parsing.

    A stall built into the server shows in every attempt; a machine busy with something else for a second (one
    attempt in a full CI run on 2 cores once measured 7x on gRPC) rarely is twice running. So the test makes up to
    three attempts and passes on the first that keeps both bounds."""
    grpc_bodies, http_bodies = _grpc_bodies() * 2, _http_bodies() * 2

    def small() -> float:
        t0 = time.perf_counter()
        stub.Tokenize(pb.TokenizeRequest(prompt="hello"), timeout=30)
        http.get("/v1/models")
        return time.perf_counter() - t0

    def attempt() -> dict[str, float]:
        outcomes: list[object] = []

        def send_grpc(data):
            outcomes.append(raw_generate(channel, data))

        def send_http(path, body):
            with httpx.Client(base_url=str(http.base_url), timeout=60) as c:
                outcomes.append(post(c, path, body).status_code)

        decode_before, parse_before = _reference_seconds(grpc_bodies, http_bodies)
        worst_http = _worst_small_call_while(send_http, http_bodies, small)
        worst_grpc = _worst_small_call_while(send_grpc, grpc_bodies, small)
        decode_after, parse_after = _reference_seconds(grpc_bodies, http_bodies)
        assert len(outcomes) == len(grpc_bodies) + len(http_bodies)
        assert all(
            o == 400 or (isinstance(o, grpc.RpcError) and o.code() == grpc.StatusCode.INVALID_ARGUMENT)
            for o in outcomes
        )
        # the load may change during the attempt: the bounds take the slower of the two measurements
        decode, parse = max(decode_before, decode_after), max(parse_before, parse_after)
        return {"worst_http": worst_http, "decode": decode, "worst_grpc": worst_grpc, "parse": parse}

    attempts = []
    for _ in range(3):
        attempts.append(attempt())
        a = attempts[-1]
        if a["worst_http"] < a["decode"] and a["worst_grpc"] < 3 * a["parse"]:
            return
    pytest.fail(f"a small call waited past the bounds in every attempt (seconds): {attempts}")


def test_tokenizer_refuses_lone_surrogates_naming_the_field(model_dir):
    """The library's own check, for callers that do not come through a door (which refuses them first)."""
    from dgserve.text.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(model_dir)
    with pytest.raises(ValueError, match=r"^prompt: not valid Unicode \(lone surrogate U\+D800 at character 1\)"):
        tok.encode("a\ud800")
    with pytest.raises(ValueError, match=r"^messages\[0\]\.content: not valid Unicode"):
        tok.encode_chat([{"role": "user", "content": "\udc00"}])
    with pytest.raises(ValueError, match=r"^messages\[0\]\.content\[0\]\.text: not valid Unicode"):
        tok.encode_chat([{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}])
