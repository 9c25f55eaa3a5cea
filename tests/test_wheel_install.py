"""The installed server, tried as a new user would: build the wheel, install it WITHOUT -e into a fresh
venv, and from a directory outside the source tree run ``dgserve serve`` on the shipped small model until gRPC
health says SERVING; then the official ``openai`` client streams a chat completion and ``dgserve generate
--server`` streams blocks from the same process, and SIGTERM ends it with status 0.

No network and no second torch: the fresh venv sees this environment's already-installed dependencies through a
``.pth`` line (not the editable dgserve: that one is activated by a .pth file this path does not process), and the
wheel is installed with ``--no-deps --no-index``.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from wheel_build import build_wheel

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "python" / "dgserve"


def _run(argv, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300, **kw)
    assert r.returncode == 0, f"{argv}\n{r.stdout}\n{r.stderr}"
    return r


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> pathlib.Path:
    """bin/ of a fresh venv holding the dgserve wheel (built from a copy of this tree)."""
    if not (PKG / "v1" / "text_generation_pb2.py").exists():
        pytest.skip("run build.py first (protobuf stubs)")
    tmp = tmp_path_factory.mktemp("wheel")
    wheel = build_wheel(tmp)
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    py = venv / "bin" / "python"
    site = _run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    (pathlib.Path(site) / "outer_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--force-reinstall", str(wheel)], cwd=tmp)
    shutil.rmtree(tmp / "src")  # nothing of the source tree is left to import from
    return venv / "bin"


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("NIM_", "DGSERVE_", "PYTHONPATH"))}


def test_the_wheel_holds_the_server_in_our_namespace(installed, tmp_path):
    code = "import dgserve.service as s, importlib.util as u; print(s.__file__); print(u.find_spec('service'))"
    out = _run([str(installed / "python"), "-c", code], cwd=tmp_path, env=_env()).stdout.split("\n")
    assert out[0].startswith(str(installed.parent)) and "/site-packages/dgserve/service/__init__.py" in out[0]
    assert out[1] == "None", "no top-level `service` module is installed"
    # the built-in pages' files (package data): each one the pages route serves, and the vendored licence
    from dgserve.service.http.playground import ASSETS, PAGES

    static = pathlib.Path(out[0]).parent / "http" / "static"
    for name in [*ASSETS, *PAGES.values(), "uPlot.LICENSE", "README.md"]:
        assert (static / name).is_file(), f"{name} is not in the wheel"


def test_installed_dgserve_serve_from_anywhere(installed, tmp_path):
    proc = subprocess.Popen(
        [str(installed / "dgserve"), "serve", "--host", "127.0.0.1", "--port", "0", "--http-port", "0"],
        cwd=tmp_path,
        env=_env(),
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    ports: dict[str, int] = {}
    seen = threading.Event()

    def read():
        for line in proc.stderr:
            lines.append(line)
            m = re.search(r"listening: gRPC [\d.]+:(\d+), HTTP (\d+)", line)
            if m:
                ports.update(grpc=int(m.group(1)), http=int(m.group(2)))
                seen.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert seen.wait(120), "".join(lines)
        with grpc.insecure_channel(f"127.0.0.1:{ports['grpc']}") as ch:
            health = health_pb2_grpc.HealthStub(ch)
            request = health_pb2.HealthCheckRequest(service="dgserve.v1.TextGeneration")
            deadline = time.monotonic() + 180
            while health.Check(request, timeout=10).status != health_pb2.HealthCheckResponse.SERVING:
                assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
                time.sleep(0.2)
        _both_front_doors(installed, ports, tmp_path)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()


def _both_front_doors(installed, ports, tmp_path) -> None:
    """The official openai client streams a chat completion; `dgserve generate --server` streams blocks."""
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{ports['http']}/v1", api_key="unused", max_retries=0)
    chunks = list(
        client.chat.completions.create(
            model="dgserve-small",
            messages=[{"role": "user", "content": "Tell me about the sea."}],
            stream=True,
            max_tokens=16,
            seed=1,
            extra_body={"max_denoising_steps": 4},
        )
    )
    import httpx

    base = f"http://127.0.0.1:{ports['http']}"
    for path in ("/playground", "/dashboard", "/playground/static/uPlot.iife.min.js"):
        assert httpx.get(base + path, timeout=10).status_code == 200, path
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip() and chunks[-1].choices[0].finish_reason in ("stop", "length")
    r = _run(
        [
            str(installed / "dgserve"),
            "generate",
            "The sea",
            "--server",
            f"127.0.0.1:{ports['grpc']}",
            "--max-new-tokens",
            "16",
            "--max-denoising-steps",
            "4",
            "--seed",
            "1",
        ],
        cwd=tmp_path,
        env=_env(),
    )
    assert r.stdout.strip() and "# finished:" in r.stderr
