"""Operating the server: health during load (docs/architecture.md, "Service behaviours", row 11), auth (row 7),
TLS/mTLS, HTTP probes and metrics,
engine fault (row 20), drain at grace end (row 17, in process), keepalive (row 25), JSON logs, reflection."""

from __future__ import annotations

import io
import json
import logging
import threading
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from service_helpers import ServerThread, base_config, http_status, long_params, make_certs, params, wait_until

from dgserve.service.logs import setup_logging
from dgserve.service.server import load_engine
from dgserve.v1 import text_generation_pb2 as pb
from dgserve.v1 import text_generation_pb2_grpc as pb_grpc

READY = "dgserve.v1.TextGeneration"


def health(channel, service: str) -> str:
    r = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


def test_not_ready_during_model_load(model_dir):
    """docs/architecture.md, "Service behaviours", row 11: while loading: Generate UNAVAILABLE, liveness SERVING / HTTP
    live 200, readiness NOT_SERVING /
    HTTP ready 503; after load + warm-up: SERVING / 200. The gRPC health name "" (what a probe that names no
    service asks, Kubernetes' included) follows readiness; "liveness" is the gRPC liveness name."""
    gate = threading.Event()
    cfg = base_config(model_dir)
    s = ServerThread(cfg, engine_factory=lambda: (gate.wait(60), load_engine(cfg))[1], wait_ready=False)
    try:
        with grpc.insecure_channel(s.target) as ch:
            with pytest.raises(grpc.RpcError) as e:
                list(pb_grpc.TextGenerationStub(ch).Generate(pb.GenerateRequest(prompt="x", params=params())))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "loading" in e.value.details()
            assert (health(ch, "liveness"), health(ch, ""), health(ch, READY)) == (
                "SERVING",
                "NOT_SERVING",
                "NOT_SERVING",
            )
            assert (
                http_status(s.server.http_port, "/v1/health/live"),
                http_status(s.server.http_port, "/v1/health/ready"),
            ) == (200, 503)
            gate.set()
            s.call(s.server.loaded.wait)
            assert health(ch, READY) == "SERVING" and http_status(s.server.http_port, "/v1/health/ready") == 200
            assert health(ch, "") == "SERVING" and health(ch, "liveness") == "SERVING"
            assert list(
                pb_grpc.TextGenerationStub(ch).Generate(pb.GenerateRequest(prompt="x", params=params(max_new_tokens=1)))
            )[-1].HasField("finished")
    finally:
        gate.set()
        s.stop()


def test_bearer_auth(model_dir, tmp_path):
    """docs/architecture.md, "Service behaviours", row 7: missing / wrong token → UNAUTHENTICATED (stream and unary);
    health and reflection stay open."""
    tokens = tmp_path / "tokens"
    tokens.write_text("# accepted tokens\nsecret-one\n\nsecret-two\n")
    s = ServerThread(base_config(model_dir, auth_token_file=str(tokens)))
    try:
        with grpc.insecure_channel(s.target) as ch:
            stub = pb_grpc.TextGenerationStub(ch)
            req = pb.GenerateRequest(prompt="x", params=params(max_new_tokens=1))
            for md in [(), (("authorization", "Bearer wrong"),), (("authorization", "Basic secret-one"),)]:
                with pytest.raises(grpc.RpcError) as e:
                    list(stub.Generate(req, metadata=md))
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as e:
                stub.GetModelInfo(pb.GetModelInfoRequest())
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            ok = list(stub.Generate(req, metadata=(("authorization", "Bearer secret-two"),)))
            assert ok[-1].HasField("finished")
            assert health(ch, READY) == "SERVING"
            assert READY in list_services(ch)
    finally:
        s.stop()


def list_services(channel) -> list[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    resp = next(iter(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))))
    return [svc.name for svc in resp.list_services_response.service]


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"), ("client",))


def test_mtls(model_dir, certs):
    """TLS with client certificates: a client with the CA-signed cert works; without one it cannot connect."""
    s = ServerThread(
        base_config(
            model_dir,
            tls_cert=str(certs / "server.pem"),
            tls_key=str(certs / "server.key"),
            tls_client_ca=str(certs / "ca.pem"),
        )
    )
    ca = (certs / "ca.pem").read_bytes()
    try:
        good = grpc.ssl_channel_credentials(
            ca, (certs / "client.key").read_bytes(), (certs / "client.pem").read_bytes()
        )
        with grpc.secure_channel(s.target, good) as ch:
            assert pb_grpc.TextGenerationStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=10).model == "tiny"
        with grpc.secure_channel(s.target, grpc.ssl_channel_credentials(ca)) as ch:
            with pytest.raises(grpc.RpcError) as e:
                pb_grpc.TextGenerationStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        s.stop()


def test_http_metrics_and_probes(server, stub):
    list(stub.Generate(pb.GenerateRequest(prompt="metrics", params=params(max_new_tokens=20))))
    port = server.server.http_port
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for name in (
        "dgserve_num_requests_running",
        "dgserve_num_requests_waiting",
        "dgserve_request_queue_time_seconds",
        "dgserve_time_to_first_block_seconds",
        "dgserve_e2e_request_latency_seconds",
        "dgserve_generation_tokens_total",
        "dgserve_request_finish_total",
        "dgserve_denoise_steps_per_block",
        "dgserve_tokens_per_forward",
        "dgserve_engine_step_seconds",
    ):
        assert name in body, name
    assert http_status(port, "/v1/metrics") == 200 and http_status(port, "/nope") == 404
    assert http_status(port, "/v1/health/live") == http_status(port, "/v1/health/ready") == 200


def test_engine_fault_fails_calls_and_health(model_dir):
    """docs/architecture.md, "Service behaviours", row 20: in-flight RPCs INTERNAL; readiness and liveness NOT_SERVING
    (HTTP 503); new calls UNAVAILABLE."""
    s = ServerThread(base_config(model_dir))
    try:

        def broken(*a, **k):
            raise RuntimeError("simulated device failure")

        s.engine.engine.model.decode_row_hidden = broken  # the decoder pass the model runner calls
        with grpc.insecure_channel(s.target) as ch:
            stub = pb_grpc.TextGenerationStub(ch)
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(pb.GenerateRequest(prompt="x", params=params())))
            # the fault is named by its phase and type only: its message may carry a request's content
            assert e.value.code() == grpc.StatusCode.INTERNAL and "RuntimeError" in e.value.details()
            assert "batched denoising pass" in e.value.details() and "no single request's" in e.value.details()
            assert "simulated device failure" not in e.value.details()
            wait_until(lambda: all(health(ch, n) == "NOT_SERVING" for n in ("", READY, "liveness")))
            assert http_status(s.server.http_port, "/v1/health/live") == 503
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(pb.GenerateRequest(prompt="x", params=params())))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "simulated" not in e.value.details()
    finally:
        s.stop()


def test_drain_cancels_streams_still_running_at_grace_end(model_dir, caplog):
    """docs/architecture.md, "Service behaviours", row 17 (in process; the SIGTERM path is test_sigterm_drain):
    readiness flips at once, new calls are
    UNAVAILABLE, a stream outliving the grace period ends cleanly: Finished{CANCELLED}, then status OK; no
    traceback is logged."""
    s = ServerThread(base_config(model_dir))
    ch = grpc.insecure_channel(s.target)
    stub = pb_grpc.TextGenerationStub(ch)
    call = stub.Generate(pb.GenerateRequest(prompt="forever", params=long_params()))
    assert next(call).HasField("started")
    import asyncio

    drained = asyncio.run_coroutine_threadsafe(s.server.drain(1.0), s.loop)
    wait_until(lambda: s.server.state.draining)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb.GenerateRequest(prompt="new", params=params()), timeout=5))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    events = list(call)  # raises on any status but OK
    assert events[-1].finished.finish_reason == pb.FINISH_REASON_CANCELLED
    assert call.code() == grpc.StatusCode.OK
    drained.result(30)
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    ch.close()
    s.loop.call_soon_threadsafe(s.loop.stop)


def test_client_keepalive_pings_do_not_trigger_goaway(model_dir):
    """docs/architecture.md, "Service behaviours", row 25: a client pinging often (here every 300 ms, idle and during a
    stream) is not sent
    GOAWAY too_many_pings when the server's minimum ping interval is below it."""
    s = ServerThread(base_config(model_dir, keepalive_min_ping_ms=200))
    opts = [
        ("grpc.keepalive_time_ms", 300),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]
    try:
        with grpc.insecure_channel(s.target, opts) as ch:
            stub = pb_grpc.TextGenerationStub(ch)
            stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
            import time

            time.sleep(2.0)  # idle: ~6 pings
            events = list(stub.Generate(pb.GenerateRequest(prompt="x", params=params(max_new_tokens=64))))
            assert events[-1].HasField("finished")
            time.sleep(1.0)
            stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
    finally:
        s.stop()


def test_json_logs_carry_request_id(stub):
    out = io.StringIO()
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    setup_logging("INFO", json_lines=True, stream=out)
    try:
        list(stub.Generate(pb.GenerateRequest(request_id="log-me-1", prompt="x", params=params(max_new_tokens=1))))
        wait_until(lambda: "log-me-1" in out.getvalue())
    finally:
        root.handlers[:], _ = saved[0], root.setLevel(saved[1])
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    access = [x for x in lines if x.get("rpc", "").endswith("/Generate") and x["request_id"] == "log-me-1"]
    assert access and access[0]["code"] == "OK" and access[0]["level"] == "INFO" and "duration_ms" in access[0]
