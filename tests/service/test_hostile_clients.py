"""Careless and hostile clients: huge prompts are rejected with bounded work, identifiers are clean,
headers are bounded, logs cannot be forged, Abort is scoped to its caller, and every call — denied or expired —
is logged and counted with its own code."""

from __future__ import annotations

import io
import logging
import re

import grpc
import pytest
from service_helpers import (
    ServerThread,
    auth_config,
    bad_request_field,
    base_config,
    long_params,
    make_certs,
    params,
    wait_until,
)

from dgserve.service.logs import JsonFormatter, TextFormatter
from dgserve.v1 import text_generation_pb2 as pb
from dgserve.v1 import text_generation_pb2_grpc as pb_grpc

HUGE = "The quick brown fox jumps over the lazy dog. " * 333_334  # 15 MB


def error_of(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value


# ---------------------------------------------------------------------------------------------- bounded work


@pytest.mark.parametrize("kind", ["generate", "tokenize", "chat"])
def test_huge_prompt_is_rejected_before_tokenizing(stub, server, kind):
    """A 15 MB prompt cannot fit 4096 positions: INVALID_ARGUMENT from its byte length, or from counting its first
    chunks, never from tokenizing all of it (which took 9.5 s and 1.6 GB before): the bound the message names says
    which, so no clock is needed. bench/bench_storm.py measures the time."""
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content=HUGE)])
    call = {
        "generate": lambda: list(stub.Generate(pb.GenerateRequest(prompt=HUGE, params=params()))),
        "tokenize": lambda: stub.Tokenize(pb.TokenizeRequest(prompt=HUGE)),
        "chat": lambda: list(stub.Generate(pb.GenerateRequest(chat=chat, params=params()))),
    }[kind]
    err = error_of(call)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("prompt: at least ")
    # the lower bound it names is the byte length's (bytes / the most one token covers; a chat template adds a few
    # bytes) or a count that stopped in the first chunks, never the whole text's count (about 3.3 M here)
    n = int(re.match(r"prompt: at least (\d+) tokens", err.details()).group(1))
    k, n_bytes = server.engine.engine.tokenizer.max_token_bytes, len(HUGE.encode())
    assert (k is not None and n_bytes <= n * k <= n_bytes + 1000 + k) or n <= 2 * 4096, (err.details(), k)
    assert "4096" in err.details() and bad_request_field(err) == "prompt"


def test_tokenize_output_is_capped_at_the_context(stub):
    """A text short enough in bytes to maybe fit is tokenized, and refused when it has more than max_model_len ids."""
    err = error_of(lambda: stub.Tokenize(pb.TokenizeRequest(prompt="q? " * 3000)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "more than the 4096 that fit" in err.details()
    assert 1000 < len(stub.Tokenize(pb.TokenizeRequest(prompt="q? " * 1000)).token_ids) <= 4096


# ---------------------------------------------------------------------------------------------- identifiers


@pytest.mark.parametrize("rid", ["two\nlines", "nul\x00", "esc\x1b[2J", "sep\u2028", "r" * 257])
def test_request_id_must_be_short_and_printable(stub, rid):
    """Generate and Abort: INVALID_ARGUMENT naming request_id, without echoing the id."""
    for call in (
        lambda: list(stub.Generate(pb.GenerateRequest(request_id=rid, prompt="hi", params=params()))),
        lambda: stub.Abort(pb.AbortRequest(request_id=rid)),
    ):
        err = error_of(call)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("request_id: must be 1 to")
        assert bad_request_field(err) == "request_id" and rid not in err.details()


def test_request_id_limits_are_exact(stub):
    events = list(stub.Generate(pb.GenerateRequest(request_id="é" * 256, prompt="hi", params=params(max_new_tokens=1))))
    assert events[-1].request_id == "é" * 256
    assert stub.Abort(pb.AbortRequest(request_id="é" * 256)).outcome == pb.ABORT_OUTCOME_ALREADY_FINISHED


def test_request_id_header_is_checked(stub):
    err = error_of(lambda: stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=(("x-request-id", "h" * 300),)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("x-request-id: must be")
    assert stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=(("x-request-id", "ok-1"),)).model == "tiny"


def test_metadata_size_is_limited(stub):
    """A 1 MB header is refused by the transport (RESOURCE_EXHAUSTED) before it reaches our code or logs."""
    err = error_of(lambda: stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=(("x-junk", "j" * (1 << 20)),)))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "metadata" in err.details()
    assert stub.GetModelInfo(pb.GetModelInfoRequest()).model == "tiny"


def test_metadata_limit_is_the_promised_16_kib(stub):
    """16 KiB of a client's metadata (name + value, as HTTP/2 counts an entry, less its 32-byte overhead) always
    passes; 17 KiB never does (grpc's soft limit alone let 17 KiB through at random)."""
    for kib, ok in ((16, True), (17, False)):
        entry = (("x-junk", "j" * ((kib << 10) - len("x-junk") - 32)),)
        for _ in range(20):
            if ok:
                assert stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=entry, timeout=30).model == "tiny"
            else:
                err = error_of(lambda e=entry: stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=e, timeout=30))
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (kib, err.code())


def test_logs_escape_what_they_print():
    record = logging.LogRecord("dgserve.access", logging.INFO, __file__, 1, "rpc %s", ("a\nFAKE LINE\x00",), None)
    record.request_id = "id\r\nforged"
    text = TextFormatter().format(record)
    assert "\n" not in text and "\r" not in text and "\x00" not in text
    assert text.endswith("[id\\r\\nforged] rpc a\\nFAKE LINE\\x00")
    assert "\n" not in JsonFormatter().format(record)


# ---------------------------------------------------------------------------------------------- auth, ownership


@pytest.fixture(scope="module")
def auth_server(model_dir, tmp_path_factory):
    s = ServerThread(auth_config(model_dir, tmp_path_factory.mktemp("auth"), ("token-a", "token-b")))
    ch = grpc.insecure_channel(s.target)
    yield s, pb_grpc.TextGenerationStub(ch)
    ch.close()
    s.stop()


A, B = (("authorization", "Bearer token-a"),), (("authorization", "Bearer token-b"),)


def test_abort_is_scoped_to_its_caller(auth_server):
    """Token B can neither stop nor discover token A's request: the same NOT_FOUND as for an id never seen."""
    s, stub = auth_server
    call = stub.Generate(pb.GenerateRequest(request_id="job-1", prompt="a", params=long_params()), metadata=A)
    assert next(call).HasField("started")
    never = error_of(lambda: stub.Abort(pb.AbortRequest(request_id="job-0"), metadata=B))
    other = error_of(lambda: stub.Abort(pb.AbortRequest(request_id="job-1"), metadata=B))
    assert other.code() == never.code() == grpc.StatusCode.NOT_FOUND
    assert other.details() == never.details().replace("job-0", "job-1")
    assert next(call).HasField("block")  # A's stream is untouched
    assert stub.Abort(pb.AbortRequest(request_id="job-1"), metadata=A).outcome == pb.ABORT_OUTCOME_CANCELLED
    assert list(call)[-1].finished.finish_reason == pb.FINISH_REASON_CANCELLED
    again = error_of(lambda: stub.Abort(pb.AbortRequest(request_id="job-1"), metadata=B))
    assert again.code() == grpc.StatusCode.NOT_FOUND
    assert stub.Abort(pb.AbortRequest(request_id="job-1"), metadata=A).outcome == pb.ABORT_OUTCOME_ALREADY_FINISHED


def test_denied_calls_are_logged_and_counted(auth_server):
    s, stub = auth_server
    m = s.server.metrics
    labels = {"method": "Generate", "code": "UNAUTHENTICATED"}
    before = m.value("dgserve_rpc_total", labels)
    lines = _capture_access_log()
    try:
        err = error_of(lambda: list(stub.Generate(pb.GenerateRequest(prompt="x", params=params()))))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        wait_until(lambda: m.value("dgserve_rpc_total", labels) == before + 1)
        wait_until(lambda: "/dgserve.v1.TextGeneration/Generate UNAUTHENTICATED" in lines.getvalue())
    finally:
        logging.getLogger("dgserve.access").handlers.pop()


def test_access_lines_carry_the_id_the_server_assigned(stub):
    """A call whose client sent no id is logged under one the server assigned (never an empty id); a Generate
    runs under that id, so its responses and its access line agree; a client's own id is logged as sent."""
    lines = _capture_access_log()
    try:
        events = list(stub.Generate(pb.GenerateRequest(prompt="hi", params=params(max_new_tokens=1))))
        rid = events[-1].request_id
        assert re.fullmatch(r"dg-[0-9a-f]{32}", rid), rid
        wait_until(lambda: f"[{rid}] /dgserve.v1.TextGeneration/Generate OK" in lines.getvalue())
        stub.Tokenize(pb.TokenizeRequest(prompt="hi"))
        error_of(lambda: list(stub.Generate(pb.GenerateRequest(prompt="", params=params()))))  # refused early
        list(stub.Generate(pb.GenerateRequest(request_id="mine-1", prompt="hi", params=params(max_new_tokens=1))))
        wait_until(lambda: "[mine-1] /dgserve.v1.TextGeneration/Generate OK" in lines.getvalue())
        wait_until(lambda: "Tokenize OK" in lines.getvalue() and "Generate INVALID_ARGUMENT" in lines.getvalue())
        access = [line for line in lines.getvalue().splitlines() if "/dgserve.v1.TextGeneration/" in line]
        assert access and all(re.search(r"\[(dg-[0-9a-f]{32}|mine-1)\] /dgserve", line) for line in access), access
    finally:
        logging.getLogger("dgserve.access").handlers.pop()


def _capture_access_log() -> io.StringIO:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(TextFormatter())
    logger = logging.getLogger("dgserve.access")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return out


# ---------------------------------------------------------------------------------------------- accounting


def test_deadline_expiry_counts_as_deadline_exceeded(stub, server):
    m = server.server.metrics
    expired = {"method": "Generate", "code": "DEADLINE_EXCEEDED"}
    cancelled = {"method": "Generate", "code": "CANCELLED"}
    before = m.value("dgserve_rpc_total", expired), m.value("dgserve_rpc_total", cancelled)
    err = error_of(lambda: list(stub.Generate(pb.GenerateRequest(prompt="slow", params=long_params()), timeout=0.5)))
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: m.value("dgserve_rpc_total", expired) == before[0] + 1)
    assert m.value("dgserve_rpc_total", cancelled) == before[1]
    wait_until(lambda: not server.engine.engine.has_unfinished())


@pytest.fixture(scope="module")
def two_client_certs(tmp_path_factory):
    """A CA, a server certificate and two client certificates (CN alice, CN bob) it signed."""
    return make_certs(tmp_path_factory.mktemp("certs2"), ("alice", "bob"))


def test_abort_is_scoped_to_the_client_certificate(model_dir, two_client_certs):
    """mTLS without tokens: only the certificate that started a request may abort it."""
    d = two_client_certs
    s = ServerThread(
        base_config(
            model_dir, tls_cert=str(d / "server.pem"), tls_key=str(d / "server.key"), tls_client_ca=str(d / "ca.pem")
        )
    )

    def channel(name):
        creds = grpc.ssl_channel_credentials(
            (d / "ca.pem").read_bytes(), (d / f"{name}.key").read_bytes(), (d / f"{name}.pem").read_bytes()
        )
        return grpc.secure_channel(s.target, creds)

    try:
        with channel("alice") as ca, channel("bob") as cb:
            alice, bob = pb_grpc.TextGenerationStub(ca), pb_grpc.TextGenerationStub(cb)
            call = alice.Generate(pb.GenerateRequest(request_id="cert-job", prompt="a", params=long_params()))
            assert next(call).HasField("started")
            err = error_of(lambda: bob.Abort(pb.AbortRequest(request_id="cert-job"), timeout=10))
            assert err.code() == grpc.StatusCode.NOT_FOUND and "is not known" in err.details()
            assert alice.Abort(pb.AbortRequest(request_id="cert-job"), timeout=10).outcome == pb.ABORT_OUTCOME_CANCELLED
            assert list(call)[-1].finished.finish_reason == pb.FINISH_REASON_CANCELLED
    finally:
        s.stop()
