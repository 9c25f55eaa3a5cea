"""Fixtures shared by the op tests: the compiled extension and its CPU code paths."""

from __future__ import annotations

import pytest
import torch

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


@pytest.fixture
def step_buffers():
    """(B, C, V) → (inputs, outputs): valid keyword arguments of ``_C.diffusion_step`` (zero logits, unit
    temperature and bound, seed 0, block 0, step 1; empty outputs), for tests that break one argument at a time."""

    def make(B: int, C: int, V: int) -> tuple[dict, dict]:
        ins = dict(
            logits=torch.zeros(B, C, V),
            temperature=torch.ones(B),
            seeds=torch.zeros(B, dtype=torch.int64),
            blocks=torch.zeros(B, dtype=torch.int64),
            steps=torch.ones(B, dtype=torch.int64),
            entropy_bound=torch.ones(B),
        )
        outs = dict(
            canvas=torch.empty(B, C, dtype=torch.int64),
            argmax=torch.empty(B, C, dtype=torch.int64),
            entropy=torch.empty(B, C),
            accepted=torch.empty(B, C, dtype=torch.bool),
            mean_entropy=torch.empty(B),
            processed=torch.empty(B, C, V),
        )
        return ins, outs

    return make
