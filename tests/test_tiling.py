"""The LM head, self-conditioning and sampler in tiles of canvases: the step's [B, C, V]
temporaries are bounded by a tile, and tiling changes no result the engine returns."""

from __future__ import annotations

import copy
import importlib.util
import pathlib

import torch

from dgserve import DiffusionGemma, SamplingParams
from dgserve.engine.block import BlockState
from dgserve.engine.request import Request
from dgserve.engine.sampler import Sampler, StepKnobs
from dgserve.model import SlotCache
from dgserve.model.tiny import preset, random_weights
from dgserve.outputs import OutputTracker

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_memory", ROOT / "bench" / "bench_memory.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_step_peak_memory_is_bounded_by_the_tile():
    bench = _bench()
    args = ["--canvases", "8", "--vocab", "8192", "--canvas-length", "16"]
    untiled = bench.main(args + ["--tile", "8"])
    one = bench.main(args + ["--tile", "1"])
    two = bench.main(args + ["--tile", "2"])
    # in units of one fp32 [B, C, V] tensor: per canvas of a tile the step holds at most 2.5 [C, V] fp32 (the
    # processed logits, then the self-conditioning softmax and its bf16 rounding; the logits are freed once used)
    assert untiled["peak_in_fp32_logits"] >= 1.9
    assert one["peak_in_fp32_logits"] <= 0.35 and two["peak_in_fp32_logits"] <= 0.7
    for r in (untiled, one, two):
        assert r["kept_after_step_gb"] == 0.0


def _model(batch_rows, tile):
    cfg = preset("tiny")
    m = DiffusionGemma(cfg, random_weights(cfg, seed=6), torch.float32, batch_rows=batch_rows)
    m.canvas_tile = tile
    return m


def _rows(m, B) -> SlotCache:
    """B rows of different lengths (5 + b positions)."""
    return SlotCache.stack([m.prefill(torch.arange(3, 8 + b)) for b in range(B)])


def test_logits_tiles_cover_every_row_and_denoise_is_unchanged_per_row():
    m = _model(False, 1)
    B, C = 5, m.config.canvas_length
    cache = _rows(m, B)
    canvas = torch.randint(0, m.config.vocab_size, (B, C), generator=torch.Generator().manual_seed(1))
    sc = [torch.randn(C, m.config.vocab_size) for _ in range(B)]
    logits = m.denoise(cache, canvas, self_cond_logits=sc)
    want = torch.stack([m.decode_row(cache.view(b), canvas[b], sc[b], None) for b in range(B)])
    assert torch.equal(logits, want)  # CPU: one canvas per tile, bit for bit
    hidden = m.denoise_hidden(cache, canvas, self_cond_logits=sc)
    m.canvas_tile = 2
    tiles = list(m.logits_tiles(hidden))
    assert [t[0] for t in tiles] == [slice(0, 2), slice(2, 4), slice(4, 5)]
    torch.testing.assert_close(torch.cat([t[1] for t in tiles]), want, rtol=1e-5, atol=1e-5)


def test_batched_self_conditioning_in_tiles_matches_untiled():
    B = 5
    a, b = _model(True, 5), _model(True, 2)
    C, V = a.config.canvas_length, a.config.vocab_size
    canvas = torch.randint(0, V, (B, C), generator=torch.Generator().manual_seed(2))
    sc = [torch.randn(C, V) for _ in range(B)]
    la = a.denoise(_rows(a, B), canvas, self_cond_logits=sc)
    lb = b.denoise(_rows(b, B), canvas, self_cond_logits=sc)
    torch.testing.assert_close(lb, la, rtol=1e-5, atol=1e-5)  # only GEMM row counts differ


def _requests(V: int, C: int) -> list[Request]:
    """Five requests with started blocks (seed 100 + i, block i), as the model runner leaves them."""
    reqs = []
    for i in range(5):
        params = SamplingParams(max_denoising_steps=6, seed=100 + i)
        block = BlockState.start(100 + i, i, C, V, torch.device("cpu"))
        tracker = OutputTracker(params.max_new_tokens, frozenset({1}), False, ())
        reqs.append(Request(f"r{i}", [0], params, tracker, block_index=i, steps_left=6, block=block))
    return reqs


def test_sampler_in_tiles_equals_one_call():
    V, C = 300, 16
    reqs = _requests(V, C)
    logits = 4 * torch.randn(5, C, V, generator=torch.Generator().manual_seed(3))
    whole, tiled = copy.deepcopy(reqs), copy.deepcopy(reqs)
    knobs = StepKnobs.of(reqs)
    processed = Sampler(torch.float32).step(whole, logits, knobs)
    tiles = (slice(0, 2), slice(2, 4), slice(4, 5))
    parts = [Sampler(torch.float32).step(tiled[rows], logits[rows], knobs.rows(rows)) for rows in tiles]
    assert torch.equal(processed, torch.cat(parts))  # the next step's self-conditioning input
    for x, y in zip(whole, tiled, strict=True):
        assert x.block is not None and y.block is not None
        assert torch.equal(x.block.canvas, y.block.canvas) and torch.equal(x.block.argmax, y.block.argmax)
        assert x.mean_entropy == y.mean_entropy and x.block_done == y.block_done
        assert x.steps_left == 6  # the sampler reads k; the model runner decrements it
