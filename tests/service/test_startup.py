"""Startup that cannot succeed ends: the real ``dgserve serve`` process exits
with status 2 and one line on stderr naming the problem, the port or file, and the flag / env var that fixes it —
no traceback, no "Event loop is closed", no "coroutine ... was never awaited". The cases run as parallel processes
(each pays the imports once)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

BAD_OUTPUT = ("Traceback", "Event loop is closed", "was never awaited", "Exception ignored")


def _listening() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    return s


@pytest.fixture(scope="module")
def outcomes(model_dir, tmp_path_factory):
    """{case: (returncode, stderr)} for every case, run at once."""
    tmp = tmp_path_factory.mktemp("startup")
    held_grpc, held_http = _listening(), _listening()
    broken = tmp / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "diffusion_gemma", "hidden_size": "wide"}')
    key = tmp / "server.key"
    key.write_text("not used")
    base = ["--model", str(model_dir), "--host", "127.0.0.1", "--port", "0", "--http-port", "0", "--no-warm-up"]
    cases = {
        "grpc_port_in_use": (base + ["--port", str(held_grpc.getsockname()[1])], {}),
        "http_port_in_use": (base + ["--http-port", str(held_http.getsockname()[1])], {}),
        "missing_model": (base + ["--model", str(tmp / "no-such-model")], {}),
        "model_fails_to_load": (base + ["--model", str(broken)], {}),
        "missing_auth_file": (base + ["--auth-token-file", str(tmp / "no-tokens")], {}),
        "missing_tls_cert": (base + ["--tls-cert", str(tmp / "no-cert.pem"), "--tls-key", str(key)], {}),
        "bad_env_value": (base[:4] + ["--http-port", "0"], {"DGSERVE_GRPC_PORT": "fifty"}),
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NIM_", "DGSERVE_"))}
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "dgserve", "serve", *argv],
            env={**env, **extra},
            cwd=tmp,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, (argv, extra) in cases.items()
    }
    try:
        out = {}
        for name, p in procs.items():
            _, err = p.communicate(timeout=180)
            out[name] = (p.returncode, err)
        yield out
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        held_grpc.close()
        held_http.close()


@pytest.mark.parametrize(
    "case, must_say",
    [
        ("grpc_port_in_use", ["gRPC port 127.0.0.1:", "address already in use", "--port", "DGSERVE_GRPC_PORT"]),
        ("http_port_in_use", ["HTTP port 127.0.0.1:", "address already in use", "--http-port", "NIM_SERVER_PORT"]),
        ("missing_model", ["no-such-model", "no such directory", "--model", "NIM_MODEL_PATH"]),
        ("model_fails_to_load", ["broken-model", "failed to load", "--model"]),
        ("missing_auth_file", ["no-tokens", "No such file", "--auth-token-file", "DGSERVE_AUTH_TOKEN_FILE"]),
        ("missing_tls_cert", ["no-cert.pem", "No such file", "--tls-cert"]),
        ("bad_env_value", ["port", "fifty", "DGSERVE_GRPC_PORT"]),
    ],
)
def test_startup_failure_is_one_line_and_exit_2(outcomes, case, must_say):
    code, err = outcomes[case]
    assert code == 2, err
    assert not any(bad in err for bad in BAD_OUTPUT), err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower()]
    assert len(errors) == 1 and errors[0] == lines[-1], err
    assert errors[0].startswith("dgserve serve: error: ")
    for words in must_say:
        assert words in errors[0], errors[0]
    if case != "model_fails_to_load":  # these fail before anything is bound or logged
        assert len(lines) == 1, err
