"""build.py: its help, and (where nvcc exists) that every csrc/ops/*.cu compiles alone with nvcc -arch=sm_90a."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_build(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "build.py"), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


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


_WITHOUT_EXTENSION = r"""
import importlib.abc, json, sys

class _Block(importlib.abc.MetaPathFinder):      # make `dgserve._C` unimportable, as on a machine without a build
    def find_spec(self, name, path=None, target=None):
        if name == "dgserve._C":
            raise ImportError("blocked for the test")
        return None

sys.meta_path.insert(0, _Block())
import torch
from dgserve import DiffusionGemma, Engine, SamplingParams, ops
from dgserve.tiny import preset, random_weights

assert ops._C is None and not ops.native_enabled()
cfg = preset("tiny")
engine = Engine(DiffusionGemma(cfg, random_weights(cfg, seed=4), torch.float32))
res = engine.generate([5, 6, 7], SamplingParams(max_new_tokens=40, max_denoising_steps=6, seed=9, ignore_eos=True))
print(json.dumps(res.token_ids))
"""


def test_package_runs_without_the_extension():
    """Without dgserve._C the package imports and generates on the reference ops, with the same tokens."""
    import json

    import torch

    from dgserve import DiffusionGemma, Engine, SamplingParams
    from dgserve.tiny import preset, random_weights

    out = subprocess.run([sys.executable, "-c", _WITHOUT_EXTENSION], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    cfg = preset("tiny")
    engine = Engine(DiffusionGemma(cfg, random_weights(cfg, seed=4), torch.float32))
    res = engine.generate([5, 6, 7], SamplingParams(max_new_tokens=40, max_denoising_steps=6, seed=9, ignore_eos=True))
    assert json.loads(out.stdout.strip().splitlines()[-1]) == res.token_ids
