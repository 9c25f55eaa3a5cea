"""The engine end to end on a CUDA device: the tiny random model in fp32 and bf16, one request
alone and several batched. fp32 tokens equal the CPU engine's (docs/exactness.md; fixtures avoid near-ties); bf16
is compared through its logits with the CPU engine's in bf16 (a near-tie may flip a bf16 token; bf16 against fp32
differs by 4-8e-2 on the CPU alone), each canvas seeded by its own explicit seed, the same alone and batched; and
the native self-check must pass on the device. The GPU engines are strict (``native_ops="strict"``): an op that
fails its self-check fails the test rather than being switched off. `cuda`: skipped without a device, failed when
dgserve._C lacks CUDA or a native op was switched off (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from dgserve import Engine, SamplingParams
from dgserve.model.tiny import make_random_checkpoint

pytestmark = pytest.mark.cuda

PROMPTS = [[5, 6, 7], list(range(3, 40)), [9, 4]]
SEEDS = [1, 2, 3]  # one per prompt, alone and batched


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_random_checkpoint(tmp_path_factory.mktemp("tiny-cuda"), "tiny", seed=3)


def _params(seed):
    return SamplingParams(max_new_tokens=40, max_denoising_steps=6, seed=seed, ignore_eos=True)


def _rel_l2(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _first_logits(engine, prompts, seeds):
    """Decoder logits of step 1 for each prompt (encode, then one denoise of the block's first canvas, drawn from
    the prompt's own seed) → [len(prompts), C, V] on the CPU."""
    from dgserve.engine.block import BlockState
    from dgserve.model import SlotCache

    m = engine.model
    cache = SlotCache.stack([m.prefill(torch.tensor(p, device=m.device)) for p in prompts])
    states = [BlockState.start(s, 0, m.config.canvas_length, m.config.vocab_size, m.device) for s in seeds]
    return m.denoise(cache, torch.stack([s.canvas for s in states])).float().cpu()


def _alone(engine, prompts, seeds):
    return torch.cat([_first_logits(engine, [p], [s]) for p, s in zip(prompts, seeds, strict=True)])


def test_fp32_cuda_tokens_equal_cpu_alone_and_batched(checkpoint):
    cpu = Engine.from_pretrained(checkpoint, device="cpu", dtype=torch.float32)
    gpu = Engine.from_pretrained(checkpoint, device="cuda", dtype=torch.float32, native_ops="strict")
    params = [_params(s) for s in SEEDS]
    want = [cpu.generate(p, sp).token_ids for p, sp in zip(PROMPTS, params, strict=True)]
    alone = [gpu.generate(p, sp).token_ids for p, sp in zip(PROMPTS, params, strict=True)]
    batched = [r.token_ids for r in gpu.generate_batch(PROMPTS, params)]
    assert alone == want
    assert batched == want
    assert _rel_l2(_first_logits(gpu, PROMPTS, SEEDS), _first_logits(cpu, PROMPTS, SEEDS)) <= 1e-5


def test_bf16_cuda_logits_close_alone_and_batched(checkpoint):
    ref = Engine.from_pretrained(checkpoint, device="cpu", dtype=torch.bfloat16)
    gpu = Engine.from_pretrained(checkpoint, device="cuda", dtype=torch.bfloat16, native_ops="strict")
    want = _first_logits(ref, PROMPTS, SEEDS)
    assert _rel_l2(_alone(ref, PROMPTS, SEEDS), want) <= 1e-6  # the CPU decoder is batch invariant
    batched = _first_logits(gpu, PROMPTS, SEEDS)
    alone = _alone(gpu, PROMPTS, SEEDS)
    # bf16 both sides; kernels and summation orders differ (cuBLAS, attention, the native ops)
    assert _rel_l2(batched, want) <= 3e-2 and _rel_l2(alone, want) <= 3e-2
    assert _rel_l2(batched, alone) <= 1e-2
    results = gpu.generate_batch(PROMPTS, [_params(s) for s in SEEDS])
    assert all(len(r.token_ids) == 40 and r.finish_reason == "length" for r in results)


def test_native_self_check_passes_on_the_device():
    from dgserve.ops.native_check import run_self_check

    report = run_self_check("cuda", mode="strict")
    assert report.failed == [], report.summary()
    assert report.passed, report.summary()
