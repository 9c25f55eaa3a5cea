"""Helpers for tests/agents: the pinned agent CLIs installed from npm into a cache directory, a ``dgserve serve``
process on free ports with its log, and what the log and ``/metrics`` say about the requests a CLI sent.

What the CLIs send and how they are configured: docs/messages-api.md ("Claude Code") and docs/responses-api.md
("Clients")."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import pytest

from dgserve.model.default_model import default_model_path

# The CLIs, pinned: the current latest of each when this was written (`npm view <package> version`); a plain
# `npm install` once gave a stale one, so the version is always named.
CLAUDE_CODE = ("@anthropic-ai/claude-code", "2.1.332", "claude")
CODEX = ("@openai/codex", "0.171.0", "codex")
CACHE = pathlib.Path(os.environ.get("DGSERVE_AGENT_CLI_CACHE", pathlib.Path.home() / ".cache" / "dgserve-agent-clis"))

# The window the CLIs' default prompts need (Claude Code's is about 19K tokens, Codex's about 14K, plus room to
# answer and for a second turn). The shipped model gets it from its own config.json once it has it; until then
# the tests serve a copy of it whose config.json says so (what the model can do past its trained length is not
# what these tests check: they check the protocol). Set to False, or delete with the copy below, once the shipped
# model has LONG_WINDOW positions.
LONG_WINDOW = 65536

ACCESS = re.compile(r"dgserve\.access \[[^\]]*\] (\w+) (\S+) (\d{3}) ")
SERVED_NAME = "dgserve-small"


def default_model_positions(model_dir: str) -> int:
    config = json.loads(pathlib.Path(model_dir, "config.json").read_text())
    return int(config.get("text_config", config)["max_position_embeddings"])


def long_window_model(tmp_dir: pathlib.Path) -> str:
    """The default model, which must hold LONG_WINDOW positions (the CLIs' default prompts need them)."""
    model = default_model_path()
    positions = default_model_positions(model)
    assert positions >= LONG_WINDOW, f"the default model has {positions} positions, under {LONG_WINDOW}"
    return model


def installed_cli(package: tuple[str, str, str]) -> str:
    """The CLI's executable, installed once into CACHE/<name>-<version> (npm --prefix, not global); skips in one
    line where npm or the npm registry cannot be reached."""
    name, version, binary = package
    prefix = CACHE / f"{name.replace('/', '+')}-{version}"
    exe = prefix / "node_modules" / ".bin" / binary
    if exe.is_file() and version in _run([str(exe), "--version"], 60).stdout:
        return str(exe)
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed: the agent CLIs come from the npm registry")
    view = _run([npm, "view", f"{name}@{version}", "version", "--cache", str(CACHE / "npm-cache")], 120)
    if view.returncode != 0 or version not in view.stdout:
        pytest.skip(f"the npm registry did not answer for {name}@{version}: {view.stderr.strip()[-200:]}")
    shutil.rmtree(prefix, ignore_errors=True)
    prefix.mkdir(parents=True)
    args = ["install", "--prefix", str(prefix), "--cache", str(CACHE / "npm-cache"), "--no-audit", "--no-fund"]
    done = _run([npm, *args, f"{name}@{version}"], 900)
    assert done.returncode == 0, f"npm install {name}@{version} failed:\n{done.stderr[-2000:]}"
    assert version in _run([str(exe), "--version"], 60).stdout
    return str(exe)


def _run(argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        return subprocess.CompletedProcess(argv, 1, "", str(e))


class Server:
    """``dgserve serve`` on 127.0.0.1 with ports chosen by the OS (read from its log), its stderr kept."""

    def __init__(self, model_dir: str, *flags: str):
        exe = pathlib.Path(sys.executable).with_name("dgserve")
        argv = [str(exe), "serve"] if exe.is_file() else [sys.executable, "-m", "dgserve.service"]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("NIM_", "DGSERVE_"))}
        self.proc = subprocess.Popen(
            [*argv, "--model", model_dir, "--served-model-name", SERVED_NAME, "--host", "127.0.0.1"]
            + ["--port", "0", "--http-port", "0", *flags],
            env=env,
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
        )
        self.lines: list[str] = []
        self.http_port: int | None = None
        self._listening = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self._listening.wait(300):
            self.stop()
            raise AssertionError("the server did not report its ports:\n" + "".join(self.lines[-40:]))
        self.url = f"http://127.0.0.1:{self.http_port}"
        with httpx.Client(base_url=self.url, timeout=30) as http:
            while http.get("/v1/health/ready").status_code != 200:  # ready: loaded and warmed up
                assert self.proc.poll() is None, "the server exited:\n" + "".join(self.lines[-40:])
                time.sleep(0.2)
            self.max_model_len = int(http.get("/v1/models").json()["data"][0]["max_model_len"])

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            m = re.search(r"listening: gRPC [\d.]+:\d+, HTTP (\d+)", line)
            if m:
                self.http_port = int(m.group(1))
                self._listening.set()

    def requests(self, since: int = 0) -> list[tuple[str, str, int]]:
        """(method, path, status) of every request in the access log from line ``since`` on."""
        return [(m[1], m[2], int(m[3])) for line in self.lines[since:] if (m := ACCESS.search(line))]

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=30).text
        names = ("dgserve_prompt_tokens_total", "dgserve_prefix_cache_hits_total", "dgserve_generation_tokens_total")
        return {n: float(line.split()[-1]) for line in text.splitlines() for n in names if line.startswith(n + " ")}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def cli_env(home: pathlib.Path, **settings: str) -> dict[str, str]:
    """A clean environment for a CLI: its own HOME, PATH (node for Claude Code's launcher), and ``settings``."""
    env = {"HOME": str(home), "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}
    env["TMPDIR"] = tempfile.gettempdir()
    return {**env, **settings}


class Turn:
    """One run of a CLI: its exit status, output, wall time and the requests the server logged meanwhile."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: pathlib.Path, server: Server, timeout: float):
        since, before = len(server.lines), server.metrics()
        start = time.monotonic()
        try:
            done = subprocess.run(
                argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
            )
        except subprocess.TimeoutExpired as e:
            raise AssertionError(f"{argv[0]} ran past {timeout} s; server log:\n" + "".join(server.lines[-20:])) from e
        self.seconds = time.monotonic() - start
        self.rc, self.stdout, self.stderr = done.returncode, done.stdout, done.stderr
        time.sleep(0.5)  # the access line is written as the response ends, just after the CLI has it
        self.requests = self.all_requests = server.requests(since)  # all_requests: run_turn's attempts too
        after = server.metrics()
        self.delta = {k: after[k] - before.get(k, 0.0) for k in after}

    def describe(self) -> str:
        posts = [r for r in self.requests if r[0] == "POST"]
        return (
            f"{self.seconds:.1f} s, exit {self.rc}, {len(posts)} POSTs {sorted({r[2] for r in posts})}, "
            f"prompt tokens {self.delta.get('dgserve_prompt_tokens_total', 0):.0f} "
            f"(prefix cache hits {self.delta.get('dgserve_prefix_cache_hits_total', 0):.0f})"
        )

    def failed_requests(self) -> list[tuple[str, str, int]]:
        return [r for r in self.requests if r[2] >= 400]
