"""No client behaviour crashes the server: a storm of streams ended at random points — cancelled at
once, after Started, after a Block, after a random delay, left early through our own client's ``generate()``,
cut by deadlines, stopped by Abort — against a real server process. Afterwards the process is alive and SERVING,
gives the same seeded tokens, its RSS grew little, and the metrics counted every kind of ending."""

from __future__ import annotations

import grpc
import pytest
import storm
from service_helpers import metric_value, scrape_metrics

from dgserve.client import Client


@pytest.fixture(scope="module")
def server_process(model_dir):
    srv = storm.ServerProcess(model_dir, "--max-num-seqs", "4", "--max-queue-len", "64")
    yield srv
    srv.kill()


def _metric(port: int, name: str, **labels) -> float:
    """A sample's value from the server's /metrics (0 when absent)."""
    return metric_value(scrape_metrics(port), name, **labels)


def test_storm_of_ended_streams(server_process):
    srv = server_process
    with grpc.insecure_channel(srv.target) as ch:
        stub = storm.stub_for(ch)
        tokens = storm.seeded_tokens(stub)
        warm = storm.storm(stub, srv.target, 60, seed=1)  # allocators and caches reach their working size
        assert srv.alive, f"exit {srv.proc.returncode}: " + "".join(srv.lines[-40:])
        before = srv.stats()
        seen = storm.storm(stub, srv.target, 300, seed=2)
        assert srv.alive, f"exit {srv.proc.returncode}: " + "".join(srv.lines[-40:])
        after = srv.stats()
        bad = {k: v for k, v in (warm + seen).items() if k[1] not in storm.STREAM_CODES}
        assert not bad, bad
        assert {mode for mode, _ in seen} == set(storm.MODES)
        assert Client(srv.target).health() == "SERVING"
        assert storm.seeded_tokens(stub) == tokens
    assert after["rss_mb"] - before["rss_mb"] < 60, (before, after)
    assert after["fds"] - before["fds"] < 20 and after["threads"] - before["threads"] < 8, (before, after)
    # every ending was accounted with its own code; nothing is left running
    port = srv.http_port
    assert _metric(port, "dgserve_rpc_total", method="Generate", code="CANCELLED") > 0
    assert _metric(port, "dgserve_rpc_total", method="Generate", code="DEADLINE_EXCEEDED") > 0
    assert _metric(port, "dgserve_rpc_total", method="Abort", code="OK") > 0
    assert _metric(port, "dgserve_num_requests_running") == 0 and _metric(port, "dgserve_num_requests_waiting") == 0


def test_malformed_calls_leave_server_healthy(server_process):
    srv = server_process
    with grpc.insecure_channel(srv.target) as ch:
        codes = storm.fuzz(ch, 400, seed=3)
        assert srv.alive, "".join(srv.lines[-40:])
        assert set(codes) <= storm.FUZZ_CODES, codes
        assert codes["INVALID_ARGUMENT"] > 0
        assert Client(srv.target).health() == "SERVING"
