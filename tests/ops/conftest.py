"""Fixtures shared by the op tests: the compiled extension and its CPU code paths."""

from __future__ import annotations

import pytest

from dgserve import ops


@pytest.fixture(scope="module")
def C():
    """The compiled extension dgserve._C; skips the test when it is not built (`python build.py`)."""
    if ops.native._C is None:
        pytest.skip("dgserve._C is not built (run `python build.py`)")
    return ops.native._C


@pytest.fixture
def cpu_levels(C):
    """The CPU code paths this machine runs (0 baseline, 1 AVX2+FMA, 2 AVX-512); restores the automatic choice."""
    top = C._set_cpu_level(-1)
    yield list(range(top + 1))
    C._set_cpu_level(-1)
