"""Connections are bounded on both ports: a connection that does not deliver a complete request in
``request_timeout`` seconds is closed (HTTP: silent, slow-loris headers, slow body; gRPC: silent), the doors hold
at most their share of ``max_connections`` (HTTP evicts its oldest connection without a request, gRPC refuses
the new one), health keeps answering through a flood, the flood is counted in Prometheus and logged as one summary
line, and a process at a low file limit sheds instead of failing accept() in a loop."""

from __future__ import annotations

import http.client
import json
import logging
import resource
import socket
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from service_helpers import ServerThread, base_config, wait_until

from dgserve.service import connections
from dgserve.service.config import ServiceConfig
from dgserve.v1 import text_generation_pb2 as pb
from dgserve.v1 import text_generation_pb2_grpc as pb_grpc

TIMEOUT = 0.5  # the test servers' request_timeout
CAP = 40  # the test server's max_connections: 20 per door


@pytest.fixture(scope="module")
def bounded(model_dir):
    s = ServerThread(base_config(model_dir, request_timeout=TIMEOUT, max_connections=CAP))
    yield s
    s.stop()


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


# Only a guard against a hang: a server that never closes fails the test after this long, however loaded the
# machine. What the tests assert is the close itself (with its 408 and its count), never how soon it came. Below
# grpc's default handshake timeout (120 s), so a gRPC door without --request-timeout still fails.
HANG_GUARD_S = 60.0


def seconds_until_closed(sock: socket.socket, trickle: bytes = b"") -> tuple[float, bytes]:
    """Read (sending ``trickle`` every 0.1 s meanwhile) until the server closes; (seconds, bytes read).
    AssertionError when it has not closed after HANG_GUARD_S."""
    t0, got = time.monotonic(), b""
    sock.settimeout(0.1)
    while True:
        assert time.monotonic() - t0 < HANG_GUARD_S, f"the server kept the connection {HANG_GUARD_S} s: {got[:200]!r}"
        try:
            if trickle:
                sock.sendall(trickle)
            data = sock.recv(4096)
        except TimeoutError:
            continue
        except (ConnectionResetError, BrokenPipeError):
            break
        if not data:
            break
        got += data
    return time.monotonic() - t0, got


def is_closed(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        while data := sock.recv(4096):
            del data  # a GOAWAY or a 408 before the close
        return True
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def http_live(port: int) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/v1/health/live")
        return conn.getresponse().status
    finally:
        conn.close()


def grpc_health(target: str, timeout: float = 10) -> tuple[str, str]:
    """(health status, model name from GetModelInfo) over a fresh channel, waiting for it to connect."""
    with grpc.insecure_channel(target) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(), timeout=timeout, wait_for_ready=True
        )
        info = pb_grpc.TextGenerationStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(status.status), info.model


def rejected(server: ServerThread, door: str, reason: str) -> float:
    return server.server.metrics.value("dgserve_connections_rejected_total", {"door": door, "reason": reason})


# ------------------------------------------------------------------------------------------- the timeout


def test_http_silent_connection_gets_408_and_is_closed(bounded):
    before = rejected(bounded, "http", "timeout")
    with connect(bounded.server.http_port) as s:
        seconds, got = seconds_until_closed(s)
    assert seconds > TIMEOUT * 0.8, seconds  # not before the timeout (a busy machine only makes it later)
    assert_408(got)  # closed by the timeout: its 408
    assert rejected(bounded, "http", "timeout") == before + 1


def test_http_slow_loris_headers_are_cut_off(bounded):
    with connect(bounded.server.http_port) as s:
        s.sendall(b"GET /v1/health/live HTTP/1.1\r\nHost: localhost\r\n")
        # bytes keep coming, never the end: a timer restarted by each byte would never close it (the hang guard)
        _, got = seconds_until_closed(s, trickle=b"X-Slow: 1\r\n")
    assert got.startswith(b"HTTP/1.1 408 "), got


def test_http_slow_body_is_cut_off(bounded):
    with connect(bounded.server.http_port) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\ncontent-type: application/json\r\n"
            b"content-length: 1000\r\n\r\n{"
        )
        _, got = seconds_until_closed(s, trickle=b" ")  # as above: only the request timer can end it
    assert_408(got)


def assert_408(got: bytes) -> None:
    """A whole 408 response with an OpenAI error body, then the close."""
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ") and b"connection: close" in head.lower(), got
    error = json.loads(body)["error"]
    assert error["code"] == "request_timeout" and "not complete within 0.5 s" in error["message"], error


def test_http_body_that_never_completes_is_logged_as_408_without_an_error(bounded, caplog):
    """The app task reading the body learns why it stopped: the access line says 408, nothing logs an error."""
    caplog.set_level(logging.INFO)
    with connect(bounded.server.http_port) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\ncontent-type: application/json\r\n"
            b'content-length: 100\r\n\r\n{"messages": '
        )
        _, got = seconds_until_closed(s)  # silent after part of the body
    assert_408(got)
    wait_until(lambda: any(getattr(r, "status", None) == 408 for r in caplog.records if r.name == "dgserve.access"))
    bad = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not bad, [r.getMessage()[:200] for r in bad]


def test_http_keep_alive_pause_then_request_is_served(bounded):
    """The timer covers receiving a request, not the idle time between keep-alive requests (uvicorn's)."""
    conn = http.client.HTTPConnection("127.0.0.1", bounded.server.http_port, timeout=5)
    try:
        for _ in range(2):
            conn.request("GET", "/v1/health/live")
            resp = conn.getresponse()
            assert resp.status == 200
            resp.read()
            time.sleep(TIMEOUT * 2)
        conn.request("GET", "/v1/models")
        assert conn.getresponse().status == 200
    finally:
        conn.close()


def test_grpc_silent_connection_is_closed(bounded):
    """grpc core closes it at the handshake timeout (not counted by us); without --request-timeout grpc's own
    default (120 s) would keep it past HANG_GUARD_S, which is what fails then."""
    with connect(bounded.server.port) as s:
        seconds, _ = seconds_until_closed(s)
    assert seconds > TIMEOUT * 0.8, seconds  # not before the handshake timeout (load only makes it later)


# ------------------------------------------------------------------------------------------- the cap


def test_http_flood_evicts_silent_connections_and_health_answers(bounded, caplog):
    http_cap = bounded.server.connection_plan.http
    port = bounded.server.http_port
    door = bounded.server._http.door

    def shed() -> float:
        return rejected(bounded, "http", "evicted") + rejected(bounded, "http", "limit")

    before = shed()
    caplog.set_level(logging.INFO)
    socks = [connect(port) for _ in range(3 * http_cap)]
    try:
        # the flood is evicted (oldest first) or, beyond what one accept burst may hold, refused at accept()
        wait_until(lambda: shed() >= before + 2 * http_cap)
        assert len(door.open) == http_cap and door.accepting == 0
        assert http_live(port) == 200  # a probe after the flood evicts the oldest silent connection
        assert len(door.open) <= http_cap
        wait_until(lambda: sum(is_closed(s) for s in socks) >= 2 * http_cap, timeout=5)
        assert grpc_health(bounded.target) == ("SERVING", "tiny")
    finally:
        for s in socks:
            s.close()
    bounded.loop.call_soon_threadsafe(bounded.server.connection_events.flush)
    wait_until(lambda: any("closed or shed" in r.getMessage() for r in caplog.records), timeout=5)
    lines = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) <= 2, [r.getMessage() for r in lines]  # one summary line (two if a timer fired meanwhile)
    assert "http evicted" in lines[-1].getMessage() or "http limit" in lines[-1].getMessage()


def test_grpc_flood_is_shed_and_health_answers(bounded):
    grpc_cap = bounded.server.connection_plan.grpc
    socks = [connect(bounded.server.port) for _ in range(grpc_cap + 10)]
    try:
        time.sleep(0.2)
        shed = sum(is_closed(s) for s in socks)
        assert shed >= 10, shed  # grpc core closes what is over its cap at once
        assert http_live(bounded.server.http_port) == 200
        assert grpc_health(bounded.target) == ("SERVING", "tiny")  # once the silent ones time out
    finally:
        for s in socks:
            s.close()


def test_metrics_show_open_connections_and_caps(bounded):
    from prometheus_client import generate_latest

    text = generate_latest(bounded.server.metrics.registry).decode()
    assert 'dgserve_connections_max{door="grpc"} 20.0' in text
    assert 'dgserve_connections_max{door="http"} 20.0' in text
    assert 'dgserve_connections_open{door="http"}' in text
    assert 'dgserve_connections_open{door="grpc"}' in text


# ------------------------------------------------------------------------------------------- the budget


def test_cap_derives_from_the_file_limit_and_splits_between_the_doors():
    assert connections.default_max_connections(1024) == 1024 - 128
    assert connections.default_max_connections(8192) == 8192 - 1024
    assert connections.default_max_connections(1 << 20) == connections.DEFAULT_CEILING
    p = connections.plan(None, http_on=True, nofile=1024)
    assert (p.total, p.grpc, p.http) == (896, 448, 448)
    assert connections.plan(100, http_on=False, nofile=1024).grpc == 100


def test_soft_file_limit_is_raised_to_the_hard_limit(bounded):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert soft == hard or hard == resource.RLIM_INFINITY


@pytest.mark.parametrize(
    "kw", [dict(max_connections=1), dict(max_connections=True), dict(request_timeout=0), dict(request_timeout="1")]
)
def test_bad_values_are_refused(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        ServiceConfig(**kw)


def test_low_file_limit_sheds_without_an_accept_storm(model_dir):
    """A real ``dgserve serve`` at ulimit -n 256, flooded with 300 silent connections on each port: it stays
    below its limit, both healths answer, and the log gets a few lines, not one per failed accept()."""
    from storm import ServerProcess

    srv = ServerProcess(model_dir, "--request-timeout", "1", nofile=256)
    try:
        base = len(srv.lines)
        socks = [connect(port) for port in (srv.http_port, srv.port) for _ in range(300)]
        time.sleep(0.5)
        assert srv.alive
        assert srv.stats()["fds"] < 256
        assert http_live(srv.http_port) == 200
        assert grpc_health(srv.target) == ("SERVING", "tiny")
        for s in socks:
            s.close()
        time.sleep(1.5)
        assert srv.alive
        flood_lines = srv.lines[base:]
        assert len(flood_lines) <= 5, flood_lines
        assert not any("accept" in line.lower() or "Too many open files" in line for line in flood_lines)
        assert any("under a file limit of 256" in line for line in srv.lines[:base])
    finally:
        srv.kill()
