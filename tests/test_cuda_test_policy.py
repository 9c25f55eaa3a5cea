"""The `cuda` test policy: a `cuda` test skips on a machine without a CUDA device and FAILS on
one whose dgserve._C cannot run the CUDA kernels (missing, built CPU-only because torch was a CPU build or
nvcc was missing, or without the CUDA path of an op), instead of running the torch reference on the device and
passing; and it fails when a native op was switched off in its worker (strict native ops)."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import types

import pytest
import torch
from cuda_policy import cuda_test_failure, strict_native_failure

from dgserve import ops

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_failure_only_with_a_device_and_a_problem():
    assert cuda_test_failure(True, True, "dgserve._C was built without CUDA") is not None
    assert "built without CUDA" in cuda_test_failure(True, True, "dgserve._C was built without CUDA")
    assert cuda_test_failure(True, False, "no build") is None  # no device: the test skips instead
    assert cuda_test_failure(True, True, None) is None  # a CUDA build: the test runs
    assert cuda_test_failure(False, True, "no build") is None  # not a cuda test


def test_cuda_build_problem_names_the_cause(monkeypatch):
    monkeypatch.setattr(ops.native, "_C", None)
    monkeypatch.setattr(ops.native, "_info", [])
    assert "not built" in ops.cuda_build_problem()
    monkeypatch.setattr(ops.native, "_C", types.SimpleNamespace(build_info=lambda: {"cuda": False}))
    monkeypatch.setattr(ops.native, "_info", [])
    assert "without CUDA" in ops.cuda_build_problem()
    cuda_ops = [op for op, kinds in ops.NATIVE_OPS.items() if "cuda" in kinds]
    monkeypatch.setattr(ops.native, "_C", types.SimpleNamespace(build_info=lambda: {"cuda": True}))
    monkeypatch.setattr(ops.native, "_info", [])
    assert ops.missing_cuda_ops() == cuda_ops
    assert "no CUDA path for rms_norm, " in ops.cuda_build_problem()
    info = {"cuda": True, "cuda_ops": [op for op in cuda_ops if op != "moe_combine"]}
    monkeypatch.setattr(ops.native, "_C", types.SimpleNamespace(build_info=lambda: info))
    monkeypatch.setattr(ops.native, "_info", [])
    assert ops.missing_cuda_ops() == ["moe_combine"]
    assert ops.cuda_build_problem().endswith("no CUDA path for moe_combine (build_info()['cuda_ops'])")
    info["cuda_ops"] = cuda_ops
    monkeypatch.setattr(ops.native, "_info", [])
    assert ops.missing_cuda_ops() == [] and ops.cuda_build_problem() is None


def test_strict_native_failure_names_each_op_switched_off_and_why():
    assert strict_native_failure({}) is None
    msg = strict_native_failure({"rms_norm": "self-check on cuda: 3e-2 from the reference", "moe_route": "raised"})
    assert "moe_route: raised; rms_norm: self-check on cuda: 3e-2 from the reference" in msg


_FAKE_DEVICE = "import torch\ntorch.cuda.is_available = lambda: True\n"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the policy on a machine without a device")
def test_cuda_tests_fail_when_a_device_exists_but_the_build_lacks_cuda(tmp_path):
    """Pretend a device exists (a plugin patches torch.cuda.is_available) with this CPU-only build: every cuda
    test of the diffusion_step file fails at set-up with the reason, none passes or skips."""
    if ops.cuda_build_problem() is None:
        pytest.skip("this build has CUDA")
    (tmp_path / "fake_cuda_device.py").write_text(_FAKE_DEVICE)
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "fake_cuda_device",
            "-p",
            "no:cacheprovider",
            "tests/ops/test_diffusion_step_cuda.py",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "a CUDA device is present but" in out, out[-3000:]
    assert " passed" not in out and " skipped" not in out, out[-3000:]


_FAKE_CUDA_BUILD = _FAKE_DEVICE + "import dgserve.ops\ndgserve.ops.cuda_build_problem = lambda: None\n"


def test_cuda_tests_fail_when_a_native_op_is_switched_off(tmp_path):
    """With a pretended device and CUDA build, tests/strict_native_probe.py: the test during which an op is switched
    off fails, so does the test whose fixture switched one off, naming the op and why; the tests after each pass
    (the worker is clean again)."""
    (tmp_path / "fake_cuda_build.py").write_text(_FAKE_CUDA_BUILD)
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "fake_cuda_build", "-p", "no:cacheprovider", "-rf"]
        + ["tests/strict_native_probe.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "2 failed, 2 passed" in out, out[-3000:]
    assert "FAILED tests/strict_native_probe.py::test_an_op_switched_off_while_it_runs" in out
    assert "FAILED tests/strict_native_probe.py::test_an_op_switched_off_by_a_fixture" in out
    assert "rms_norm: self-check on cuda: probe" in out and "moe_route: self-check on cuda: probe fixture" in out
