"""The self-conditioning state between denoising steps is the [C, H] signal, not [C, V] logits (docs/memory.md,
"Self-conditioning state"): what each request keeps, and the step's peak, under exact storage accounting
(bench/bench_memory.py's dispatch mode) at the real vocabulary; and the signal path equals the logits path bit for bit
on the CPU."""

from __future__ import annotations

import gc
import importlib.util
import pathlib

import pytest
import torch

from dgserve import DiffusionGemma, SamplingParams
from dgserve.engine.cache_config import CacheConfig
from dgserve.engine.model_runner import ModelRunner
from dgserve.engine.request import Request
from dgserve.model import SlotCache
from dgserve.model.tiny import preset, random_weights
from dgserve.outputs import OutputTracker

ROOT = pathlib.Path(__file__).resolve().parents[1]
V_REAL = 262_144
MIB = 2**20


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_memory", ROOT / "bench" / "bench_memory.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _cpu_steps(bench, model: DiffusionGemma, streams: int) -> tuple[int, int, list[Request]]:
    """Requests prefilled and started through the real runner on the CPU, then two ``run`` steps with the real
    sampler under the accounting mode → (bytes kept after the first step, the second step's peak above the
    weights and cache, the requests)."""
    C = model.config.canvas_length
    with bench.LiveBytes() as mem:
        runner = ModelRunner(model, streams, 64, 16, CacheConfig(memory=1 << 30), prefix_caching=False)
        reqs = []
        for i in range(streams):
            params = SamplingParams(max_denoising_steps=8, seed=40 + i)
            tracker = OutputTracker(params.max_new_tokens, frozenset({1}), False, ())
            r = Request(f"r{i}", list(range(3, 11)), params, tracker, steps_left=8)
            runner.admit(r)
            runner.prefill(r, 0, 8)
            runner.start_block(r)
            reqs.append(r)
        base = mem.current
        runner.run(reqs)
        gc.collect()  # temporaries a reference cycle still holds are not state
        state = mem.current - base
        assert all(not r.block_done for r in reqs)  # every block goes on: each keeps its signal
        mem.reset_peak()
        runner.run(reqs)
        peak = mem.peak - base
    for r in reqs:
        assert r.block is not None and r.block.self_cond is not None
        assert r.block.self_cond.shape == (C, model.config.hidden_size)
        assert r.block.self_cond.dtype == model.dtype
    return state, peak, reqs


def test_cpu_engine_keeps_the_signal_and_its_step_peak_does_not_grow_with_streams(bench):
    """The CPU engine (per-row decoder, one canvas per tile) at the real vocabulary and a tiny hidden size: each
    request keeps [C, H] (plus its canvases' ids), and the step at 8 streams peaks no higher than 1.2 × at 1."""
    cfg = preset("tiny", vocab_size=V_REAL, canvas_length=16)
    model = DiffusionGemma(cfg, random_weights(cfg, seed=3), torch.float32)
    C, H = cfg.canvas_length, cfg.hidden_size
    state1, peak1, _ = _cpu_steps(bench, model, 1)
    state8, peak8, _ = _cpu_steps(bench, model, 8)
    signal = C * H * 4
    ids = 3 * C * 8  # the block's canvas and argmax, and the sampler's canvas row: int64
    per_stream = (state8 - state1) / 7  # what each further stream keeps (what any step keeps once cancels out)
    assert signal <= per_stream <= signal + ids + 512  # far from one [C, V] (here C·V·4 = 16 MiB)
    assert peak8 <= 1.2 * peak1, (peak1, peak8)
    assert peak1 >= 2 * C * V_REAL * 4  # the tile's logits and processed logits: the accounting sees them


def test_real_26b_shape_state_per_stream_and_step_peak(bench):
    """The 26B shape on `meta`, bf16, the per-row decoder (one canvas per tile): state ≤ 2 MiB per stream (KV
    aside) and the step peak at 8 streams ≤ 1.2 × at 1; batched (accelerators) the state is the same [C, H]. Six
    layers (one sliding group and its full layer): the layer count sets the KV cache only."""
    cfg = preset("26b-a4b", num_hidden_layers=6, layer_types=preset("26b-a4b").layer_types[:6])
    with bench.meta_ops():
        model = bench.meta_model(cfg, torch.bfloat16, "per-row", None)
        bench.measure_steps(model, 1, 1024, bench.MetaSampler(model.dtype))  # one-off lazily made tensors
        one = bench.measure_steps(model, 1, 1024, bench.MetaSampler(model.dtype))
        eight = bench.measure_steps(model, 8, 1024, bench.MetaSampler(model.dtype))
        batched_model = bench.meta_model(cfg, torch.bfloat16, "batched", None)
        bench.measure_steps(batched_model, 1, 1024, bench.MetaSampler(torch.bfloat16))
        batched = bench.measure_steps(batched_model, 8, 1024, bench.MetaSampler(torch.bfloat16))
    for m in (one, eight, batched):
        assert m["self_cond_shape"] == [cfg.canvas_length, cfg.hidden_size]
        assert m["state_bytes_per_stream"] <= 2 * MIB
    assert eight["step_peak_bytes"] <= 1.2 * one["step_peak_bytes"]


@pytest.mark.parametrize("batch_rows", [False, True])
def test_signal_input_equals_logits_input(batch_rows):
    """``denoise(self_cond_signal=...)`` with the signal ``self_conditioning_rows`` makes from processed logits
    gives the logits ``denoise(self_cond_logits=rnd(processed))`` gives: bit for bit per row on the CPU (the same
    ops and shapes, docs/exactness.md), and to rounding when the batched pass groups canvases."""
    cfg = preset("tiny")
    m = DiffusionGemma(cfg, random_weights(cfg, seed=6), torch.float32, batch_rows=batch_rows)
    B, C, V = 3, cfg.canvas_length, cfg.vocab_size
    cache = SlotCache.stack([m.prefill(torch.arange(3, 8 + b)) for b in range(B)])
    g = torch.Generator().manual_seed(2)
    canvas = torch.randint(0, V, (B, C), generator=g)
    processed = 4 * torch.randn(B, C, V, generator=g)
    rows = [0, 2]  # row 1: a block's first step, no self-conditioning
    signal = m.self_conditioning_rows(processed, rows)
    assert [tuple(s.shape) for s in signal] == [(C, cfg.hidden_size)] * 2
    by_logits = m.denoise(cache, canvas, self_cond_logits=[processed[0], None, processed[2]])
    by_signal = m.denoise(cache, canvas, self_cond_signal=[signal[0], None, signal[1]])
    if batch_rows:
        torch.testing.assert_close(by_signal, by_logits, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(by_signal, by_logits)
    with pytest.raises(ValueError, match="at most one"):
        m.denoise(cache, canvas, self_cond_logits=processed, self_cond_signal=signal)
