"""Helpers for the service tests: a real dgserve server on 127.0.0.1 (ephemeral ports) on its own event loop
thread, and request builders."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _ensure_stubs() -> None:
    """build.py writes the stubs (python build.py --no-ext); generate them here when it has not run yet."""
    try:
        from dgserve.v1 import text_generation_pb2  # noqa: F401
    except ImportError:
        from grpc_tools import protoc

        protos = [str(p.relative_to(ROOT / "proto")) for p in (ROOT / "proto").rglob("*.proto")]
        assert (
            protoc.main(
                [
                    "protoc",
                    "-I",
                    str(ROOT / "proto"),
                    f"--python_out={ROOT / 'python'}",
                    f"--grpc_python_out={ROOT / 'python'}",
                    *protos,
                ]
            )
            == 0
        )


_ensure_stubs()

from dgserve.service.config import ServiceConfig  # noqa: E402
from dgserve.service.server import Server  # noqa: E402
from dgserve.v1 import text_generation_pb2 as pb  # noqa: E402


class ServerThread:
    """A Server on a private event loop thread. ``call(coro_fn)`` runs a coroutine there and returns its result."""

    def __init__(self, config: ServiceConfig, engine_factory=None, wait_ready: bool = True):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server: Server = self.call(lambda: self._make(config, engine_factory))
        self.call(self.server.start)
        if wait_ready:
            self.call(self.server.loaded.wait, timeout=120)
        self.target = f"127.0.0.1:{self.server.port}"

    @staticmethod
    async def _make(config, factory):
        return Server(config, factory)

    def call(self, coro_fn, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro_fn(), self.loop).result(timeout)

    @property
    def engine(self):
        return self.server.state.engine

    @property
    def http_url(self) -> str:
        """The HTTP door's base URL (no trailing slash, no /v1)."""
        return f"http://127.0.0.1:{self.server.http_port}"

    def stop(self, grace: float = 0) -> None:
        try:
            self.call(lambda: self.server.drain(grace))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


def base_config(model_dir, **kw) -> ServiceConfig:
    base = dict(
        model=str(model_dir),
        host="127.0.0.1",
        port=0,
        http_port=0,
        max_num_seqs=4,
        max_queue_len=4,
        drain_timeout=5.0,
        served_model_name=("tiny", "tiny-alias"),
    )
    base.update(kw)
    return ServiceConfig(**base)


@contextlib.contextmanager
def running(config: ServiceConfig, **kw) -> Iterator[ServerThread]:
    """A server of its own for the with block, stopped at its end; ``kw`` go to ``ServerThread`` (engine_factory,
    wait_ready)."""
    s = ServerThread(config, **kw)
    try:
        yield s
    finally:
        s.stop()


def auth_config(model_dir, directory: pathlib.Path, tokens: tuple[str, ...], **kw) -> ServiceConfig:
    """``base_config`` with auth on: ``tokens`` written to a token file in ``directory``."""
    path = directory / "tokens"
    path.write_text("".join(f"{t}\n" for t in tokens))
    return base_config(model_dir, auth_token_file=str(path), **kw)


def params(**kw) -> pb.SamplingParams:
    base = dict(max_new_tokens=40, max_denoising_steps=4, seed=7)
    base.update(kw)
    return pb.SamplingParams(**base)


def long_params(**kw) -> pb.SamplingParams:
    """A request that runs for many engine steps (ignores EOS, many blocks)."""
    base = dict(max_new_tokens=16 * 200, max_denoising_steps=8, seed=1, ignore_eos=True)
    base.update(kw)
    return pb.SamplingParams(**base)


def bad_request_field(err) -> str:
    """The field of a grpc.RpcError's google.rpc BadRequest detail ("" when it has none)."""
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status

    for d in rpc_status.from_call(err).details:
        if d.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            msg = error_details_pb2.BadRequest()
            d.Unpack(msg)
            return msg.field_violations[0].field
    return ""


def http_status(port: int, path: str, timeout: float = 10) -> int:
    """The status of a GET of ``path`` on the HTTP door at ``port`` of 127.0.0.1 (an error status too)."""
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout).status
    except urllib.error.HTTPError as e:
        return e.code


def scrape_metrics(port: int) -> list:
    """Every sample (prometheus_client's ``Sample``: name, labels, value) of /metrics on the HTTP door at
    ``port`` of 127.0.0.1, parsed by prometheus_client."""
    from prometheus_client.parser import text_string_to_metric_families

    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return [s for family in text_string_to_metric_families(body) for s in family.samples]


def metric_value(samples: list, name: str, **labels: str) -> float:
    """The value of the first sample named ``name`` whose labels include ``labels`` (0 when there is none)."""
    for s in samples:
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    return 0.0


# A wait that only prevents a hang: what a test asserts is the event it waits for, never how soon it came, so this is
# generous for a loaded machine.
HANG_GUARD_S = 60.0


def post_then_hang_up(base_url: str, path: str, body: dict, in_flight) -> None:
    """POST ``body`` (JSON) to ``base_url + path`` and close the connection without reading the answer once
    ``in_flight()`` holds: a client giving up, at a moment set by an event rather than a read timeout."""
    import json
    import socket
    from urllib.parse import urlsplit

    u = urlsplit(base_url)
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: {u.hostname}\r\ncontent-type: application/json\r\n"
    with socket.create_connection((u.hostname, u.port), timeout=HANG_GUARD_S) as s:
        s.sendall(f"{head}content-length: {len(data)}\r\n\r\n".encode() + data)
        wait_until(in_flight, timeout=HANG_GUARD_S)


def wait_until(condition, timeout: float = 10.0, interval: float = 0.01) -> None:
    import time

    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)


def make_certs(d: pathlib.Path, clients: tuple[str, ...]) -> pathlib.Path:
    """A test PKI in ``d``: ca.{key,pem}, server.{key,pem} (SAN localhost, 127.0.0.1) and ``<name>.{key,pem}``
    (CN name) for each client, all EC P-256 certificates the CA signed, valid one day. Skips without openssl."""
    import pytest

    if shutil.which("openssl") is None:
        pytest.skip("openssl not found")

    def ssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    ssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=test-ca")
    (d / "san.cnf").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for name in ("server", *clients):
        ssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        # SAN on the server only: grpc names a client by its SANs when it has any, else by its CN, and the Abort
        # scoping test needs alice and bob to be different identities
        san = ["-extfile", "san.cnf"] if name == "server" else []
        ssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.pem",
            "-days",
            "1",
            *san,
        )
    return d


@contextlib.contextmanager
def child_cgroup(
    controller: str, set_limits: Callable[[pathlib.Path, int], None]
) -> Iterator[tuple[pathlib.Path, int]]:
    """(directory, version) of a new child of this process's ``controller`` cgroup (``dgserve.engine.cgroups``), with
    ``set_limits(directory, version)`` written into it; the test is skipped, with the reason, when no such hierarchy
    holds this process or the child or its limits cannot be made. Removed afterwards (once its processes are gone)."""
    import pytest

    from dgserve.engine.cgroups import controller_dirs

    dirs = controller_dirs(pathlib.Path("/"), controller)
    if not dirs:
        pytest.skip(f"no {controller} cgroup hierarchy holds this process")
    parent, version = dirs[0]
    d = parent / f"dgserve-{controller}-test-{os.getpid()}"
    try:
        d.mkdir()
    except OSError as e:
        pytest.skip(f"cannot create a {controller} cgroup under {parent}: {e}")
    try:
        try:
            set_limits(d, version)
        except OSError as e:
            pytest.skip(f"cannot set {controller} limits on {d}: {e}")
        yield d, version
    finally:
        for _ in range(50):
            try:
                d.rmdir()
                break
            except OSError:
                time.sleep(0.1)
