"""CUDA diffusion_step vs the native CPU op (same Philox counters and dg_logf: identical tokens), determinism,
and CUDA-graph capture. Skipped without a CUDA device (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from dgserve import ops

pytestmark = pytest.mark.cuda


def _inputs(B, C, V, seed, device, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    # well-separated logits (scale 4) keep Gumbel races and acceptance away from near-ties (docs/exactness.md,
    # "Near-ties")
    logits = (4 * torch.randn(B, C, V, generator=g)).to(dtype)
    temperature = 0.4 + 0.4 * torch.rand(B, generator=g)
    seeds = torch.randint(0, 2**62, (B,), generator=g)
    blocks = torch.randint(0, 50, (B,), generator=g)
    steps = torch.randint(1, 48, (B,), generator=g)
    bound = 0.05 + torch.rand(B, generator=g)
    return [t.to(device) for t in (logits, temperature, seeds, blocks, steps, bound)]


@pytest.mark.parametrize("B,C,V", [(1, 1, 7), (3, 16, 1000), (2, 256, 32768), (1, 256, 262144)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_tokens_equal_cpu_native(B, C, V, dtype):
    assert ops.has_native("diffusion_step")
    for seed in range(4):
        cpu = ops.diffusion_step(*_inputs(B, C, V, seed, "cpu", dtype))
        gpu = ops.diffusion_step(*_inputs(B, C, V, seed, "cuda", dtype))
        assert torch.equal(gpu.processed.cpu(), cpu.processed)  # IEEE division, no reciprocal
        assert torch.equal(gpu.argmax.cpu(), cpu.argmax)
        assert torch.equal(gpu.canvas.cpu(), cpu.canvas)  # same Gumbel winners, same renoise
        assert torch.equal(gpu.accepted.cpu(), cpu.accepted)
        torch.testing.assert_close(gpu.entropy.cpu(), cpu.entropy, rtol=1e-5, atol=3e-5)


def test_cuda_determinism_loop():
    args = _inputs(4, 256, 32768, 0, "cuda")
    first = ops.diffusion_step(*args)
    for _ in range(10):
        again = ops.diffusion_step(*args)
        for a, b in zip(first, again, strict=True):
            assert torch.equal(a, b)


def test_cuda_graph_capture_replays_the_step():
    args = _inputs(2, 256, 32768, 1, "cuda")
    eager = ops.diffusion_step(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ops.diffusion_step(*args)  # warm-up on the side stream, as torch.cuda.graphs requires
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        captured = ops.diffusion_step(*args)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager, captured, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("B,C,V", [(1, 1, 7), (3, 16, 1000), (2, 256, 32768 + 5)])
def test_cuda_bitmask_equals_cpu_native(B, C, V):
    """A random token bitmask (with a fully masked position) gives the CPU op's processed, argmax and tokens."""
    for seed in range(2):
        g = torch.Generator().manual_seed(seed)
        mask = torch.randint(-(2**31), 2**31 - 1, (B, C, (V + 31) // 32), generator=g, dtype=torch.int32)
        mask[0, 0] = 0  # fully masked: left unmasked
        cpu = ops.diffusion_step(*_inputs(B, C, V, seed, "cpu"), mask)
        gpu = ops.diffusion_step(*_inputs(B, C, V, seed, "cuda"), mask.cuda())
        assert torch.equal(gpu.processed.cpu(), cpu.processed)
        assert torch.equal(gpu.argmax.cpu(), cpu.argmax)
        assert torch.equal(gpu.canvas.cpu(), cpu.canvas)
        torch.testing.assert_close(gpu.entropy.cpu(), cpu.entropy, rtol=1e-5, atol=3e-5)
