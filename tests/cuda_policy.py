"""The `cuda` test policy shared by tests/conftest.py and its test (a module of its own: `conftest` names clash)."""

from __future__ import annotations


def cuda_test_failure(marked: bool, device: bool, problem: str | None) -> str | None:
    """The failure message of a `cuda` test on a machine with a CUDA device whose dgserve._C cannot run the
    CUDA kernels (None: the test may run). Such a test would otherwise skip, or run the torch reference on the
    device and pass without running a kernel."""
    if not (marked and device and problem):
        return None
    return f"a CUDA device is present but {problem}: rebuild with a CUDA torch and nvcc"
