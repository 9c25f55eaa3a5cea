"""build.py: its help, and (where nvcc exists) that every csrc/ops/*.cu compiles alone with nvcc -arch=sm_90a."""

from __future__ import annotations

import os
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
def test_cuda_sources_compile_with_nvcc_without_large_spills():
    # The .cu files include no torch headers, so nvcc checks them on any machine. One arch here (~1-3 min on 2
    # busy cores); `python build.py --check-cuda` compiles every arch (about a minute per arch here).
    r = run_build("--check-cuda", "--arch", "sm_90a", timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "compile with nvcc for sm_90a, no spill over 64 B" in r.stdout


def _build_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("dg_build", ROOT / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_arches_cover_the_seeds_hardware_plus_ptx():
    b = _build_module()
    names = [n for n, _ in b.CUDA_ARCHES]
    assert names[:3] == ["sm_90a", "sm_80", "sm_100a"]
    assert "sm_120" in names and "sm_121" in names  # RTX 5090 / RTX PRO 6000, DGX Spark
    assert b.PTX_ARCH == "compute_80"  # JIT for sm_103, sm_110 and later parts
    assert b.gencode("sm_90a") == "-gencode=arch=compute_90a,code=sm_90a"
    assert b.gencode("sm_121") == "-gencode=arch=compute_121,code=sm_121"
    assert b.gencode("compute_80") == "-gencode=arch=compute_80,code=compute_80"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_default_arches_are_every_arch_this_nvcc_knows():
    b = _build_module()
    known = subprocess.run(["nvcc", "--list-gpu-arch"], capture_output=True, text=True).stdout.split()
    want = [n for n, c in b.CUDA_ARCHES if c in known] + ([b.PTX_ARCH] if b.PTX_ARCH in known else [])
    assert b.cuda_arches("nvcc", None) == want
    assert b.cuda_arches("nvcc", ["sm_120"]) == ["sm_120"]


PTXAS = """ptxas info    : Compiling entry function '_Z6kernelv' for 'sm_90a'
ptxas info    : Function properties for _Z6kernelv
    72 bytes stack frame, 208 bytes spill stores, 140 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers
ptxas info    : Function properties for _Z5cleanv
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers
"""


def test_ptxas_spills_are_found():
    b = _build_module()
    assert b.ptxas_spills(PTXAS) == [("_Z6kernelv", 208, 140)]
    assert b.ptxas_spills(PTXAS.split("ptxas info    : Function properties for _Z5cleanv")[1]) == []


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
from dgserve.model.tiny import preset, random_weights

assert ops.native._C is None and not ops.native_enabled()
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
    from dgserve.model.tiny import preset, random_weights

    out = subprocess.run([sys.executable, "-c", _WITHOUT_EXTENSION], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    cfg = preset("tiny")
    engine = Engine(DiffusionGemma(cfg, random_weights(cfg, seed=4), torch.float32))
    res = engine.generate([5, 6, 7], SamplingParams(max_new_tokens=40, max_denoising_steps=6, seed=9, ignore_eos=True))
    assert json.loads(out.stdout.strip().splitlines()[-1]) == res.token_ids


def test_arch_of_capability_picks_the_arch_specific_variant_where_the_build_has_one():
    sys.path.insert(0, str(ROOT))
    try:
        import build
    finally:
        sys.path.remove(str(ROOT))
    assert build.arch_of_capability(9, 0) == "sm_90a"  # H100 / H200
    assert build.arch_of_capability(10, 0) == "sm_100a"
    assert build.arch_of_capability(8, 0) == "sm_80"
    assert build.arch_of_capability(8, 9) == "sm_89"
    assert build.arch_of_capability(12, 0) == "sm_120"


def _toolkit(root: pathlib.Path) -> pathlib.Path:
    """A fake CUDA toolkit: bin/nvcc (an executable stub) and include/cuda_runtime.h."""
    (root / "bin").mkdir(parents=True)
    (root / "include").mkdir()
    (root / "include" / "cuda_runtime.h").write_text("// fake\n")
    nvcc = root / "bin" / "nvcc"
    nvcc.write_bytes(b"\x7fELF fake nvcc binary")
    nvcc.chmod(0o755)
    return root


def _wrapper(path: pathlib.Path, text: str) -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def test_cuda_home_is_the_toolkit_behind_an_nvcc_wrapper_not_its_folder(tmp_path):
    """The case torch gets wrong: /usr/local/bin/nvcc is a script exec'ing the toolkit's nvcc; torch's
    dirname(dirname(which nvcc)) is /usr/local, which has no cuda_runtime.h."""
    b = _build_module()
    real = _toolkit(tmp_path / "cuda-13.0")
    _wrapper(tmp_path / "local" / "bin" / "nvcc", f'#!/bin/sh\nexec {real}/bin/nvcc "$@"\n')
    path = str(tmp_path / "local" / "bin")
    assert b.find_cuda_home(env={}, path=path, globs=()) == real
    # a wrapper of a wrapper, quoted, with other commands around it
    _wrapper(tmp_path / "outer" / "nvcc", f'#!/bin/bash\nset -e\nexec "{tmp_path}/local/bin/nvcc" "$@"\n')
    assert b.find_cuda_home(env={}, path=str(tmp_path / "outer"), globs=()) == real


def test_cuda_home_through_symlinks_and_from_the_environment(tmp_path):
    b = _build_module()
    real = _toolkit(tmp_path / "cuda-12.8")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").symlink_to(real / "bin" / "nvcc")
    assert b.find_cuda_home(env={}, path=str(tmp_path / "bin"), globs=()) == real
    other = _toolkit(tmp_path / "cuda-13.0")
    assert b.find_cuda_home(env={"CUDA_HOME": str(other)}, path=str(tmp_path / "bin"), globs=()) == other
    assert b.find_cuda_home(env={"CUDA_PATH": str(other)}, path=str(tmp_path / "bin"), globs=()) == other
    # a CUDA_HOME without the headers (torch's guess from a wrapper) is passed over
    assert b.find_cuda_home(env={"CUDA_HOME": str(tmp_path)}, path=str(tmp_path / "bin"), globs=()) == real


def test_cuda_home_from_the_usual_folders_newest_first(tmp_path):
    b = _build_module()
    _toolkit(tmp_path / "cuda-12.8")
    newest = _toolkit(tmp_path / "cuda-13.0")
    (tmp_path / "cuda-13.1").mkdir()  # no headers: not a toolkit
    empty = tmp_path / "empty"
    empty.mkdir()
    glob = (str(tmp_path / "cuda"), str(tmp_path / "cuda-*"))
    assert b.find_cuda_home(env={}, path=str(empty), globs=glob) == newest
    (tmp_path / "cuda").symlink_to(tmp_path / "cuda-12.8")
    assert b.find_cuda_home(env={}, path=str(empty), globs=glob) == tmp_path / "cuda"
    # neither a toolkit nor a wrapper that leads to one: None
    _wrapper(tmp_path / "bin" / "nvcc", '#!/bin/sh\nexec /nonexistent/bin/nvcc "$@"\n')
    assert b.find_cuda_home(env={}, path=str(tmp_path / "bin"), globs=()) is None
    assert b.find_cuda_home(env={}, path=str(empty), globs=()) is None


def test_set_cuda_home_exports_it_before_torch_reads_it(tmp_path, monkeypatch):
    b = _build_module()
    real = _toolkit(tmp_path / "cuda-13.0")
    _wrapper(tmp_path / "bin" / "nvcc", f'#!/bin/sh\nexec {real}/bin/nvcc "$@"\n')
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.setenv("CUDA_HOME", "/usr/local")
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(b, "CUDA_HOME_GLOBS", ())
    assert b.set_cuda_home() == str(real)
    assert os.environ["CUDA_HOME"] == str(real)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_cuda_home_of_this_machine_holds_cuda_runtime_h():
    b = _build_module()
    home = b.find_cuda_home()
    assert home is not None and (home / "include" / "cuda_runtime.h").is_file()
    assert (home / "bin" / "nvcc").exists()
