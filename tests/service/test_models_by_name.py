"""Models by name (docs/deployment.md, "Models by name"): ``--model org/name`` and ``dgserve download`` against a
local Hub stand-in (tests/hub_standin.py) through huggingface_hub's real client, in real processes: download and
serve, a revision pin, a gated repository, a resumed download, the offline cache, NVFP4 and FP8 checkpoints served as
they are by path, and each failure as one line and exit status 2. Nothing leaves 127.0.0.1."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import threading
import time

import httpx
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from hub_standin import HubStandIn, read_dir

from dgserve import Engine, SamplingParams
from dgserve.client import Client

BAD_OUTPUT = ("Traceback", "Event loop is closed", "was never awaited")
SERVE = [sys.executable, "-m", "dgserve.service", "--host", "127.0.0.1", "--port", "0", "--http-port", "0"]
DOWNLOAD = [sys.executable, "-m", "dgserve", "download"]


def _env(endpoint: str, home: pathlib.Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NIM_", "DGSERVE_", "HF_"))}
    return {**env, "HF_ENDPOINT": endpoint, "HF_HOME": str(home), "HF_HUB_DISABLE_TELEMETRY": "1", **extra}


@pytest.fixture(scope="module")
def checkpoint(model_dir) -> dict[str, bytes]:
    return read_dir(model_dir)


@pytest.fixture(scope="module")
def hub(checkpoint):
    h = HubStandIn()
    h.add("acme/tiny", {**checkpoint, "README.md": b"# tiny", "pytorch_model.bin": b"x" * 1000})
    h.add("acme/pinned", {**checkpoint, "special_tokens_map.json": b'{"v": 1}'}, refs=("v1",))
    h.add("acme/pinned", {**checkpoint, "special_tokens_map.json": b'{"v": 2}'}, refs=("main",))
    h.add("acme/gated", checkpoint, gated=True)
    config = json.loads(checkpoint["config.json"])
    h.add("acme/llama", {**checkpoint, "config.json": json.dumps({**config, "model_type": "llama"}).encode()})
    gptq = {**config, "quantization_config": {"quant_method": "gptq", "bits": 4}}
    h.add("acme/gptq", {**checkpoint, "config.json": json.dumps(gptq).encode()})
    big = os.urandom(24 << 20)  # above huggingface_hub's 10 MiB write chunk: a cut leaves bytes to resume from
    h.add("acme/resume", {"config.json": checkpoint["config.json"], "model.safetensors": big})
    h.drop_once.add("acme/resume/model.safetensors")  # that repository's only: other tests download theirs whole
    with h:
        yield h


# tiny quantized checkpoints under ids like the real exports', with the files such repositories carry besides the
# checkpoint, which serving never reads (docs/kernels.md, "NVFP4 checkpoints" and "FP8 checkpoints")
NVFP4_ID = "nvidia/tiny-diffusiongemma-NVFP4"
FP8_ID = "RedHatAI/tiny-diffusiongemma-FP8-dynamic"
NOT_SERVED = {
    NVFP4_ID: {".gitattributes": b"*.safetensors filter=lfs", "README.md": b"# NVFP4", "LICENSE": b"licence"},
    FP8_ID: {".gitattributes": b"*.safetensors filter=lfs", "README.md": b"# FP8", "recipe.yaml": b"scheme: FP8"},
}


@pytest.fixture(scope="module")
def quantized(hub, model_dir, tmp_path_factory) -> dict[str, pathlib.Path]:
    """The tiny checkpoint exported as ModelOpt NVFP4 (sharded: an index and hf_quant_config.json, as NVIDIA's
    exports) and as compressed-tensors FP8 dynamic, each added to the stand-in: repository id -> its directory."""
    import torch
    from fp8_checkpoint import write_fp8_checkpoint

    from dgserve.model.quantize import quantize_checkpoint

    root = tmp_path_factory.mktemp("quantized")
    dirs = {
        NVFP4_ID: quantize_checkpoint(model_dir, root / "nvfp4", torch.float32, shard_bytes=200_000),
        FP8_ID: write_fp8_checkpoint(pathlib.Path(model_dir), root / "fp8"),
    }
    for repo_id, path in dirs.items():
        hub.add(repo_id, {**read_dir(path), **NOT_SERVED[repo_id]})
    return dirs


def _one_line_failure(proc: subprocess.CompletedProcess, *must_say: str) -> str:
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert not any(b in proc.stderr for b in BAD_OUTPUT), proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert re.match(r"dgserve (serve|download): error: ", line), proc.stderr[-2000:]
    for s in must_say:
        assert s in line, line
    return line


@pytest.mark.parametrize(
    "case, model, extra_args, extra_env, must_say",
    [
        ("gated_no_token", "acme/gated", [], {}, ["gated", "HF_TOKEN", "https://huggingface.co/acme/gated"]),
        ("unknown_repo", "acme/nothing", [], {}, ["acme/nothing", "no such repository"]),
        ("unknown_revision", "acme/tiny", ["--revision", "nope"], {}, ["'nope'", "does not exist", "--revision"]),
        ("not_diffusiongemma", "acme/llama", [], {}, ["not a DiffusionGemma", "model_type is 'llama'"]),
        ("unsupported_quant", "acme/gptq", [], {}, ["quant_method 'gptq'", "modelopt", "compressed-tensors"]),
        ("offline_not_cached", "acme/tiny", [], {"HF_HUB_OFFLINE": "1"}, ["HF_HUB_OFFLINE", "cache"]),
    ],
)
def test_failures_are_one_line_and_exit_2(hub, tmp_path, case, model, extra_args, extra_env, must_say):
    argv = [*SERVE, "--model", model, "--no-warm-up", *extra_args]
    proc = subprocess.run(
        argv, env=_env(hub.endpoint, tmp_path, **extra_env), capture_output=True, text=True, timeout=300
    )
    _one_line_failure(proc, f"model {model}", *must_say)


def test_no_network_and_nothing_cached(tmp_path):
    dead = HubStandIn().start()
    endpoint = dead.endpoint
    dead.stop()  # nothing listens there now
    argv = [*SERVE, "--model", "acme/tiny", "--no-warm-up"]
    proc = subprocess.run(argv, env=_env(endpoint, tmp_path), capture_output=True, text=True, timeout=300)
    _one_line_failure(proc, "acme/tiny", "cannot be reached", "not (completely) in the cache")


def test_not_enough_disk(hub, tmp_path):
    """The files' sizes from the Hub's metadata against the cache's free disk, before anything is downloaded."""
    code = (
        "import collections, shutil, sys\n"
        "shutil.disk_usage = lambda p: collections.namedtuple('u', 'total used free')(10**6, 10**6 - 1000, 1000)\n"
        "from dgserve.__main__ import main\n"
        "sys.exit(main(['download', 'acme/tiny']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=_env(hub.endpoint, tmp_path), capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    _one_line_failure(proc, "not enough free disk", "1.0 KB free", "--download-dir", "NIM_CACHE_PATH")
    assert not list(tmp_path.rglob("*.safetensors")), "nothing is downloaded"


def test_download_prints_the_snapshot_only_serving_files(hub, tmp_path):
    proc = subprocess.run([*DOWNLOAD, "acme/tiny"], env=_env(hub.endpoint, tmp_path), capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    snapshot = pathlib.Path(proc.stdout.strip())
    assert snapshot.parent.name == "snapshots" and snapshot.is_relative_to(tmp_path / "hub")
    names = {p.name for p in snapshot.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    assert not names & {"README.md", "pytorch_model.bin"}, names


def test_revision_pin(hub, tmp_path):
    env = _env(hub.endpoint, tmp_path)
    out = {}
    for rev in ("v1", "main", hub.repos["acme/pinned"].refs["v1"]):
        proc = subprocess.run([*DOWNLOAD, "acme/pinned", "--revision", rev], env=env, capture_output=True, text=True,
                              timeout=300)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
        out[rev] = pathlib.Path(proc.stdout.strip())
    v1 = hub.repos["acme/pinned"].refs["v1"]
    assert out["v1"].name == v1 and out[v1] == out["v1"] and out["main"].name != v1
    assert (out["v1"] / "special_tokens_map.json").read_bytes() == b'{"v": 1}'
    assert (out["main"] / "special_tokens_map.json").read_bytes() == b'{"v": 2}'


def test_interrupted_download_resumes(hub, tmp_path):
    """The stand-in cuts model.safetensors mid-body once; huggingface_hub resumes with a Range request, and with
    --json-logs each file logs one line when it starts and one when it is done, with bytes and rate."""
    proc = subprocess.run([*DOWNLOAD, "acme/resume", "--json-logs"], env=_env(hub.endpoint, tmp_path),
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    gets = [rng for method, path, rng in hub.requests if method == "GET" and path.startswith("/acme/resume/resolve")
            and path.endswith("model.safetensors")]  # fmt: skip
    assert len(gets) == 2 and gets[0] is None and re.fullmatch(r"bytes=[1-9][0-9]*-", gets[1] or ""), gets
    data = (pathlib.Path(proc.stdout.strip()) / "model.safetensors").read_bytes()
    sha = hub.repos["acme/resume"].refs["main"]
    assert data == hub.repos["acme/resume"].commits[sha]["model.safetensors"]
    lines = [json.loads(x) for x in proc.stderr.splitlines() if x.startswith("{")]
    done = [x for x in lines if x["message"].startswith("download finished: model.safetensors")]
    started = [x for x in lines if x["message"].startswith("download started: model.safetensors")]
    assert len(started) == 1 and len(done) == 1, lines
    assert done[0]["bytes"] == len(data) and done[0]["bytes_per_second"] > 0


class _Served:
    """A ``dgserve serve`` process; its HTTP base URL and gRPC target from the 'listening' log line."""

    def __init__(self, argv: list[str], env: dict[str, str]):
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.url = self.target = ""
        found = threading.Event()

        def read():
            for line in self.proc.stderr:  # type: ignore[union-attr]
                self.lines.append(line)
                m = re.search(r"listening: gRPC (\S+), HTTP (\d+)", line)
                if m:
                    self.target, self.url = m.group(1), f"http://127.0.0.1:{m.group(2)}"
                    found.set()

        threading.Thread(target=read, daemon=True).start()
        assert found.wait(240), "".join(self.lines)[-2000:]

    def wait_ready(self, timeout: float = 240) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            assert self.proc.poll() is None, "".join(self.lines)[-2000:]
            if httpx.get(self.url + "/v1/health/ready", timeout=10).status_code == 200:
                return
            time.sleep(0.2)
        raise AssertionError("not ready: " + "".join(self.lines)[-2000:])

    def answers(self, model: str) -> dict:
        r = httpx.post(self.url + "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 4},
                       timeout=120)  # fmt: skip
        assert r.status_code == 200, r.text
        return httpx.get(self.url + "/v1/models", timeout=10).json()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def test_serve_by_id_live_but_not_ready_while_downloading(hub, tmp_path):
    hub.hold = threading.Event()
    try:
        s = _Served([*SERVE, "--model", "acme/tiny", "--no-warm-up"], _env(hub.endpoint, tmp_path))
        try:
            end = time.monotonic() + 120
            weights = re.compile(r"/acme/tiny/resolve/[^/]+/model\.safetensors")
            while not any(m == "GET" and weights.fullmatch(p) for m, p, _ in hub.requests):
                assert time.monotonic() < end, "".join(s.lines)[-2000:]
                time.sleep(0.1)
            assert httpx.get(s.url + "/v1/health/live", timeout=10).status_code == 200
            assert httpx.get(s.url + "/v1/health/ready", timeout=10).status_code == 503
            hub.hold.set()
            s.wait_ready()
            models = s.answers("acme/tiny")
            assert models["data"][0]["id"] == "acme/tiny" and models["data"][0]["root"] == "acme/tiny"
        finally:
            s.stop()
    finally:
        hub.hold.set()
        hub.hold = None


def test_gated_served_with_token_then_offline_from_cache(checkpoint, tmp_path):
    """HF_TOKEN opens the gated repository; then, the stand-in stopped, HF_HUB_OFFLINE=1 serves it from the cache."""
    h = HubStandIn().start()
    h.add("acme/gated", checkpoint, gated=True)
    env = _env(h.endpoint, tmp_path, HF_TOKEN=h.token)
    try:
        s = _Served([*SERVE, "--model", "acme/gated", "--no-warm-up"], env)
        try:
            s.wait_ready()
            s.answers("acme/gated")
        finally:
            s.stop()
    finally:
        h.stop()
    offline = {**env, "HF_HUB_OFFLINE": "1"}
    offline.pop("HF_TOKEN")
    s = _Served([*SERVE, "--no-warm-up"], {**offline, "NIM_MODEL_NAME": "acme/gated"})
    try:
        s.wait_ready()
        assert s.answers("acme/gated")["data"][0]["root"] == "acme/gated"
    finally:
        s.stop()


@pytest.mark.parametrize(
    "repo_id, expert_format",
    [(NVFP4_ID, "nvfp4 (dequantized to float32)"), (FP8_ID, "fp8 (dequantized to float32)")],
    ids=["nvfp4", "fp8"],
)
def test_quantized_served_by_id_as_by_path(hub, quantized, tmp_path, repo_id, expert_format):
    """An NVFP4 or FP8 checkpoint named by id: the snapshot holds exactly the checkpoint's files (hf_quant_config.json
    and the shard index included, the repository's other files never fetched), and the server runs that format and
    answers a seeded request with the tokens of an Engine loaded from the checkpoint's directory by path."""
    s = _Served([*SERVE, "--model", repo_id, "--no-warm-up"], _env(hub.endpoint, tmp_path))
    try:
        s.wait_ready()
        with Client(s.target) as c:
            info = c.model_info()
            got = c.generate_text("the quick brown fox", max_new_tokens=32, max_denoising_steps=2, seed=5, stop=None)
    finally:
        s.stop()
    local = quantized[repo_id]
    engine = Engine.from_pretrained(local)
    want = engine.generate("the quick brown fox", SamplingParams(max_new_tokens=32, max_denoising_steps=2, seed=5))
    assert info.expert_format == engine.runtime_info()["expert_format"] == expert_format
    assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    sha = hub.repos[repo_id].refs["main"]
    snapshot = tmp_path / "hub" / f"models--{repo_id.replace('/', '--')}" / "snapshots" / sha
    served, files = read_dir(snapshot), read_dir(local)
    assert sorted(served) == sorted(files) and served == files
    prefix = f"/{repo_id}/resolve/"
    fetched = {
        p.removeprefix(prefix).split("/", 1)[1] for m, p, _ in hub.requests if m == "GET" and p.startswith(prefix)
    }
    assert fetched == set(files), fetched


def _dry_run(env: dict[str, str], *args: str) -> dict:
    proc = subprocess.run([*SERVE, "--dry-run", *args], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and not any(b in proc.stderr for b in BAD_OUTPUT), proc.stderr[-2000:]
    return json.loads(proc.stdout)


@pytest.mark.parametrize(
    "case, model, extra_env, must_say",
    [
        ("gated", "acme/gated", {}, ["gated", "HF_TOKEN"]),
        ("offline_not_cached", "acme/tiny", {"HF_HUB_OFFLINE": "1"}, ["HF_HUB_OFFLINE", "dgserve download"]),
        ("unreachable", "acme/tiny", {"HF_ENDPOINT": "http://127.0.0.1:9"}, ["cannot be reached"]),
        ("unknown", "acme/nothing", {}, ["no such repository"]),
    ],
)
def test_dry_run_by_id_reports_the_problem_in_one_line(hub, tmp_path, case, model, extra_env, must_say):
    out = _dry_run({**_env(hub.endpoint, tmp_path), **extra_env}, "--model", model)
    problem = out["runtime"]["problem"]
    assert "\n" not in problem and model in problem and "Traceback" not in problem, problem
    for s in must_say:
        assert s in problem, problem
    assert not list(tmp_path.rglob("*.safetensors"))  # a dry run never fetches weights


def test_dry_run_by_id_plans_from_config_alone_via_the_nim_variables(hub, tmp_path):
    """NIM_MODEL_NAME names the model, NIM_CACHE_PATH is the cache: the dry run fetches config.json there only."""
    cache = tmp_path / "nim-cache"
    env = {**_env(hub.endpoint, tmp_path / "home"), "NIM_MODEL_NAME": "acme/tiny", "NIM_CACHE_PATH": str(cache)}
    out = _dry_run(env)
    assert (out["model"], out["download_dir"]) == ("acme/tiny", str(cache))
    assert out["runtime"]["problem"] is None and out["runtime"]["expert_format"] == "dense float32"
    assert [p.name for p in cache.rglob("config.json")] == ["config.json"] and not list(cache.rglob("*.safetensors"))


def test_revision_with_a_local_directory_is_an_error(model_dir, tmp_path):
    proc = subprocess.run(
        [*SERVE, "--model", str(model_dir), "--revision", "v1", "--dry-run"],
        env=_env("http://127.0.0.1:9", tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    _one_line_failure(proc, "revision 'v1'", "local path", "--revision")
