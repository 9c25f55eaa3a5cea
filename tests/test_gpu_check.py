"""scripts/gpu_check.sh rehearsed on the CPU: its steps (--dry-run), its pytest runs collected where only the GPU
image's packages can be imported (tests/gpu_image/sitecustomize.py), and its kernel launcher on the CPU paths."""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from dgserve import ops

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
STEPS = ("device", "build", "cuda-build", "pytest-cuda", "self-check", "memcheck", "racecheck", "big-step")
STEPS += ("bench-nvfp4", "bench-bf16", "synccheck")
# the service's packages, absent from the GPU image
ABSENT = ("grpc_health", "grpc_reflection", "jsonschema", "llguidance", "fastapi", "starlette", "uvicorn", "openai")
ABSENT += ("transformers", "httpx", "hypothesis")


def _gpu_image_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests" / "gpu_image"), str(ROOT / "python")])
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # this venv's plugins (hypothesis, anyio) are not in the image
    return env


def _script(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=60, **kw)


def pytest_commands() -> list[list[str]]:
    r = _script("--print-pytest-commands")
    assert r.returncode == 0, r.stderr
    return [shlex.split(line) for line in r.stdout.splitlines() if line.strip()]


def test_script_parses_and_dry_run_lists_every_step_without_running_or_writing(tmp_path):
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    out = tmp_path / "out"
    r = _script("--dry-run", env={**os.environ, "OUT": str(out), "JOBS": "16"})
    assert r.returncode == 0, r.stderr
    names = [m.group(1) for m in re.finditer(r"^\[dry-run\] (\S+) \(at most (\d+)s\)", r.stdout, re.M)]
    assert names == list(STEPS), r.stdout
    assert "build.py --arch native --jobs 16" in r.stdout
    assert "--leak-check no" in r.stdout and "PYTORCH_NO_CUDA_MEMORY_CACHING=1" in r.stdout
    assert "--shape 26b-a4b" in r.stdout and "--experts nvfp4" in r.stdout
    assert not out.exists()  # a dry run writes nothing


def test_every_cuda_test_file_is_in_the_pytest_runs():
    named = {a for cmd in pytest_commands() for a in cmd if a.startswith("tests/")}
    marked = {
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").rglob("test_*.py")
        if re.search(r"pytest\.mark\.cuda|pytestmark = pytest\.mark\.cuda", p.read_text())
    }
    assert marked and named == marked


def test_the_gpu_image_blocker_refuses_the_service_packages_only():
    code = (
        f"import importlib\nfor m in {ABSENT!r}:\n"
        "    try:\n        importlib.import_module(m)\n    except ImportError:\n        continue\n"
        "    raise SystemExit(m + ' was importable')\n"
        "import torch, numpy, safetensors, grpc, google.protobuf, pytest, dgserve.engine.engine, dgserve.ops\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_gpu_image_env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("index", range(len(pytest_commands())))
def test_each_pytest_run_collects_with_only_the_gpu_image_packages(index):
    args = pytest_commands()[index]
    i = args.index("-n")  # pytest-xdist's worker count: the collection is the same without it
    del args[i : i + 2]
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", *args],
        cwd=ROOT,
        env=_gpu_image_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "error" not in out.lower(), out[-3000:]
    m = re.search(r"(\d+)(?:/\d+)? tests? collected", out)
    assert m and int(m.group(1)) >= 50, out[-2000:]


@pytest.mark.skipif(ops.native._C is None, reason="dgserve._C is not built")
def test_kernel_launcher_and_big_step_run_on_the_cpu_paths():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python")}
    run = [sys.executable, str(ROOT / "scripts" / "gpu_kernels.py")]
    r = subprocess.run([*run, "launch", "--device", "cpu"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "every kernel ran" in r.stdout, r.stdout + r.stderr
    small = ["--rows", "3", "--canvas", "8", "--vocab", "1000"]
    r = subprocess.run([*run, "big-step", "--device", "cpu", *small], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and ": ok" in r.stdout, r.stdout + r.stderr
