"""Build the dgserve wheel from a copy of this tree, as the container's builder does (no network, no build
isolation): shared by the wheel-content test and the installed-wheel test."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def build_wheel(tmp: pathlib.Path) -> pathlib.Path:
    """The path of ``tmp/dist/dgserve-*.whl``, built from ``tmp/src`` (a copy of pyproject, README, python/ and
    service/); AssertionError with pip's output when the build fails."""
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for tree in ("python", "service"):
        shutil.copytree(ROOT / tree, src / tree, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    argv = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index"]
    r = subprocess.run([*argv, "--wheel-dir", str(tmp / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = (tmp / "dist").glob("dgserve-*.whl")
    return wheel
