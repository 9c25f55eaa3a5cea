"""Prefix caching on a real server (docs/prefix-caching.md): a conversation's second turn reuses the first's prompt
whichever door each came through, reports it (HTTP ``usage.prompt_tokens_details.cached_tokens``, gRPC
``Usage.cached_tokens``, Prometheus queried/hit token counters and the bytes held and evictions), returns the same
tokens as without reuse, and never shares blocks between authenticated callers."""

from __future__ import annotations

import contextlib
import json
import urllib.request

import grpc
import httpx
import openai
import pytest
from service_helpers import ServerThread, auth_config, base_config, metric_value, running, scrape_metrics

from dgserve import Engine, SamplingParams
from dgserve.engine.cache_config import CacheConfig
from dgserve.engine.scheduler import SchedulerConfig
from dgserve.model.cache import SlotCache
from dgserve.v1 import text_generation_pb2 as pb
from dgserve.v1 import text_generation_pb2_grpc as pb_grpc
from service.metrics import Metrics

CHUNK = 8  # the servers' prefill chunk: the prefix cache's block
SYSTEM = "You are a careful assistant. " * 12
KNOBS = {"max_denoising_steps": 4, "seed": 11}


def _chat(turns: int) -> list[dict]:
    msgs = [{"role": "system", "content": SYSTEM}]
    for i in range(turns):
        msgs.append({"role": "user", "content": f"question number {i}"})
        if i < turns - 1:
            msgs.append({"role": "assistant", "content": f"answer number {i}"})
    return msgs


@pytest.fixture(scope="module")
def servers(model_dir, tmp_path_factory):
    """Servers of their own (a prefill chunk of CHUNK): prefix caching on, off, and on behind two tokens."""
    configs = {
        "on": base_config(model_dir, prefill_chunk=CHUNK),
        "off": base_config(model_dir, prefill_chunk=CHUNK, prefix_caching=False),
        "auth": auth_config(
            model_dir, tmp_path_factory.mktemp("prefix-auth"), ("token-a", "token-b"), prefill_chunk=CHUNK
        ),
    }
    with contextlib.ExitStack() as stack:
        yield {name: stack.enter_context(running(c)) for name, c in configs.items()}


def _chat_call(s: ServerThread, messages: list[dict], token: str = "unused"):
    with openai.OpenAI(base_url=s.http_url + "/v1", api_key=token, max_retries=0, timeout=60) as client:
        return client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, extra_body=KNOBS)


def _shared(s: ServerThread, a: list[dict], b: list[dict]) -> int:
    """How many leading tokens two chats' rendered prompts share (``/tokenize`` renders as chat completions does)."""
    ids = [httpx.post(s.http_url + "/tokenize", json={"messages": m}, timeout=30).json()["tokens"] for m in (a, b)]
    n = 0
    while n < min(map(len, ids)) and ids[0][n] == ids[1][n]:
        n += 1
    return n


def _metric(s: ServerThread, name: str) -> float:
    return metric_value(scrape_metrics(s.server.http_port), name)


def test_second_turn_reuses_the_first_and_says_so(servers):
    on, off = servers["on"], servers["off"]
    q0, h0 = _metric(on, "dgserve_prefix_cache_queries_total"), _metric(on, "dgserve_prefix_cache_hits_total")
    first = _chat_call(on, _chat(1))
    second = _chat_call(on, _chat(2))
    u1, u2 = first.usage, second.usage
    assert u1.prompt_tokens_details.cached_tokens == 0
    cached = u2.prompt_tokens_details.cached_tokens
    # the whole chunks the two rendered prompts share (the template renders the first reply after the point where
    # the first prompt's generation prompt ends, so they share a little less than the first prompt)
    assert cached == _shared(on, _chat(1), _chat(2)) // CHUNK * CHUNK > 0
    assert cached < u2.prompt_tokens
    assert _metric(on, "dgserve_prefix_cache_queries_total") - q0 == u1.prompt_tokens + u2.prompt_tokens
    assert _metric(on, "dgserve_prefix_cache_hits_total") - h0 == cached
    # the same tokens as a server that reuses nothing
    plain = _chat_call(off, _chat(2))
    assert plain.usage.prompt_tokens_details.cached_tokens == 0
    assert plain.choices[0].message.content == second.choices[0].message.content
    assert _metric(off, "dgserve_prefix_cache_queries_total") == 0
    # the bytes the cache holds: whole blocks, within what the slots leave of the budget
    held, cap = _metric(on, "dgserve_prefix_cache_bytes"), _metric(on, "dgserve_prefix_cache_capacity_bytes")
    assert 0 < held <= cap and held % _metric(on, "dgserve_prefix_cache_blocks") == 0
    assert "dgserve_prefix_cache_bytes" not in urllib.request.urlopen(off.http_url + "/metrics").read().decode()


def test_metrics_follow_the_bytes_held_and_the_evictions(model_dir):
    """An engine whose budget leaves the prefix cache room for three blocks: the gauge follows the bytes held, the
    counters the blocks evicted and stripped, read at scrape time as the server reads them."""
    sched = SchedulerConfig(max_num_seqs=2, prefill_chunk=CHUNK, max_prefill_tokens=CHUNK)
    probe = Engine.from_pretrained(model_dir, scheduler_config=sched, cache_config=CacheConfig(memory=1 << 30))
    cfg, dtype = probe.model.config, probe.model.dtype
    block = CHUNK * SlotCache.position_bytes(cfg, dtype)
    slots = 2 * SlotCache.bytes_per_slot(cfg, probe.max_model_len, probe.runner.chunk, dtype)
    eng = Engine(
        probe.model, probe.tokenizer, scheduler_config=sched, cache_config=CacheConfig(memory=slots + 3 * block)
    )
    metrics = Metrics()
    metrics.track_engine(lambda: 0, lambda: 0, 2, eng.kv_cache_usage, eng.prefix_cache_stats)
    assert metrics.value("dgserve_prefix_cache_capacity_bytes") == 3 * block
    assert metrics.value("dgserve_prefix_cache_bytes") == 0
    for i in range(4):  # distinct prompts of 2 whole blocks each: the third evicts
        eng.generate([5 + i] * (2 * CHUNK + 1), SamplingParams(max_new_tokens=16, max_denoising_steps=2, seed=i))
        stats = eng.prefix_cache_stats()
        assert stats is not None and 0 < stats.held_bytes <= 3 * block
        assert metrics.value("dgserve_prefix_cache_bytes") == stats.held_bytes
        assert metrics.value("dgserve_prefix_cache_blocks") == stats.blocks
    assert metrics.value("dgserve_prefix_cache_evictions_total") == stats.evicted_blocks > 0
    assert metrics.value("dgserve_prefix_cache_sliding_dropped_total") == stats.dropped_sliding


def test_reuse_crosses_the_doors_and_streams_report_it(servers):
    on = servers["on"]
    prompt = "a prompt long enough for a few chunks of the prefix cache, shared by both doors " * 3
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, **KNOBS}
    r = httpx.post(on.http_url + "/v1/completions", json=body, timeout=60).json()
    n = r["usage"]["prompt_tokens"]
    with grpc.insecure_channel(on.target) as ch:
        stub = pb_grpc.TextGenerationStub(ch)
        p = pb.SamplingParams(max_new_tokens=16, max_denoising_steps=4, seed=11)
        events = list(stub.Generate(pb.GenerateRequest(prompt=prompt, params=p)))
    fin = events[-1].finished
    assert fin.usage.prompt_tokens == n and fin.usage.cached_tokens == n // CHUNK * CHUNK > 0
    streamed = httpx.post(
        on.http_url + "/v1/completions",
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
        timeout=60,
    ).text
    chunks = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
    (usage,) = [c["usage"] for c in chunks if c.get("usage")]
    assert usage["prompt_tokens_details"] == {"cached_tokens": n // CHUNK * CHUNK}


def test_authenticated_callers_never_share_blocks(servers):
    s = servers["auth"]
    msgs = _chat(1) + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "isolation"}]
    assert _chat_call(s, msgs, "token-a").usage.prompt_tokens_details.cached_tokens == 0
    assert _chat_call(s, msgs, "token-b").usage.prompt_tokens_details.cached_tokens == 0
    again = _chat_call(s, msgs, "token-a").usage
    assert again.prompt_tokens_details.cached_tokens == again.prompt_tokens // CHUNK * CHUNK > 0


def test_cache_salt_isolates_requests_on_both_doors(servers):
    on = servers["on"]
    prompt = "salted prompts are cached apart from everything else, " * 4
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, **KNOBS}

    def http(**extra) -> dict:
        return httpx.post(on.http_url + "/v1/completions", json={**body, **extra}, timeout=60).json()

    n = http(cache_salt="tenant-1")["usage"]["prompt_tokens"]
    assert http()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the shared cache had nothing
    assert http(cache_salt="tenant-2")["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert http(cache_salt="tenant-1")["usage"]["prompt_tokens_details"]["cached_tokens"] == n // CHUNK * CHUNK
    with grpc.insecure_channel(on.target) as ch:
        stub = pb_grpc.TextGenerationStub(ch)
        p = pb.SamplingParams(max_new_tokens=16, max_denoising_steps=4, seed=11)
        fin = list(stub.Generate(pb.GenerateRequest(prompt=prompt, params=p, cache_salt="tenant-2")))[-1].finished
        assert fin.usage.cached_tokens == n // CHUNK * CHUNK  # HTTP's tenant-2 request cached it
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pb.GenerateRequest(prompt=prompt, params=p, cache_salt="x" * 300)))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cache_salt" in (e.value.details() or "")
    bad = httpx.post(on.http_url + "/v1/completions", json={**body, "cache_salt": ""}, timeout=60)
    assert bad.status_code == 400 and "cache_salt" in bad.text
    bad = httpx.post(on.http_url + "/v1/completions", json={**body, "cache_salt": 5}, timeout=60)
    assert bad.status_code == 400 and "cache_salt" in bad.text
