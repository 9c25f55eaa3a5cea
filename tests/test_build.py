"""build.py: its help, and (where nvcc exists) that every csrc/ops/*.cu compiles alone with nvcc -arch=sm_90a."""
from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_build(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "build.py"), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_help_documents_the_flags():
    r = run_build("--help", timeout=60)
    assert r.returncode == 0, r.stderr
    for flag in ("--no-ext", "--no-proto", "--verbose", "--check-cuda", "--cpu-only", "--arch", "--jobs"):
        assert flag in r.stdout


def test_unknown_flag_fails():
    r = run_build("--no-such-flag", timeout=60)
    assert r.returncode != 0


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_cuda_sources_compile_with_nvcc():
    # The .cu files include no torch headers, so nvcc checks them on any machine (~5-20 s on 2 cores).
    r = run_build("--check-cuda", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "compile with nvcc -arch=sm_90a" in r.stdout
