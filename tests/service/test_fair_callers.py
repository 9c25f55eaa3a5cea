"""Fair shares between callers through the real server (docs/architecture.md, "Fair shares between callers"): with
auth on, a caller holding every running slot with two ``n`` requests cannot starve another caller, whose short
request starts within one block of the running batch and runs within 3x its time alone (measured in the same
run); behind a trusted gateway, ``caller_header`` keys callers by a header. Ratios and block counts, never
wall-clock bounds."""

from __future__ import annotations

import threading
import time

import grpc
import httpx
import pytest
from service_helpers import auth_config, base_config, params, pb, running, wait_until

from dgserve.v1 import text_generation_pb2_grpc as pb_grpc

SLOTS = 8
A, B = "token-a", "token-b"


def _hold_slots(url: str, token: str | None, stop: threading.Event, headers: dict | None = None) -> list:
    """Two streaming completions of ``n`` = SLOTS / 2 long choices each, read in threads until ``stop``."""
    body = {
        "prompt": "the quick brown fox",
        "n": SLOTS // 2,
        "max_tokens": 4000,
        "stream": True,
        "ignore_eos": True,
        "max_denoising_steps": 8,
        "seed": 1,
    }
    hdrs = dict(headers or {})
    if token is not None:
        hdrs["authorization"] = f"Bearer {token}"

    def read() -> None:
        with httpx.stream("POST", url + "/v1/completions", json=body, headers=hdrs, timeout=120) as r:
            assert r.status_code == 200
            for _ in r.iter_lines():
                if stop.is_set():
                    return

    threads = [threading.Thread(target=read, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    return threads


def _short(stub, metadata) -> float:
    """A 4-token Generate: the seconds from its admission to its finish, as the server timed them (Finished's
    timing: total less queue), so the client's own delivery and reading are not counted."""
    req = pb.GenerateRequest(prompt="hi", params=params(max_new_tokens=4, max_denoising_steps=8, seed=3))
    for ev in stub.Generate(req, metadata=metadata, timeout=120):
        if ev.WhichOneof("event") == "finished":
            t = ev.finished.timing
            return (t.total_ms - t.queue_ms) / 1000
    raise AssertionError("no Finished event")


def _blocks(engine, caller: str | None) -> dict:
    """{request id: committed blocks} of the in-flight requests of ``caller`` (its Request.caller)."""
    return {r.request_id: len(r.blocks) for r in engine.engine.in_flight() if r.caller == caller}


def _watch_admission(engine, holders: set, seen: dict) -> None:
    """Fill ``seen`` with the holder's committed blocks at the moment another caller's request is admitted."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not seen:
        others = [r for r in engine.engine.in_flight() if r.caller not in holders]
        if others and others[0].admitted_at is not None:
            seen.update(_blocks(engine, next(iter(holders))))
        time.sleep(0.0005)


def _starved_caller_is_served(
    server, stub, metadata_b: tuple, holder: str | None, holder_token: str | None, headers: dict | None = None
) -> None:
    """The holder fills every slot; the other caller (``metadata_b``) starts within one block of the holder's
    requests and runs within 3x its time alone (up to three attempts: a loaded machine may slow one). Times are
    the server's own, from admission to finish (the client's delivery is not the scheduler's), best of three each
    way; on the CPU the fair share of the compute makes it about 2x (one canvas of each caller per iteration)."""
    alone = min(_short(stub, metadata_b) for _ in range(3))
    for attempt in range(3):
        stop = threading.Event()
        threads = _hold_slots(server.http_url, holder_token, stop, headers)
        try:
            wait_until(lambda: server.engine.num_running == SLOTS, timeout=60)
            engine = server.engine
            holders = {r.caller for r in engine.engine.in_flight()}
            assert len(holders) == 1 and (holder is None or holder in holders)
            before = _blocks(engine, next(iter(holders)))
            seen: dict = {}
            watcher = threading.Thread(target=_watch_admission, args=(engine, holders, seen), daemon=True)
            watcher.start()
            run_s = _short(stub, metadata_b)
            watcher.join(5)
            # two more while the holder still holds its share: the best of three, as the time alone is
            run_s = min([run_s, *(_short(stub, metadata_b) for _ in range(2))])
        finally:
            stop.set()
            for t in threads:
                t.join(30)
        grew = max(seen.get(k, before[k]) - before[k] for k in before)
        assert grew <= 1, f"the other caller started after {grew} blocks of the running batch"
        if run_s <= 3 * alone:
            return
        print(f"attempt {attempt}: {run_s:.3f} s with the holder running, {alone:.3f} s alone")
    raise AssertionError(f"the other caller's request ran {run_s / alone:.1f}x its time alone (bound 3x)")


def test_a_caller_holding_every_slot_does_not_starve_another(model_dir, tmp_path):
    cfg = auth_config(model_dir, tmp_path, (A, B), max_num_seqs=SLOTS, max_queue_len=16)
    with running(cfg) as server, grpc.insecure_channel(server.target) as ch:
        stub = pb_grpc.TextGenerationStub(ch)
        _starved_caller_is_served(server, stub, (("authorization", f"Bearer {B}"),), None, A)


def test_a_trusted_gateways_header_names_the_callers(model_dir):
    cfg = base_config(model_dir, max_num_seqs=SLOTS, max_queue_len=16, caller_header="x-tenant")
    with running(cfg) as server, grpc.insecure_channel(server.target) as ch:
        stub = pb_grpc.TextGenerationStub(ch)
        _starved_caller_is_served(server, stub, (("x-tenant", "beta"),), "alpha", None, {"x-tenant": "alpha"})


def test_without_auth_or_header_there_is_one_caller(model_dir):
    """Nothing changes by default: no caller key, FIFO, nothing parked."""
    cfg = base_config(model_dir, max_num_seqs=SLOTS // 2, max_queue_len=SLOTS // 2)
    with running(cfg) as server:
        stop = threading.Event()
        threads = _hold_slots(server.http_url, None, stop)
        try:
            wait_until(lambda: server.engine.num_running == server.engine.num_waiting == SLOTS // 2, timeout=60)
            assert {r.caller for r in server.engine.engine.in_flight()} == {None}
            time.sleep(0.5)
            assert all(r.parked is None for r in server.engine.engine.in_flight())
            assert server.engine.num_running == SLOTS // 2
        finally:
            stop.set()
            for t in threads:
                t.join(30)


@pytest.mark.parametrize("value", ["X-Tenant", "authorization", "bad header", ""])
def test_caller_header_must_be_a_plain_lowercase_name(model_dir, value):
    with pytest.raises(ValueError, match="caller_header"):
        base_config(model_dir, caller_header=value)


def test_the_caller_header_flag_and_its_environment_variable():
    from dgserve.service.__main__ import build_config

    cfg, _ = build_config(["--caller-header", "X-Tenant"], {})
    assert cfg.caller_header == "x-tenant"
    cfg, _ = build_config([], {"DGSERVE_CALLER_HEADER": "x-org"})
    assert cfg.caller_header == "x-org"
