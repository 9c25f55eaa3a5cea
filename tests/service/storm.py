"""Client storms against a real server process, shared by tests/service/test_storm.py and bench/bench_storm.py:
streams ended at random points (every way a client can walk away), malformed calls, and the server process's
RSS, threads and open fds read from /proc.

A stream's outcome is the status its client saw ("OK", "CANCELLED", ...); a storm is healthy when every outcome
is one a client may legitimately get (``STREAM_CODES``, ``FUZZ_CODES``) and the server survives it.
"""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import socket
import string
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import grpc

from dgserve.client import Client
from dgserve.v1 import text_generation_pb2 as pb
from dgserve.v1 import text_generation_pb2_grpc as pb_grpc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SERVER_COMMAND = [sys.executable, "-m", "dgserve.service"]
MODES = (
    "cancel_at_once",
    "cancel_after_started",
    "cancel_after_block",
    "cancel_at_random",
    "client_break",
    "deadline",
    "abort",
    "complete",
)
STREAM_CODES = {"OK", "CANCELLED", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"}
FUZZ_CODES = {
    "OK",
    "INVALID_ARGUMENT",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "UNIMPLEMENTED",
    "RESOURCE_EXHAUSTED",
    "UNAUTHENTICATED",
    "CANCELLED",
    "DEADLINE_EXCEEDED",
}


class ServerProcess:
    """``python -m dgserve.service`` on 127.0.0.1 with ephemeral ports; ``port``/``http_port`` parsed from its log.
    ``nofile``: its open-file limit, soft and hard (None: inherited). ``cgroup``: a cgroup directory the server
    joins before it starts (its ``cgroup.procs``)."""

    def __init__(
        self,
        model_dir,
        *extra: str,
        ready_timeout: float = 120,
        nofile: int | None = None,
        cgroup: str | None = None,
    ):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("NIM_", "DGSERVE_"))}
        setup = [] if nofile is None else [f"ulimit -n {int(nofile)}"]
        if cgroup is not None:
            setup.append(f"echo $$ > {shlex.quote(os.path.join(cgroup, 'cgroup.procs'))}")
        self.proc = subprocess.Popen(
            [
                # limits through a shell, not preexec_fn: a Python callback between fork and exec in a process
                # with gRPC threads (the test runner) can hang or break the child
                *(["sh", "-c", " && ".join([*setup, 'exec "$@"']), "sh"] if setup else []),
                *SERVER_COMMAND,
                "--model",
                str(model_dir),
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--http-port",
                "0",
                "--served-model-name",
                "tiny",
                *extra,
            ],
            cwd=ROOT,
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self.port = self.http_port = None
        self._listening = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self._listening.wait(ready_timeout):
            self.kill()
            raise AssertionError("server did not report its port:\n" + "".join(self.lines[-50:]))
        self.target = f"127.0.0.1:{self.port}"
        self._wait_ready(ready_timeout)

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append(line)
            m = re.search(r"listening: gRPC [\d.]+:(\d+).*HTTP (\d+)", line)
            if m:
                self.port, self.http_port = int(m.group(1)), int(m.group(2))
                self._listening.set()

    def _wait_ready(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        with Client(self.target) as c:
            while True:
                try:
                    if c.health() == "SERVING":
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > end or self.proc.poll() is not None:
                    raise AssertionError("server never became ready:\n" + "".join(self.lines[-50:]))
                time.sleep(0.1)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def stats(self) -> dict:
        return process_stats(self.proc.pid)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def process_stats(pid: int) -> dict:
    """RSS (MB), threads and open fds of a process (Linux /proc)."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields[key] = value.split()
    return {
        "rss_mb": round(int(fields["VmRSS"][0]) / 1024, 1),
        "threads": int(fields["Threads"][0]),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
    }


# ---------------------------------------------------------------------------------------------- streams


def stream_request(i: int, request_id: str = "", max_new_tokens: int = 48) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        prompt=f"storm {i}",
        params=pb.SamplingParams(max_new_tokens=max_new_tokens, max_denoising_steps=4, seed=i, ignore_eos=True),
    )


def one_stream(stub, client: Client, mode: str, i: int, rng: random.Random) -> str:
    """Run one stream and end it the way ``mode`` says; returns the status code name the client saw."""
    try:
        if mode == "client_break":
            return _client_break(client, i, rng)
        if mode == "deadline":
            call = stub.Generate(stream_request(i, max_new_tokens=160), timeout=rng.uniform(0.001, 0.3))
            for _ in call:
                pass
            return "OK"
        if mode == "abort":
            return _abort(stub, i)
        call = stub.Generate(stream_request(i))
        if mode == "complete":
            events = list(call)
            assert events[-1].HasField("finished"), events[-1]
            return "OK"
        if mode == "cancel_at_random":
            time.sleep(rng.uniform(0, 0.05))
        elif mode in ("cancel_after_started", "cancel_after_block"):
            _read_until(call, "started" if mode == "cancel_after_started" else "block")
        call.cancel()
        for _ in call:
            pass
        return "OK"
    except grpc.RpcError as e:
        return e.code().name


def _read_until(call, kind: str) -> None:
    for event in call:
        if event.HasField(kind) or event.HasField("finished"):
            return


def _client_break(client: Client, i: int, rng: random.Random) -> str:
    """Leave our own client's ``generate()`` early with ``break`` (the pattern its docstring shows)."""
    stop_after = rng.choice(["started", "block"])
    for event in client.generate(f"storm {i}", max_new_tokens=48, max_denoising_steps=4, seed=i, ignore_eos=True):
        if event.HasField(stop_after):
            break
    return "CANCELLED"


def _abort(stub, i: int) -> str:
    rid = f"storm-abort-{i}-{time.monotonic_ns()}"
    call = stub.Generate(stream_request(i, rid, max_new_tokens=160))
    _read_until(call, "started")
    stub.Abort(pb.AbortRequest(request_id=rid), timeout=10)
    events = list(call)
    assert not events or events[-1].HasField("finished"), events[-1]
    return "OK"


def storm(stub, target: str, n: int, concurrency: int = 16, seed: int = 0) -> Counter:
    """``n`` streams, ``concurrency`` at a time, each ended by a random mode; Counter of (mode, code)."""
    rng = random.Random(seed)
    jobs = [(rng.choice(MODES), i, random.Random(rng.random())) for i in range(n)]
    with Client(target) as client, ThreadPoolExecutor(concurrency) as pool:
        codes = list(pool.map(lambda job: (job[0], one_stream(stub, client, *job)), jobs))
    return Counter(codes)


def seeded_tokens(stub) -> list[int]:
    """The tokens of one fixed seeded request (to compare before and after a storm)."""
    events = list(
        stub.Generate(
            pb.GenerateRequest(
                prompt="the same seeded request",
                params=pb.SamplingParams(max_new_tokens=48, max_denoising_steps=4, seed=1234, ignore_eos=True),
            ),
            timeout=60,
        )
    )
    return [t for e in events if e.HasField("block") for t in e.block.token_ids]


# ---------------------------------------------------------------------------------------------- malformed calls

_METHODS = ("Generate", "Tokenize", "Abort", "GetModelInfo")
_NASTY = ["", "a\nb", "nul\x00", "\x1b[31mred", "x" * 257, "é" * 300, "ok-id", "\u2028", " "]


def malformed_call(channel, rng: random.Random) -> str:
    """One malformed call (random bytes, hostile ids, odd metadata, absurd knobs); the status code name."""
    kind = rng.randrange(4)
    method = rng.choice(_METHODS)
    metadata = _odd_metadata(rng)
    try:
        if kind == 0:  # raw bytes that may not parse at all
            data = rng.randbytes(rng.randrange(0, 64))
            _raw(channel, method, data, metadata)
        elif kind == 1:  # a valid message with hostile identifiers
            rid = rng.choice(_NASTY)
            msg = (
                pb.AbortRequest(request_id=rid)
                if method == "Abort"
                else pb.GenerateRequest(
                    request_id=rid,
                    prompt=rng.choice(_NASTY) or "x",
                    params=pb.SamplingParams(max_new_tokens=1, max_denoising_steps=1, seed=1),
                )
            )
            _raw(channel, "Abort" if method == "Abort" else "Generate", msg.SerializeToString(), metadata)
        elif kind == 2:  # absurd knobs and inputs
            req = pb.GenerateRequest(
                prompt=rng.choice(["", "hi", "x" * 5000]),
                params=pb.SamplingParams(
                    max_new_tokens=rng.choice([0, 1, 2**32 - 1]),
                    max_denoising_steps=rng.choice([0, 1, 10**6]),
                    t_min=rng.choice([-1.0, float("nan"), 0.1]),
                    seed=1,
                ),
            )
            if rng.random() < 0.3:
                req.token_ids.ids.extend(rng.randrange(0, 2**32) for _ in range(rng.randrange(0, 8)))
            _raw(channel, "Generate", req.SerializeToString(), metadata)
        else:  # Tokenize of odd text and chats
            req = pb.TokenizeRequest(prompt="".join(rng.choice(string.printable + "\x00é") for _ in range(50)))
            if rng.random() < 0.5:
                req.chat.messages.add(role=rng.choice(["user", "robot", ""]), content=rng.choice(_NASTY))
            _raw(channel, "Tokenize", req.SerializeToString(), metadata)
        return "OK"
    except grpc.RpcError as e:
        return e.code().name


def _odd_metadata(rng: random.Random) -> tuple:
    choice = rng.randrange(6)
    if choice == 0:
        return (("x-request-id", rng.choice(["x" * 300, "fine", "y" * (40 << 10)])),)
    if choice == 1:
        return (("authorization", rng.choice(["Bearer ", "Basic x", "Bearer wrong"])),)
    return ()


def _raw(channel, method: str, data: bytes, metadata: tuple) -> None:
    path = f"/dgserve.v1.TextGeneration/{method}"
    if method == "Generate":
        for _ in channel.unary_stream(path)(data, timeout=30, metadata=metadata):
            pass
    else:
        channel.unary_unary(path)(data, timeout=30, metadata=metadata)


def fuzz(channel, n: int, concurrency: int = 8, seed: int = 0) -> Counter:
    """``n`` malformed calls, ``concurrency`` at a time; Counter of status code names."""
    rng = random.Random(seed)
    rngs = [random.Random(rng.random()) for _ in range(n)]
    with ThreadPoolExecutor(concurrency) as pool:
        return Counter(pool.map(lambda r: malformed_call(channel, r), rngs))


def stub_for(channel):
    return pb_grpc.TextGenerationStub(channel)


# ---------------------------------------------------------------------------------------------- HTTP

HTTP_MODES = ("close_at_once", "after_first_event", "at_random", "complete")


def _http_send(port: int, head: bytes, body: bytes = b"", timeout: float = 60) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.sendall(head + body)
    return s


def chat_request(i: int, stream: bool = True, max_tokens: int = 16) -> bytes:
    body = json.dumps(
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": f"storm {i}"}],
            "max_tokens": max_tokens,
            "stream": stream,
            "seed": i,
        }
    ).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode()
    return head + body


def _status(data: bytes) -> str:
    m = re.match(rb"HTTP/1\.1 (\d{3})", data)
    return m.group(1).decode() if m else ("closed" if not data else "garbled")


def one_sse_stream(port: int, mode: str, i: int, rng: random.Random) -> str:
    """One streamed chat completion over a raw socket, ended as ``mode`` says; the HTTP status (or "closed")."""
    try:
        with _http_send(port, chat_request(i)) as s:
            if mode == "close_at_once":
                return "sent"
            data = s.recv(65536)
            if mode == "after_first_event":
                while b"data:" not in data and (more := s.recv(65536)):
                    data += more
            elif mode == "at_random":
                time.sleep(rng.uniform(0, 0.05))
            else:
                while more := s.recv(65536):
                    data += more
                assert b"data: [DONE]" in data or not data.startswith(b"HTTP/1.1 200"), data[-200:]
            return _status(data)
    except (ConnectionResetError, BrokenPipeError):
        return "reset"


def sse_storm(port: int, n: int, concurrency: int = 16, seed: int = 0) -> Counter:
    """``n`` SSE streams, ``concurrency`` at a time, each ended by a random HTTP mode; Counter of (mode, status)."""
    rng = random.Random(seed)
    jobs = [(rng.choice(HTTP_MODES), i, random.Random(rng.random())) for i in range(n)]
    with ThreadPoolExecutor(concurrency) as pool:
        return Counter(pool.map(lambda job: (job[0], one_sse_stream(port, *job)), jobs))


def malformed_http(port: int, rng: random.Random) -> str:
    """One malformed HTTP request (bad JSON, bad fields, odd headers, truncated body); the status or "closed"."""
    kind = rng.randrange(5)
    path = rng.choice(["/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/health/live", "/nope"])
    body = rng.choice([b"{", b"[]", b"null", b'{"model": 1}', b'{"prompt": "x", "max_tokens": -1}', rng.randbytes(40)])
    headers = "content-type: application/json\r\n"
    if kind == 1:  # fields of the wrong kind
        body = json.dumps({"model": "tiny", "messages": rng.choice([[], "x", [{"role": 5}]]), "n": "two"}).encode()
    elif kind == 2:  # odd headers
        headers += rng.choice(["x-request-id: " + "x" * 5000 + "\r\n", "authorization: Bearer\r\n", "a\x01b: c\r\n"])
    declared = len(body)
    if kind == 3:  # truncated body: the connection ends before the declared length
        declared = len(body) + rng.randrange(1, 1000)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: localhost\r\n{headers}content-length: {declared}\r\nconnection: close\r\n\r\n"
    )
    if kind == 4:  # not HTTP at all
        head, body = rng.choice(["GARBAGE\r\n\r\n", "GET / HTTP/9.9\r\n\r\n", "\x00" * 64]), b""
    try:
        with _http_send(port, head.encode("latin-1"), body, timeout=30) as s:
            if kind == 3:
                s.shutdown(socket.SHUT_WR)
            data = b""
            while more := s.recv(65536):
                data += more
            return _status(data)
    except (ConnectionResetError, BrokenPipeError):
        return "reset"


def http_fuzz(port: int, n: int, concurrency: int = 8, seed: int = 0) -> Counter:
    rng = random.Random(seed)
    rngs = [random.Random(rng.random()) for _ in range(n)]
    with ThreadPoolExecutor(concurrency) as pool:
        return Counter(pool.map(lambda r: malformed_http(port, r), rngs))


def slow_connections(ports: tuple[int, ...], n: int) -> list[socket.socket]:
    """``n`` connections to each port: half silent, half trickling a request head (call ``trickle`` to go on)."""
    socks = []
    for port in ports:
        for i in range(n):
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
                if i % 2:
                    s.sendall(b"GET /v1/health/live HTTP/1.1\r\nHost: localhost\r\n")
                socks.append(s)
            except OSError:
                pass
    return socks


def trickle(socks: list[socket.socket]) -> None:
    for s in socks:
        try:
            s.send(b"X: y\r\n")
        except OSError:
            pass
