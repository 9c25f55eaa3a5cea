"""Fuzzing the live server: random (often invalid) GenerateRequests and raw malformed bytes. Every call ends with
an expected status (never INTERNAL from our code), the server stays healthy and its memory stays flat."""

from __future__ import annotations

import gc
import string
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dgserve.v1 import text_generation_pb2 as pb

EXPECTED = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
SETTINGS = dict(deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None)

u32 = st.one_of(st.integers(0, 40), st.integers(0, 2**32 - 1))
f64 = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(0, 2))
text = st.text(string.printable + "éü漢\u0000\ufffd", max_size=40)


@st.composite
def sampling(draw):
    p = pb.SamplingParams()
    for name, strat in (
        ("max_new_tokens", st.integers(0, 48) | u32),
        ("max_denoising_steps", st.integers(0, 4) | u32),
        ("t_min", f64),
        ("t_max", f64),
        ("entropy_bound", f64),
        ("stability_threshold", u32),
        ("confidence_threshold", f64),
        ("seed", st.integers(0, 2**64 - 1)),
        ("ignore_eos", st.booleans()),
        ("n", st.integers(0, 3)),
    ):
        if draw(st.booleans()):
            setattr(p, name, draw(strat))
    if not p.HasField("max_new_tokens") or p.max_new_tokens > 48:
        p.max_new_tokens = draw(st.integers(0, 48))  # keep the valid ones cheap
    if not p.HasField("max_denoising_steps") or p.max_denoising_steps > 4:
        p.max_denoising_steps = draw(st.integers(0, 4))
    p.stop.extend(draw(st.lists(st.text(max_size=300), max_size=18)))
    return p


@st.composite
def requests(draw):
    r = pb.GenerateRequest(
        request_id=draw(st.text(max_size=300) | st.just("")),
        model=draw(st.sampled_from(["", "", "tiny", "tiny-alias", "other"])),
        params=draw(sampling()),
    )
    kind = draw(st.sampled_from(["prompt", "token_ids", "chat", "none"]))
    if kind == "prompt":
        r.prompt = draw(text)
    elif kind == "token_ids":
        r.token_ids.ids.extend(draw(st.lists(st.integers(0, 320) | u32, max_size=30)))
    elif kind == "chat":
        for _ in range(draw(st.integers(0, 3))):
            m = r.chat.messages.add(
                role=draw(st.sampled_from(["user", "assistant", "system", "model", "x", ""])), content=draw(text)
            )
            if draw(st.booleans()):
                m.parts.add(text=draw(text))
            if draw(st.integers(0, 5)) == 0:
                m.parts.add(image=pb.Media(data=b"img"))
    if draw(st.booleans()):
        r.drafts.enabled, r.drafts.every_n_steps = True, draw(st.integers(0, 3))
    return r


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def test_fuzz_generate_requests(stub, channel, server):
    seen = set()

    @settings(max_examples=800, **SETTINGS)
    @given(requests())
    def one(req):
        try:
            events = list(stub.Generate(req, timeout=30))
            assert events[0].HasField("started") and events[-1].HasField("finished")
            seen.add("OK")
        except grpc.RpcError as e:
            assert e.code() in EXPECTED, (e.code(), e.details(), req)
            seen.add(e.code().name)

    t0 = time.monotonic()
    one()
    gc.collect()
    rss0 = _rss_mb()
    one()  # the same 800 again: memory must not grow with the work
    gc.collect()
    assert _rss_mb() - rss0 < 40
    assert {"OK", "INVALID_ARGUMENT"} <= seen and time.monotonic() - t0 < 120
    _healthy(stub, channel, server)


def test_fuzz_malformed_bytes(stub, channel, server):
    raw_generate = channel.unary_stream("/dgserve.v1.TextGeneration/Generate")
    raw_tokenize = channel.unary_unary("/dgserve.v1.TextGeneration/Tokenize")

    @settings(max_examples=400, **SETTINGS)
    @given(st.binary(max_size=200))
    def one(data):
        for call in (lambda: list(raw_generate(data, timeout=30)), lambda: raw_tokenize(data, timeout=30)):
            try:
                call()
            except grpc.RpcError as e:
                assert e.code() in EXPECTED, (e.code(), e.details(), data)

    one()
    _healthy(stub, channel, server)


def _healthy(stub, channel, server):
    status = (
        health_pb2_grpc.HealthStub(channel)
        .Check(health_pb2.HealthCheckRequest(service="dgserve.v1.TextGeneration"), timeout=5)
        .status
    )
    assert status == health_pb2.HealthCheckResponse.SERVING
    events = list(
        stub.Generate(
            pb.GenerateRequest(
                prompt="still alive", params=pb.SamplingParams(max_new_tokens=8, max_denoising_steps=2, seed=1)
            )
        )
    )
    assert events[-1].HasField("finished")
    deadline = time.monotonic() + 10
    while server.engine.engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not server.engine.engine.has_unfinished() and server.engine.num_waiting == 0
