"""Shared fixtures: tiny random DiffusionGemma checkpoints written by transformers' save_pretrained.

transformers is a test-only dependency; it is the reference we must match (docs/exactness.md).
"""

from __future__ import annotations

import pathlib

import pytest
import torch
from cuda_policy import cuda_test_failure, strict_native_failure
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
def special_marker_engine(tmp_path_factory):
    """An Engine on a tiny random model whose vocabulary has Gemma 4's tool and channel markers as special tokens,
    as the real model's does (the shipped small model spells them in ordinary tokens)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from dgserve import Engine
    from dgserve.model.default_model import add_bos_post_processor
    from dgserve.model.tiny import make_random_checkpoint

    path = tmp_path_factory.mktemp("special-markers")
    make_random_checkpoint(path, "tiny")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    markers = ["<|tool_call>", "<tool_call|>", "<|channel>", "<channel|>", "<|tool_response>", "<tool_response|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", *markers],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["call get weather city Paris Oslo days zone UTC time thought plan"], trainer=trainer)
    add_bos_post_processor(tok).save(str(path / "tokenizer.json"))
    return Engine.from_pretrained(path)


@pytest.fixture(scope="session")
def hf_model_loader():
    """hf_model_loader(path, dtype) -> transformers DiffusionGemmaForBlockDiffusion in eval mode."""
    from transformers import DiffusionGemmaForBlockDiffusion

    def load(path, dtype=torch.float32, attn="eager"):
        return DiffusionGemmaForBlockDiffusion.from_pretrained(path, dtype=dtype, attn_implementation=attn).eval()

    return load


@pytest.fixture(scope="module")
def parity_twins(tiny_checkpoint, hf_model_loader):
    """parity_twins(variant) -> (transformers model, our Engine) over the same tiny fp32 checkpoint (built once per
    module and variant): the two sides of a seeded parity test (tests/hf_reference.py)."""
    from dgserve import Engine

    made: dict[str, tuple] = {}

    def get(variant: str = "base"):
        if variant not in made:
            path = tiny_checkpoint(variant)
            made[variant] = (hf_model_loader(path, torch.float32, attn="sdpa"), Engine.from_pretrained(path))
        return made[variant]

    return get


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


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """Strict native ops in `cuda` tests: a test fails when a native op was switched off before it ran (by a
    fixture's engine, say) or while it ran (``strict_native_failure``); the switch is then undone, and the
    self-check's memo dropped, so that the next test checks again and fails the same way."""
    if item.get_closest_marker("cuda") is None:
        return (yield)
    from dgserve import ops
    from dgserve.ops.native_check import forget_reports

    def check() -> None:
        msg = strict_native_failure(ops.switched_off())
        if msg is not None:
            ops.switch_on_native()
            forget_reports()
            pytest.fail(msg, pytrace=False)

    check()
    result = yield
    check()
    return result
