"""--max-request-seconds on a live server: a request running past it (counted from its admission into a slot, or
a gRPC deadline when sooner) ends with finish reason "length" on both doors, keeping what it committed; its slot
is freed and a request running beside it gives the tokens it gives alone."""

from __future__ import annotations

import threading
import time

import grpc
import httpx
import pytest
from service_helpers import HANG_GUARD_S, base_config, long_params, params, running, wait_until

from dgserve.v1 import text_generation_pb2 as pb
from dgserve.v1 import text_generation_pb2_grpc as pb_grpc

LIMIT_S = 1.0
LONG = long_params(max_denoising_steps=2)  # blocks of two steps: some commit within the limit, even on a busy CPU


@pytest.fixture(scope="module")
def limited(model_dir):
    """A server of its own: a time limit per request, two slots."""
    with running(base_config(model_dir, max_request_seconds=LIMIT_S, max_num_seqs=2)) as s:
        yield s


@pytest.fixture(scope="module")
def stub(limited):
    ch = grpc.insecure_channel(limited.target)
    yield pb_grpc.TextGenerationStub(ch)
    ch.close()


def _tokens(events) -> list[int]:
    return [t for e in events if e.HasField("block") for t in e.block.token_ids]


def test_a_request_past_its_time_ends_with_length_and_others_are_unaffected(limited, stub):
    short = pb.GenerateRequest(prompt="beside it", params=params(seed=11))
    alone = _tokens(stub.Generate(short, timeout=60))
    out: dict = {}

    def run_long():
        t0 = time.monotonic()
        out["events"] = list(stub.Generate(pb.GenerateRequest(prompt="long", params=LONG), timeout=60))
        out["took"] = time.monotonic() - t0

    t = threading.Thread(target=run_long)
    t.start()
    wait_until(lambda: limited.engine.num_running == 1)
    beside = _tokens(stub.Generate(short, timeout=60))  # runs while the long one holds the other slot
    assert limited.engine.num_running == 1
    t.join(60)
    long, took = out["events"], out["took"]
    fin = long[-1].finished
    # ended by the limit: not before it (a loaded machine only makes it later), and with "length" before its
    # 3200 tokens, keeping what it committed; no upper bound on the time, the cut itself is the event
    assert fin.finish_reason == pb.FINISH_REASON_LENGTH and took >= LIMIT_S, took
    tokens = _tokens(long)
    assert 0 < len(tokens) < 16 * 200 and fin.usage.completion_tokens == len(tokens)  # what it committed
    assert beside == alone
    wait_until(lambda: limited.engine.num_running == 0 and limited.engine.num_waiting == 0)


def test_http_requests_get_the_server_limit(limited):
    """OpenAI clients send no deadline: the server's limit applies, with OpenAI's "length"."""
    body = {"prompt": "long", "max_tokens": 16 * 200, "max_denoising_steps": 2, "ignore_eos": True, "seed": 1}
    r = httpx.post(limited.http_url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["choices"][0]["finish_reason"] == "length" and 0 < got["usage"]["completion_tokens"] < 16 * 200
    wait_until(lambda: limited.engine.num_running == 0)


def _deadline_aborts(server) -> float:
    return server.server.metrics.value("dgserve_request_aborted_total", {"reason": "deadline"})


def test_a_grpc_deadline_sooner_than_the_limit_ends_the_request_sooner(limited, stub):
    aborts = _deadline_aborts(limited)
    lengths = limited.server.metrics.value("dgserve_request_finish_total", {"reason": "length"})
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb.GenerateRequest(prompt="long", params=long_params()), timeout=0.4))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # freed by the deadline, not by the server's limit: the request is aborted (the abort counted once the engine
    # dropped it, its slot free then) and never ends with the limit's "length"
    wait_until(lambda: _deadline_aborts(limited) == aborts + 1, timeout=HANG_GUARD_S)
    assert limited.engine.num_running == 0
    assert limited.server.metrics.value("dgserve_request_finish_total", {"reason": "length"}) == lengths
