"""The model-server protocol an inference gateway's endpoint picker reads (docs/deployment.md, "Inference gateway"),
against a real server process: requests running and waiting and the KV cache utilisation rise while requests run
(two slots, four streams: two wait) and return to 0 once they end; the same readings under the vLLM names the
picker reads by default; /health and /v1/models answer."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import storm
from service_helpers import http_status, long_params, scrape_metrics

from dgserve.v1 import text_generation_pb2 as pb

RUNNING = ("dgserve_num_requests_running", "vllm:num_requests_running")
WAITING = ("dgserve_num_requests_waiting", "vllm:num_requests_waiting")
KV = ("dgserve_kv_cache_usage_perc", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
SLOTS, STREAMS = 2, 4


@pytest.fixture(scope="module")
def server_process(model_dir):
    srv = storm.ServerProcess(model_dir, "--max-num-seqs", str(SLOTS), "--max-queue-len", "16")
    yield srv
    srv.kill()


def scrape(port: int) -> dict[str, float]:
    """Every unlabelled sample of the server's /metrics."""
    return {s.name: s.value for s in scrape_metrics(port) if not s.labels}


def poll(port: int, condition, timeout: float = 20.0) -> dict[str, float]:
    """Scrape until ``condition(sample)`` holds; the last sample in the failure message."""
    end = time.monotonic() + timeout
    while True:
        m = scrape(port)
        if condition(m):
            return m
        if time.monotonic() > end:
            picked = {k: m.get(k) for k in RUNNING + WAITING + KV}
            raise AssertionError(f"condition not met within {timeout} s: {picked}")
        time.sleep(0.05)


def busy(m: dict[str, float]) -> bool:
    """Every slot running, the rest waiting, some KV cache held: under the dgserve names and the vLLM ones alike
    (a scrape reads each gauge in turn, so the KV figures may differ when a block committed in between)."""
    return (
        all(m[n] == SLOTS for n in RUNNING)
        and all(m[n] == STREAMS - SLOTS for n in WAITING)
        and len({m[n] for n in KV}) == 1
        and m[KV[0]] > 0
    )


def test_picker_gauges_follow_running_and_waiting_requests(server_process):
    srv = server_process
    port = srv.http_port
    assert http_status(port, "/health") == 200 and http_status(port, "/v1/models") == 200
    idle = scrape(port)
    assert all(idle[n] == 0 for n in RUNNING + WAITING + KV), idle

    calls = []

    def consume(call) -> None:
        try:
            for _ in call:  # Started, then blocks, until cancelled
                pass
        except grpc.RpcError:
            pass

    with grpc.insecure_channel(srv.target) as ch:
        stub = storm.stub_for(ch)
        readers = []
        for i in range(STREAMS):
            call = stub.Generate(pb.GenerateRequest(prompt=f"gateway {i}", params=long_params(seed=i)), timeout=60)
            calls.append(call)
            readers.append(threading.Thread(target=consume, args=(call,), daemon=True))
            readers[-1].start()
        try:
            m = poll(port, busy)
            assert 0 < m[KV[0]] <= 1, m[KV[0]]
        finally:
            for call in calls:
                call.cancel()
            for t in readers:
                t.join(30)
        poll(port, lambda m: all(m[n] == 0 for n in RUNNING + WAITING + KV))
    assert srv.alive, "".join(srv.lines[-40:])
