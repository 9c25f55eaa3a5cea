"""The `cuda` test policy shared by tests/conftest.py and its test (a module of its own: `conftest` names clash)."""

from __future__ import annotations


def cuda_test_failure(marked: bool, device: bool, problem: str | None) -> str | None:
    """The failure message of a `cuda` test on a machine with a CUDA device whose dgserve._C cannot run the
    CUDA kernels (None: the test may run). Such a test would otherwise skip, or run the torch reference on the
    device and pass without running a kernel."""
    if not (marked and device and problem):
        return None
    return f"a CUDA device is present but {problem}: rebuild with a CUDA torch and nvcc"


def strict_native_failure(switched_off: dict[str, str]) -> str | None:
    """The failure message of a `cuda` test before or during which a native op was switched off in its worker
    (``dgserve.ops.switched_off()``: op → why), None when none was. The cuda tests run strict native ops: the
    engine's automatic self-check switches an op that disagrees with its reference off for the whole process, and
    the tests would then pass on the torch reference without running that kernel."""
    if not switched_off:
        return None
    why = "; ".join(f"{op}: {reason}" for op, reason in sorted(switched_off.items()))
    return f"native ops were switched off in this worker, so their kernels did not run (strict in cuda tests): {why}"
