"""Shared fixtures: tiny random DiffusionGemma checkpoints written by transformers' save_pretrained.

transformers is a test-only dependency; it is the reference we must match (docs/exactness.md).
"""

from __future__ import annotations

import pathlib

import pytest
import torch
from cuda_policy import cuda_test_failure
from tiny_models import TINY_VARIANTS, make_tiny_hf_model, tiny_config  # noqa: F401 (re-exported)

_CACHE: dict[str, pathlib.Path] = {}


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """tiny_checkpoint(variant) -> path of a saved fp32 checkpoint directory (built once per session)."""

    def get(variant: str = "base") -> pathlib.Path:
        if variant not in _CACHE:
            path = tmp_path_factory.mktemp(f"dg-tiny-{variant}")
            make_tiny_hf_model(variant).save_pretrained(path)
            _CACHE[variant] = path
        return _CACHE[variant]

    return get


@pytest.fixture(scope="session")
def hf_model_loader():
    """hf_model_loader(path, dtype) -> transformers DiffusionGemmaForBlockDiffusion in eval mode."""
    from transformers import DiffusionGemmaForBlockDiffusion

    def load(path, dtype=torch.float32, attn="eager"):
        return DiffusionGemmaForBlockDiffusion.from_pretrained(path, dtype=dtype, attn_implementation=attn).eval()

    return load


def pytest_collection_modifyitems(config, items):
    """`cuda`-marked tests need a CUDA device: skipped with a reason on a machine without one."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (this machine has none)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _cuda_tests_need_the_cuda_build(request):
    """Runs before every other fixture of a test (autouse), so a `cuda` test fails here rather than skipping."""
    if request.node.get_closest_marker("cuda") is None:
        return
    from dgserve import ops

    msg = cuda_test_failure(True, torch.cuda.is_available(), ops.cuda_build_problem())
    if msg is not None:
        pytest.fail(msg, pytrace=False)
