"""The `cuda` test policy: a `cuda` test skips on a machine without a CUDA device and FAILS on
one whose dgserve._C cannot run the CUDA kernels (missing, or built CPU-only because torch was a CPU build or
nvcc was missing), instead of running the torch reference on the device and passing."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import types

import pytest
import torch
from cuda_policy import cuda_test_failure

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
    monkeypatch.setattr(ops.native, "_C", types.SimpleNamespace(build_info=lambda: {"cuda": True}))
    monkeypatch.setattr(ops.native, "_info", [])
    assert ops.cuda_build_problem() is None


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
