"""The OpenAI-compatible HTTP front door against a real server (uvicorn on the grpc.aio server's event loop,
real sockets): the official ``openai`` client (sync and streaming; completions and chat), raw SSE with httpx, the
same seeded request over HTTP and gRPC giving the same tokens, every error status, X-Request-Id, bearer auth,
overload, loading, a client that disconnects mid-stream, and drain."""

from __future__ import annotations

import asyncio
import json
import logging
import threading

import grpc
import httpx
import openai
import pytest
from service_helpers import auth_config, base_config, long_params, params, post_then_hang_up, running, wait_until

from dgserve.v1 import text_generation_pb2 as pb
from dgserve.v1 import text_generation_pb2_grpc as pb_grpc

KNOBS = {"max_denoising_steps": 4}
# every block runs all 16 steps (no early stop): an unread draft is dropped when its block commits, so give the
# reader many steps per block to see one even on a loaded machine
SLOW_BLOCKS = {"max_denoising_steps": 16, "confidence_threshold": 1e-30}


def grpc_text(stub, **request) -> tuple[str, pb.Finished, list[int]]:
    events = list(stub.Generate(pb.GenerateRequest(**request), timeout=60))
    blocks = [e.block for e in events if e.HasField("block")]
    return "".join(b.text for b in blocks), events[-1].finished, [len(b.token_ids) for b in blocks]


# ---------------------------------------------------------------------------------------------- happy paths


def test_models_lists_the_served_name_and_aliases(openai_client):
    assert [m.id for m in openai_client.models.list().data] == ["tiny", "tiny-alias"]


def test_completion_equals_grpc_generate_for_the_same_seed(openai_client, stub):
    text, fin, _ = grpc_text(stub, prompt="hello there", params=params(max_new_tokens=40, seed=11))
    r = openai_client.completions.create(model="tiny", prompt="hello there", max_tokens=40, seed=11, extra_body=KNOBS)
    assert r.choices[0].text == text and len(text) > 0
    assert r.usage.completion_tokens == fin.usage.completion_tokens == 40
    assert r.usage.prompt_tokens == fin.usage.prompt_tokens
    assert r.choices[0].finish_reason == "length"
    assert r.model == "tiny" and r.model_extra["dgserve"]["seed"] == 11
    assert sum(b["tokens"] for b in r.model_extra["dgserve"]["blocks"]) == 40


def test_token_id_prompt_and_alias(openai_client, stub):
    text, _, _ = grpc_text(stub, token_ids=pb.TokenIds(ids=[5, 6, 7]), params=params(max_new_tokens=20, seed=3))
    r = openai_client.completions.create(model="tiny-alias", prompt=[5, 6, 7], max_tokens=20, seed=3, extra_body=KNOBS)
    assert r.choices[0].text == text and r.model == "tiny-alias"


def test_chat_equals_grpc_chat_and_streams_one_chunk_per_block(openai_client, stub):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    text, fin, sizes = grpc_text(
        stub,
        chat=pb.Chat(messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages]),
        params=params(max_new_tokens=48, seed=5),
    )
    r = openai_client.chat.completions.create(
        model="tiny", messages=messages, max_completion_tokens=48, seed=5, extra_body=KNOBS
    )
    assert r.choices[0].message.content == text and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == fin.usage.completion_tokens
    stream = openai_client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_completion_tokens=48,
        seed=5,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=KNOBS,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(c.choices[0].delta.content for c in content) == text
    blocks = [c for c in chunks if c.choices and (c.model_extra.get("dgserve") or {}).get("block")]
    assert [c.model_extra["dgserve"]["block"]["tokens"] for c in blocks] == sizes  # one chunk per block
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finals] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == fin.usage.completion_tokens


def test_stop_string_gives_stop_and_cuts_the_text(openai_client):
    full = openai_client.completions.create(model="tiny", prompt="stop test", max_tokens=48, seed=2, extra_body=KNOBS)
    text = full.choices[0].text
    stop = next(
        (
            text[i : i + 2]
            for i in range(4, len(text) - 2)
            if text[i : i + 2].strip() == text[i : i + 2] and "\ufffd" not in text[i : i + 2]
        ),
        None,
    )
    if stop is None:
        pytest.skip("no usable two-character stop string in this output")
    r = openai_client.completions.create(
        model="tiny", prompt="stop test", max_tokens=48, seed=2, stop=[stop], extra_body=KNOBS
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[: text.index(stop)]


def test_raw_sse_frames_seed_header_and_drafts(url):
    # ignore_eos: no seed is given, so the draw is random; without it an early EOS would end the stream "stop"
    body = {
        "prompt": "raw",
        "max_tokens": 40,
        "stream": True,
        "drafts": {"every_n_steps": 1},
        "ignore_eos": True,
        **SLOW_BLOCKS,
    }
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        seed = int(r.headers["x-dgserve-seed"])
        raw = r.read().decode()
    frames = raw.split("\n\n")
    assert frames[-1] == "" and frames[-2] == "data: [DONE]"
    events = []
    for frame in frames[:-2]:
        lines = frame.split("\n")
        kind = lines[0].removeprefix("event: ") if lines[0].startswith("event: ") else None
        (data,) = [ln.removeprefix("data: ") for ln in lines if ln.startswith("data: ")]
        events.append((kind, json.loads(data)))
    drafts = [d for k, d in events if k == "dgserve.draft"]
    assert drafts and all(d["choices"] == [] and "token_ids" in d["dgserve"]["draft"] for d in drafts)
    plain = [d for k, d in events if k is None]
    assert plain[-1]["choices"][0]["finish_reason"] == "length"
    assert plain[-1]["dgserve"]["seed"] == seed  # no seed asked: the one used, in header and body
    again = httpx.post(
        url + "/v1/completions",
        timeout=60,
        json={"prompt": "raw", "max_tokens": 40, "seed": seed, "ignore_eos": True, **SLOW_BLOCKS},
    ).json()
    assert again["choices"][0]["text"] == "".join(d["choices"][0]["text"] for d in plain)


def test_official_client_skips_draft_events(openai_client):
    """Drafts are typed SSE events whose chunks have no choices: the official client yields no text for them."""
    kw = dict(model="tiny", prompt="drafts", max_tokens=40, seed=9, stream=True)
    plain = "".join(
        c.choices[0].text for c in openai_client.completions.create(**kw, extra_body=SLOW_BLOCKS) if c.choices
    )
    chunks = list(openai_client.completions.create(**kw, extra_body={**SLOW_BLOCKS, "drafts": {"include_text": True}}))
    assert any(not c.choices for c in chunks)  # the drafts reached the client
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain


def test_request_id_in_and_out(url):
    r = httpx.post(
        url + "/v1/completions",
        headers={"X-Request-Id": "my-request-1"},
        timeout=60,
        json={"prompt": "id", "max_tokens": 8, "max_denoising_steps": 2},
    )
    assert r.status_code == 200 and r.headers["x-request-id"] == "my-request-1" and r.json()["id"] == "my-request-1"
    r = httpx.post(
        url + "/v1/completions",
        headers={"X-Request-Id": "x" * 300},
        timeout=60,
        json={"prompt": "id", "max_tokens": 8},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Id"


# ---------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"n": 17}, "n"),
        ({"logprobs": 2}, "logprobs"),
        ({"top_p": 0.9}, "top_p"),
        ({"seed": -1}, "seed"),
        ({"t_max": 0.1}, "t_max"),
        ({"stop": [1]}, "stop[0]"),
        ({"best_of": 3}, "best_of"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": [10**9]}, "prompt[0]"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_bad_completion_fields_are_400_naming_the_field(url, extra, param):
    r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 8, **extra}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and param in err["message"]


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content[0].image_url.url",
        ),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": []}, "messages"),
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize"),
    ],
)
def test_bad_chat_fields_are_400_naming_the_field(url, extra, param):
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 8, **extra}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_official_client_errors(openai_client):
    with pytest.raises(openai.NotFoundError) as e:
        openai_client.completions.create(model="nope", prompt="x", max_tokens=4)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], logprobs=True)
    assert e.value.body["param"] == "logprobs"


def test_not_json_and_unknown_route(url):
    r = httpx.post(
        url + "/v1/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"
    r = httpx.get(url + "/v1/nothing", timeout=30)
    assert r.status_code == 404 and "error" in r.json()


# ---------------------------------------------------------------------------------------------- a guarded server


@pytest.fixture(scope="module")
def guarded(model_dir, tmp_path_factory):
    """Bearer auth, a 4 KiB body limit, one running request and no queue."""
    lines = ("# accepted", "secret-a", "secret-b")  # the token file's comment line is skipped
    limits = dict(max_message_bytes=4096, max_num_seqs=1, max_queue_len=0)
    with running(auth_config(model_dir, tmp_path_factory.mktemp("auth"), lines, **limits)) as s:
        yield s


def test_bearer_auth_matches_the_grpc_rule(guarded):
    url = guarded.http_url
    for token in ("secret-a", "secret-b"):
        c = openai.OpenAI(base_url=url + "/v1", api_key=token, max_retries=0)
        assert [m.id for m in c.models.list().data] == ["tiny", "tiny-alias"]
    bad = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="tiny", prompt="x", max_tokens=4)
    r = httpx.post(url + "/v1/chat/completions", json={"messages": []}, timeout=30)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    for path in ("/v1/health/live", "/v1/health/ready", "/metrics"):  # exempt, as gRPC health is
        assert httpx.get(url + path, timeout=30).status_code == 200
    ch = grpc.insecure_channel(guarded.target)
    with pytest.raises(grpc.RpcError) as e:
        list(pb_grpc.TextGenerationStub(ch).Generate(pb.GenerateRequest(prompt="x", params=params()), timeout=30))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    ch.close()


def test_oversized_body_is_413(guarded):
    r = httpx.post(
        guarded.http_url + "/v1/completions",
        headers={"Authorization": "Bearer secret-a"},
        json={"prompt": "x" * 8000},
        timeout=30,
    )
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"


def test_overload_is_429_with_retry_after_shared_with_grpc(guarded):
    """One admission limit for both front doors: a gRPC stream holds the only slot, HTTP gets 429."""
    ch = grpc.insecure_channel(guarded.target)
    stub = pb_grpc.TextGenerationStub(ch)
    call = stub.Generate(
        pb.GenerateRequest(prompt="hold", params=long_params()), metadata=(("authorization", "Bearer secret-a"),)
    )
    try:
        assert next(call).HasField("started")
        c = openai.OpenAI(base_url=guarded.http_url + "/v1", api_key="secret-b", max_retries=0)
        with pytest.raises(openai.RateLimitError) as e:
            c.completions.create(model="tiny", prompt="x", max_tokens=4)
        assert int(e.value.response.headers["retry-after"]) >= 1
    finally:
        call.cancel()
        ch.close()
    wait_until(lambda: guarded.engine.num_running == 0)


# ------------------------------------------------------------------------------------------- disconnect, loading, drain


def test_disconnect_mid_stream_frees_the_slot(server, url):
    eng = server.engine
    aborted = server.server.metrics.value("dgserve_request_aborted_total", {"reason": "client_cancelled"})
    body = {"prompt": "long", "stream": True, "max_tokens": 16 * 200, "ignore_eos": True, "max_denoising_steps": 8}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            assert eng.num_running == 1
    # the connection is closed: the slot is freed at once, not after the next block would be written. The abort is
    # counted once the engine dropped the request, so the slot is free when the count moves (no clock involved)
    cancelled = {"reason": "client_cancelled"}
    wait_until(lambda: server.server.metrics.value("dgserve_request_aborted_total", cancelled) == aborted + 1)
    assert eng.num_running == 0 and eng.num_waiting == 0


def test_client_giving_up_on_a_non_streaming_request_frees_the_slot(server, url):
    eng = server.engine
    cancelled = {"reason": "client_cancelled"}
    aborted = server.server.metrics.value("dgserve_request_aborted_total", cancelled)
    body = {"prompt": "long", "max_tokens": 16 * 200, "ignore_eos": True, "max_denoising_steps": 8}
    post_then_hang_up(url, "/v1/completions", body, lambda: eng.num_running == 1)
    # freed by the disconnect (counted as a client cancel, the slot free at that moment), not by finishing its
    # 3200 tokens
    wait_until(lambda: server.server.metrics.value("dgserve_request_aborted_total", cancelled) == aborted + 1)
    assert eng.num_running == 0 and eng.num_waiting == 0


def test_loading_is_503_and_live(model_dir):
    gate = threading.Event()

    def slow_factory():
        from dgserve import Engine

        gate.wait(60)
        return Engine.from_pretrained(model_dir)

    with running(base_config(model_dir), engine_factory=slow_factory, wait_ready=False) as s:
        try:
            url = s.http_url
            assert httpx.get(url + "/v1/health/live", timeout=10).status_code == 200
            assert httpx.get(url + "/v1/health/ready", timeout=10).status_code == 503
            r = httpx.post(url + "/v1/completions", json={"prompt": "x"}, timeout=10)
            assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
            gate.set()
            s.call(s.server.loaded.wait, timeout=120)
            assert httpx.get(url + "/v1/health/ready", timeout=10).status_code == 200
        finally:
            gate.set()  # the factory returns before the server stops


def test_drain_finishes_running_http_streams_and_refuses_new_ones(model_dir):
    with running(base_config(model_dir)) as s:
        url = s.http_url
        body = {"prompt": "drain", "stream": True, "max_tokens": 16 * 12, "ignore_eos": True, "max_denoising_steps": 8}
        with httpx.Client(timeout=60) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            drained = asyncio.run_coroutine_threadsafe(s.server.drain(20), s.loop)
            wait_until(lambda: s.server.state.draining)
            assert httpx.get(url + "/v1/health/ready", timeout=10).status_code == 503
            new = httpx.post(url + "/v1/completions", json={"prompt": "new"}, timeout=10)
            assert new.status_code == 503 and new.json()["error"]["code"] == "draining"
            rest = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert rest[-1]["choices"][0]["finish_reason"] == "length"
        drained.result(30)


def test_drain_past_the_grace_ends_sse_streams_with_abort_then_done(model_dir, caplog):
    """A stream that outlives the drain grace gets a last chunk with finish_reason "abort", then [DONE]; no
    traceback is logged."""
    with running(base_config(model_dir)) as s:
        url = s.http_url
        body = {
            "prompt": "forever",
            "stream": True,
            "max_tokens": 16 * 200,
            "ignore_eos": True,
            "max_denoising_steps": 8,
        }
        with httpx.Client(timeout=60) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            drained = asyncio.run_coroutine_threadsafe(s.server.drain(0.5), s.loop)
            rest = [line for line in lines if line.startswith("data: ")]
        chunks = [json.loads(line[6:]) for line in rest if line.startswith("data: {")]
        assert rest[-1] == "data: [DONE]" and chunks[-1]["choices"][0]["finish_reason"] == "abort"
        drained.result(30)
        assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
