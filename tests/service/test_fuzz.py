"""Fuzzing the live server: random (often invalid) GenerateRequests and raw malformed bytes. Every call ends with
an expected status (never INTERNAL from our code), the server stays healthy and its memory stays flat."""

from __future__ import annotations

import gc
import json
import logging
import math
import string
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from service_helpers import base_config, running

from dgserve.sampling_params import SCALAR_KNOBS
from dgserve.service.http.openai import input as protocol
from dgserve.v1 import text_generation_pb2 as pb
from dgserve.v1 import text_generation_pb2_grpc as pb_grpc

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

    # a plain valid call always among them, so the run reaches the engine whatever the draws are
    @settings(max_examples=800, **SETTINGS)
    @given(requests())
    @example(pb.GenerateRequest(prompt="hi", params=pb.SamplingParams(max_new_tokens=1, max_denoising_steps=1, seed=1)))
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


# ---------------------------------------------------------------------------------------------- every field, every door
#
# Edge values (huge, tiny, negative, NaN / infinity, wrong types, deep nesting, long strings) in every field of every
# door: HTTP /v1/chat/completions and /v1/completions (each field the door knows, from its own field lists, the
# no-op OpenAI fields and an unknown one) and gRPC Generate (every scalar and repeated field of the request, found
# from its descriptor). Each value alone, then hypothesis combinations. Properties: no engine fault (liveness stays
# OK), no 5xx at all (none of these has a request-local internal cause), no traceback in the server log, and the
# same seeded output afterwards as before. The server bounds each request's work (steps and seconds) so that the
# valid ones among the edges stay cheap.


class Raw:
    """A JSON literal json.dumps cannot write (1e400, NaN, a nesting deeper than the body reader allows)."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return f"Raw({self.text[:20]!r})"


JSON_EDGES: list = [
    None, True, False, 0, -1, 1, 2, 16, 0.5, -0.0, 1e-46, 1e-39, 1.1754943508222875e-38, 3.4028234663852886e38,
    3.5e38, 1e308, 2**31, 2**32, 2**53 + 1, 2**63, 2**64 - 1, 2**64, 2**100, -(2**63),
    Raw("1e400"), Raw("-1e400"), Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), Raw("[" * 300 + "]" * 300),
    "", "1", "nan", "1e400", "-Infinity", "x" * 5000, "\u0000", "é漢\ufffd", "[" * 2000,
    [], [1], ["a"], [[[]]], [None], {}, {"a": 1}, {"type": "json_object"}, {"type": "text"},
]  # fmt: skip
PROTO_EDGES = {
    "double": [math.nan, math.inf, -math.inf, -1.0, 0.0, -0.0, 1e-46, 1e-39, 1.1754943508222875e-38,
               3.4028234663852886e38, 3.5e38, 1e308, 0.5, 2.0],
    "uint32": [0, 1, 2, 1024, 1025, 2**31, 2**32 - 1],
    "uint64": [0, 1, 2**63, 2**64 - 1],
    "bool": [True, False],
    "string": ["", "x", "\u0000", "é漢", "x" * 70_000, "[" * 5000, '{"a":' * 2000, "tiny"],
}  # fmt: skip
_PROTO_KIND = {1: "double", 13: "uint32", 4: "uint64", 8: "bool", 9: "string"}
BAD_HTTP = {"internal", "request_failed", "engine_fault"}  # error codes no fuzz case may produce


def _proto_fields(desc, prefix: str = "", depth: int = 0) -> list[tuple[str, str]]:
    """(dotted path, kind) of every scalar or repeated scalar field of a message type, through its message fields."""
    out = []
    for f in desc.fields:
        path = f"{prefix}{f.name}"
        if f.message_type is not None:
            if depth < 3:
                out += _proto_fields(f.message_type, path + ".", depth + 1)
        elif f.type in _PROTO_KIND:
            out.append((path, _PROTO_KIND[f.type]))
    return out


def _is_repeated(msg, name: str) -> bool:
    return msg.DESCRIPTOR.fields_by_name[name].is_repeated


def _set_proto(req: pb.GenerateRequest, path: str, value) -> None:
    *parents, name = path.split(".")
    msg = req
    for p in parents:
        if _is_repeated(msg, p):  # a repeated message (chat.messages): set the field in its first item
            items = getattr(msg, p)
            msg = items[0] if len(items) else items.add()
        else:
            msg = getattr(msg, p)
    if _is_repeated(msg, name):
        field = getattr(msg, name)
        del field[:]
        field.extend(value if isinstance(value, list) else [value])
    else:
        setattr(msg, name, value)


def _json(body: dict) -> bytes:
    """The body as JSON text, with each Raw value written as its literal."""
    raws: dict[str, str] = {}

    def swap(v):
        if isinstance(v, Raw):
            key = f"@@raw{len(raws)}@@"
            raws[key] = v.text
            return key
        if isinstance(v, dict):
            return {k: swap(x) for k, x in v.items()}
        if isinstance(v, list):
            return [swap(x) for x in v]
        return v

    text = json.dumps(swap(body))
    for key, raw in raws.items():
        text = text.replace(json.dumps(key), raw)
    return text.encode()


def _base_http(chat: bool) -> dict:
    """A valid request of one denoising step (the sweep runs hundreds of valid ones)."""
    body = {"model": "tiny", "max_tokens": 4, "seed": 1, "max_denoising_steps": 1}
    if chat:
        return {**body, "messages": [{"role": "user", "content": "hello"}]}
    return {**body, "prompt": "hello"}


def _base_grpc(path: str = "") -> pb.GenerateRequest:
    """A valid request of one denoising step, its input of the kind ``path`` changes (a chat for chat.*)."""
    req = pb.GenerateRequest(params=pb.SamplingParams(max_new_tokens=4, max_denoising_steps=1, seed=1))
    if path.startswith("chat."):
        req.chat.messages.add(role="user", content="hello")
    elif path.startswith("token_ids."):
        req.token_ids.ids.extend([2, 10, 11])
    else:
        req.prompt = "hello"
    return req


class Doors:
    """The dedicated server's three generation doors, each call checked: no 5xx, no server error in a stream."""

    def __init__(self, server, http):
        self.server, self.http = server, http
        self.stub = pb_grpc.TextGenerationStub(grpc.insecure_channel(server.target))
        self.seen: set[str] = set()
        self.calls = self.ok = 0

    def post(self, path: str, body: dict) -> httpx.Response:
        self.calls += 1
        r = self.http.post(path, content=_json(body), headers={"Content-Type": "application/json"})
        assert r.status_code < 500, (path, r.status_code, r.text[:300], repr(body)[:300])
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            for line in r.text.splitlines():
                if line.startswith("data: {") and '"error"' in line:
                    assert json.loads(line[6:])["error"]["code"] not in BAD_HTTP, (path, line, repr(body)[:300])
        self.seen.add(f"http {r.status_code}")
        self.ok += r.status_code == 200
        return r

    def generate(self, req: pb.GenerateRequest) -> list:
        try:
            events = list(self.stub.Generate(req, timeout=30))
            self.seen.add("grpc OK")
            return events
        except grpc.RpcError as e:
            assert e.code() in EXPECTED, (e.code(), e.details(), str(req)[:300])
            self.seen.add(f"grpc {e.code().name}")
            return []

    def seeded(self) -> tuple:
        """What a fixed seeded request gives on each door: it must not change across the fuzz."""
        chat = self.post("/v1/chat/completions", _base_http(True)).json()["choices"][0]["message"]["content"]
        text = self.post("/v1/completions", _base_http(False)).json()["choices"][0]["text"]
        ids = [i for e in self.generate(_base_grpc()) if e.HasField("block") for i in e.block.token_ids]
        return chat, text, ids

    def healthy(self) -> None:
        assert self.server.server.live and self.server.engine is not None and self.server.engine.fault is None
        assert self.http.get("/v1/health/live").status_code == 200
        assert self.http.get("/v1/health/ready").status_code == 200


class LogRecords(logging.Handler):
    """Every record the server logs at INFO and above while installed (the root logger's level lowered to INFO)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def tracebacks(self) -> list[str]:
        return [
            f"{r.name}: {r.getMessage()[:200]}"
            for r in self.records
            if r.exc_info or r.stack_info or "Traceback" in r.getMessage()
        ]


@pytest.fixture(scope="module")
def doors(model_dir):
    # work per request bounded (steps and seconds): the valid edge cases stay cheap
    config = base_config(model_dir, max_request_steps=24, max_request_seconds=2.0)
    root, handler = logging.getLogger(), LogRecords()
    level = root.level
    with running(config) as s, httpx.Client(base_url=s.http_url, timeout=60) as http:
        root.setLevel(logging.INFO)
        root.addHandler(handler)
        d = Doors(s, http)
        d.log = handler  # type: ignore[attr-defined]
        try:
            yield d
        finally:
            root.removeHandler(handler)
            root.setLevel(level)


HTTP_FIELDS = {
    "/v1/chat/completions": sorted(protocol.CHAT_FIELDS | set(protocol.NO_OP) | {"unknown_field"}),
    "/v1/completions": sorted(protocol.COMPLETION_FIELDS | set(protocol.NO_OP) | {"unknown_field"}),
}
GRPC_FIELDS = _proto_fields(pb.GenerateRequest.DESCRIPTOR)


def test_knobs_beyond_their_dtype_are_refused_on_every_door(doors):
    """The case that faulted the engine for everyone: a float32 knob above 3.4e38 passed validation and overflowed
    inside the engine step. Now each door refuses it (400 / INVALID_ARGUMENT naming the field) and stays live."""
    for name in ("entropy_bound", "confidence_threshold", "t_max"):
        for value in (1e39, 3.5e38, 1e-40):
            for path in HTTP_FIELDS:
                r = doors.post(path, {**_base_http(path.endswith("chat/completions")), name: value})
                assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text
            with pytest.raises(grpc.RpcError) as e:
                list(doors.stub.Generate(pb.GenerateRequest(prompt="x", params=pb.SamplingParams(**{name: value}))))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and f"params.{name}" in e.value.details()
    doors.healthy()


def test_fuzz_every_field_of_every_door(doors):
    for door, fields in HTTP_FIELDS.items():  # every knob on every door
        assert set(protocol.KNOBS) | {"max_tokens", "stop", "temperature", "seed", "n"} <= set(fields), door
    assert {f"params.{n}" for n in SCALAR_KNOBS} | {"params.stop"} <= {p for p, _ in GRPC_FIELDS}
    t0 = time.monotonic()
    before = doors.seeded()
    for path, fields in HTTP_FIELDS.items():  # each field alone, at each edge value
        for name in fields:
            for value in JSON_EDGES:
                doors.post(path, {**_base_http(path.endswith("chat/completions")), name: value})
    t_http = time.monotonic() - t0
    for field_path, kind in GRPC_FIELDS:
        for value in PROTO_EDGES[kind]:
            req = _base_grpc(field_path)
            _set_proto(req, field_path, value)
            doors.generate(req)

    @settings(max_examples=60, **SETTINGS)
    @given(st.data())
    def combined(data):  # a few fields at once, on one door
        door = data.draw(st.sampled_from(["grpc", *HTTP_FIELDS]))
        if door == "grpc":
            fields = data.draw(st.lists(st.sampled_from(GRPC_FIELDS), min_size=1, max_size=3))
            req = _base_grpc(fields[0][0])
            for field_path, kind in fields:
                value = data.draw(st.sampled_from(PROTO_EDGES[kind]))
                _set_proto(req, field_path, value)
            doors.generate(req)
        else:
            body = _base_http(door.endswith("chat/completions"))
            for name in data.draw(st.lists(st.sampled_from(HTTP_FIELDS[door]), min_size=1, max_size=3)):
                body[name] = data.draw(st.sampled_from(JSON_EDGES))
            doors.post(door, body)

    t_grpc = time.monotonic() - t0 - t_http
    combined()
    doors.healthy()
    assert doors.seeded() == before
    assert {"http 200", "http 400", "grpc OK", "grpc INVALID_ARGUMENT"} <= doors.seen, doors.seen
    assert doors.log.tracebacks() == []  # type: ignore[attr-defined]
    print(
        f"fuzz: {doors.calls} http calls ({doors.ok} 200), {sorted(doors.seen)}; http sweep {t_http:.1f} s, "
        f"grpc sweep {t_grpc:.1f} s, all {time.monotonic() - t0:.1f} s"
    )
