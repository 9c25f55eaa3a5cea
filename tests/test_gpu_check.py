"""scripts/gpu_check.sh rehearsed on the CPU: its steps in order (--dry-run), its pytest runs collected where only
the GPU image's packages can be imported (tests/gpu_image/sitecustomize.py), and every Python command of the dry
run on the CPU (the build's check, the self-check, both benches on the tiny shape, the kernel launcher of the
sanitizers and the big step on small shapes)."""

from __future__ import annotations

import json
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
# correctness first, then the figures, then the long tails
STEPS = ("device", "build", "cuda-build", "self-check", "pytest-cuda", "bench-nvfp4", "bench-bf16", "big-step")
STEPS += ("memcheck", "racecheck", "synccheck")
_DRY = re.compile(r"^\[dry-run\] (\S+) \(at most (\d+)s, skipped under (\d+)s\) > (\S+): (.*)$", re.M)
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


def dry_run(**env: str) -> list[tuple[str, int, int, str]]:
    """(step, cap s, least s, command) of each step of ``--dry-run``, in order."""
    r = _script("--dry-run", env={**os.environ, **env})
    assert r.returncode == 0, r.stderr
    return [(m[1], int(m[2]), int(m[3]), m[5]) for m in _DRY.finditer(r.stdout)]


def test_script_parses_and_dry_run_lists_every_step_without_running_or_writing(tmp_path):
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    out = tmp_path / "out"
    steps = dry_run(OUT=str(out), JOBS="16")
    assert [name for name, *_ in steps] == list(STEPS)
    cmd = {name: command for name, _, _, command in steps}
    assert "build.py --arch native --jobs 16" in cmd["build"]
    assert "-n 8 " in cmd["pytest-cuda"] and cmd["pytest-cuda"].startswith("env OMP_NUM_THREADS=2 ")  # 16 cores / 8
    assert "--leak-check no" in cmd["memcheck"] and "PYTORCH_NO_CUDA_MEMORY_CACHING=1" in cmd["memcheck"]
    assert "--shape 26b-a4b" in cmd["bench-nvfp4"] and "--experts nvfp4" in cmd["bench-nvfp4"]
    least = {name: m for name, _, m, _ in steps}
    assert least["bench-nvfp4"] == least["bench-bf16"] == 60 and least["big-step"] == 15
    assert not out.exists()  # a dry run writes nothing


def test_threads_per_worker_follow_the_cores():
    for jobs, workers, threads in (("16", 8, 2), ("8", 4, 2), ("2", 1, 2), ("32", 8, 4)):
        cmd = {name: c for name, _, _, c in dry_run(JOBS=jobs)}["pytest-cuda"]
        assert f"env OMP_NUM_THREADS={threads} " in cmd and f" -n {workers} " in cmd, (jobs, cmd)


def test_a_step_with_less_than_its_least_time_left_is_skipped_and_listed(tmp_path):
    """With a budget of 10 s, the first step (device) is skipped rather than cut, and so the build, which stops
    the run: the summary says so."""
    out = tmp_path / "out"
    r = _script(env={**os.environ, "OUT": str(out), "BUDGET": "10"})
    summary = (out / "summary.txt").read_text()
    assert re.search(r"^device +skipped +0s +needs 15 s, \d+ s of the budget left$", summary, re.M), summary
    assert re.search(r"^build +skipped", summary, re.M) and "pytest-cuda" not in summary, summary
    assert r.returncode == 0, r.stdout + r.stderr  # nothing failed; nothing ran


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


# How each Python command of the dry run is rehearsed on the CPU: the arguments that change (cuda → cpu, the
# 26B shape → tiny, small sizes), and what its output must show.
_ON_CPU = {"--device": "cpu", "--shape": "tiny"}
_BENCH = "--prompt-len 32 --out-len 16 --long-prompt 48 --concurrency 1 --steps 8".split()
_SMALL = {
    "bench-bf16": _BENCH,
    # the NVFP4 experts' weights and plan; no figure (their CPU reference is slow, the figures' code is bf16's)
    "bench-nvfp4": [*_BENCH, "--max-seconds", "0"],
    "big-step": "--rows 3 --canvas 8 --vocab 1000".split(),
}


def _python_command(name: str, command: str) -> list[str]:
    """The step's command from the first Python script or module on (past env and compute-sanitizer), on the CPU."""
    argv = shlex.split(command)
    start = next(i for i, a in enumerate(argv) if a == "-m" or a.endswith(".py"))
    argv = [sys.executable, *argv[start:]]
    for i, a in enumerate(argv[:-1]):
        if a in _ON_CPU:
            argv[i + 1] = _ON_CPU[a]
    if argv[1:4] == ["-m", "dgserve.ops.native_check", "cuda"]:
        argv[3] = "cpu"
    if argv[1].endswith("gpu_kernels.py") and "--device" not in argv:
        argv += ["--device", "cpu"]
    return argv + _SMALL.get(name, [])


_REHEARSED = {  # step -> what its CPU run prints
    "cuda-build": "build-info: serves cpu: rms_norm",
    "self-check": "passed",
    "bench-nvfp4": '"figure": "done"',
    "bench-bf16": '"figure": "done"',
    "big-step": ": ok",
    "memcheck": "every kernel ran",
    "racecheck": "every kernel ran",
    "synccheck": "every kernel ran",
}


def test_every_python_step_is_rehearsed():
    """Each step but the machine's facts, the build (CI builds the CPU and the CUDA extension) and the pytest runs
    (collected above) has its CPU rehearsal below."""
    assert set(_REHEARSED) == set(STEPS) - {"device", "build", "pytest-cuda"}


@pytest.mark.skipif(ops.native._C is None, reason="dgserve._C is not built")
@pytest.mark.parametrize("name", sorted(_REHEARSED))
def test_each_python_step_runs_on_the_cpu(name):
    command = {n: c for n, _, _, c in dry_run(PYTHON=sys.executable, JOBS="2")}[name]
    argv = _python_command(name, command)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python")}
    r = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and _REHEARSED[name] in out, f"{argv}\n{out[-3000:]}"
    lines = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    rows = {row["figure"]: row for row in lines if "figure" in row}
    if name.startswith("bench-"):  # the KV budget held a slot per request of the batch-16 step
        plan = rows["kv_plan"]
        assert plan["slots"] == plan["slots_wanted"] == 16 and plan["max_model_len"] >= 48 + 16, plan
    if name == "bench-bf16":
        assert rows["step_b16"]["slots"] == 16 and "waves" not in rows["step_b16"], rows["step_b16"]
        assert rows["tok_s_c1"]["running"] == 1 and rows["baseline_step_b16"]["ms_per_step"] > 0, rows
