"""CUDA kernels on the inputs a first deployment meets and the happy-path tests miss:
strided and unaligned logits rows, NaN / ±inf rows, canvases longer than one block of threads, out-of-range
expert ids (ids >= 2^31 whose low bits look valid), the per-slot routing weights, the bf16 expert GEMMs at the
docs/kernels.md, "Kernel tests and tolerances" bounds, and CUDA-graph capture of the whole bf16 MoE chain. Every test is
`cuda`: skipped on a
machine without a device, failed (tests/conftest.py) on one whose dgserve._C lacks CUDA. The reference paths
are patched to raise where a silent fallback would make a test pass without running a kernel."""

from __future__ import annotations

import pytest
import torch

from dgserve import ops
from dgserve.ops import reference

pytestmark = pytest.mark.cuda


def _no_fallback(monkeypatch, *names):
    def boom(*args, **kwargs):
        raise AssertionError("the op fell back to its torch reference on CUDA")

    for name in names:
        monkeypatch.setattr(reference, name, boom)


def _step_inputs(B, C, V, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (4 * torch.randn(B, C, V, generator=g)).to(dtype)
    return [
        logits,
        0.4 + 0.4 * torch.rand(B, generator=g),
        torch.randint(0, 2**62, (B,), generator=g),
        torch.randint(0, 50, (B,), generator=g),
        torch.randint(1, 48, (B,), generator=g),
        0.05 + torch.rand(B, generator=g) * C,
    ]


def _assert_step_equal(cpu_args, gpu_args):
    cpu = ops.diffusion_step(*cpu_args)
    gpu = ops.diffusion_step(*gpu_args)
    torch.cuda.synchronize()
    assert torch.equal(gpu.processed.cpu(), cpu.processed)
    assert torch.equal(gpu.argmax.cpu(), cpu.argmax)
    assert torch.equal(gpu.canvas.cpu(), cpu.canvas)
    assert torch.equal(gpu.accepted.cpu(), cpu.accepted)
    torch.testing.assert_close(gpu.entropy.cpu(), cpu.entropy, rtol=1e-5, atol=3e-5, equal_nan=True)
    torch.testing.assert_close(gpu.mean_entropy.cpu(), cpu.mean_entropy, rtol=1e-5, atol=3e-5, equal_nan=True)


# ---- diffusion_step ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset,V", [(1, 1003), (3, 4096), (2, 7)])
def test_unaligned_and_strided_logits_rows(monkeypatch, dtype, offset, V):
    # rows starting off a 16-byte boundary (scalar loads) and a position stride of V + 5 (odd)
    _no_fallback(monkeypatch, "diffusion_step")
    args = _step_inputs(2, 9, V, seed=V, dtype=dtype)
    big = torch.randn(2, 9, V + 5).to(dtype)
    big[:, :, offset : offset + V] = args[0]
    view = big[:, :, offset : offset + V]
    assert view.stride() == (9 * (V + 5), V + 5, 1)
    gpu_big = big.cuda()
    gpu_args = [gpu_big[:, :, offset : offset + V]] + [a.cuda() for a in args[1:]]
    _assert_step_equal([view] + args[1:], gpu_args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_and_inf_rows(monkeypatch, dtype):
    _no_fallback(monkeypatch, "diffusion_step")
    args = _step_inputs(2, 6, 777, seed=5, dtype=dtype)
    logits = args[0]
    logits[0, 0, 300] = float("nan")  # one NaN: it wins the argmax and the race; NaN entropy
    logits[0, 1, :] = float("nan")  # all NaN
    logits[0, 2, :] = float("-inf")  # all -inf: index 0, NaN entropy
    logits[0, 3, 5] = float("inf")  # +inf wins
    logits[0, 4, ::3] = float("-inf")  # masked entries
    logits[1, 5, :] = float("inf")  # all +inf
    _assert_step_equal(args, [a.cuda() for a in args])


@pytest.mark.parametrize("C", [1025, 1500, 3056])
def test_long_canvas_runs_natively(monkeypatch, C):
    _no_fallback(monkeypatch, "diffusion_step")
    args = _step_inputs(2, C, 97, seed=C)
    _assert_step_equal(args, [a.cuda() for a in args])


def test_canvas_beyond_the_kernel_falls_back_instead_of_raising():
    C = int(ops.native._C.build_info()["diffusion_step_max_canvas_cuda"]) + 1
    args = _step_inputs(1, C, 33, seed=1)
    gpu = ops.diffusion_step(*[a.cuda() for a in args])
    ref = reference.diffusion_step(*args)
    assert torch.equal(gpu.processed.cpu(), ref.processed) and torch.equal(gpu.argmax.cpu(), ref.argmax)


# ---- MoE dispatch ------------------------------------------------------------------------------------------


def test_align_ignores_out_of_range_ids_whose_low_bits_are_valid():
    E, bs = 8, 8
    ids = torch.tensor([[1, 2], [2**32 + 1, 3], [2**31, 5], [-(2**32) + 2, 1], [E, 7], [2**63 - 1, -1]])
    got = ops.moe_align(ids.cuda(), E, bs)
    torch.cuda.synchronize()
    flat = ids.flatten().tolist()
    valid = [(p, e) for p, e in enumerate(flat) if 0 <= e < E]
    counts = [sum(1 for _, e in valid if e == x) for x in range(E)]
    assert got.counts.cpu().tolist() == counts
    offsets = got.offsets.cpu().tolist()
    sp = got.sorted_pairs.cpu().tolist()
    for x in range(E):
        assert sp[offsets[x] : offsets[x] + counts[x]] == [p for p, e in valid if e == x]
    placed = [v for v in sp if v != len(flat)]
    assert sorted(placed) == sorted(p for p, _ in valid)  # nothing out of range is placed anywhere


def _router(T, H, E, dtype, gen):
    residual = (torch.randn(T, H, generator=gen) * 2).to(dtype)
    return (
        residual,
        (torch.rand(H, generator=gen) + 0.5).to(dtype),
        (torch.randn(E, H, generator=gen) * H**-0.5).to(dtype),
        torch.rand(E, generator=gen) + 0.5,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64, 4, 2), (33, 64, 128, 8), (300, 96, 13, 8)], ids=str)
def test_route_weights_per_slot(monkeypatch, shape, dtype):
    T, H, E, K = shape
    gen = torch.Generator().manual_seed(T + E)
    args = _router(T, H, E, dtype, gen)
    w_ref, ids_ref = reference.moe_route(*args, K, 1e-6)
    _no_fallback(monkeypatch, "moe_route")
    w, ids = ops.moe_route(*[a.cuda() for a in args], K, 1e-6)
    w, ids = w.cpu(), ids.cpu()
    rows = (ids == ids_ref).all(-1)  # rows whose selection (and order) agree: compare every slot
    assert rows.float().mean().item() >= (0.97 if dtype == torch.bfloat16 else 0.995)
    torch.testing.assert_close(w[rows], w_ref[rows], rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-6)


def _experts_problem(T, H, I, E, K, seed=0):
    gen = torch.Generator().manual_seed(seed + T)
    x = torch.randn(T, H, generator=gen).bfloat16()
    gate_up = (torch.randn(E, 2 * I, H, generator=gen) * H**-0.5).bfloat16()
    down = (torch.randn(E, H, I, generator=gen) * I**-0.5).bfloat16()
    w, ids = torch.rand(T, E, generator=gen).softmax(-1).topk(K, dim=-1)
    return x, gate_up, down, w.contiguous(), ids.contiguous()


def _rel_l2(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _exact_experts(x, gate_up, down, w, ids):
    """float64 of the bf16 inputs, no rounding anywhere (docs/kernels.md, "Kernel tests and tolerances" "exact")."""
    T, K = ids.shape
    I = gate_up.shape[1] // 2
    xd, gu, dn = x.double(), gate_up.double(), down.double()
    out = torch.zeros(T, x.shape[1], dtype=torch.float64)
    for t in range(T):
        for k in range(K):
            e = int(ids[t, k])
            h = gu[e] @ xd[t]
            a = torch.nn.functional.gelu(h[:I], approximate="tanh") * h[I:]
            out[t] += float(w[t, k]) * (dn[e] @ a)
    return out


@pytest.mark.parametrize(
    "shape", [(7, 64, 32, 5, 3), (256, 2816, 704, 128, 8), (1024, 256, 64, 16, 8), (4096, 128, 32, 128, 8)], ids=str
)
def test_bf16_experts_within_the_kernels_md_bounds(monkeypatch, shape):
    # docs/kernels.md, "Kernel tests and tolerances": T5 rel L2 <= 3e-3 vs the exact float64 result. (4096 tokens: 16
    # canvases' worth of
    # pairs per expert, so every expert runs several token chunks spread over the grid.)
    x, gate_up, down, w, ids = _experts_problem(*shape)
    want = reference.moe_experts(x, gate_up, down, w, ids)
    _no_fallback(monkeypatch, "moe_experts")
    got = ops.moe_experts(*[t.cuda() for t in (x, gate_up, down, w, ids)]).cpu()
    if shape[0] * shape[1] <= 256 * 256:
        assert _rel_l2(got, _exact_experts(x, gate_up, down, w, ids)) <= 3e-3
    assert _rel_l2(got, want) <= 3e-3


def test_bf16_moe_chain_graph_capture(monkeypatch):
    _no_fallback(monkeypatch, "moe_route", "moe_experts", "moe_align", "moe_combine")
    T, H, I, E, K = 256, 256, 64, 32, 8
    gen = torch.Generator().manual_seed(11)
    residual, scale, proj, pes = [a.cuda() for a in _router(T, H, E, torch.bfloat16, gen)]
    _, gate_up, down, _, _ = _experts_problem(T, H, I, E, K)
    gate_up, down = gate_up.cuda(), down.cuda()

    def chain():
        w, ids = ops.moe_route(residual, scale, proj, pes, K, 1e-6)
        return ops.moe_experts(residual, gate_up, down, w, ids)

    eager = chain()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        chain()  # warm-up on a side stream, as torch.cuda.graphs requires
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = chain()  # no host sync anywhere in the chain, or capture raises
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


# ---- rms_norm (its CUDA kernel) ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 5e-7), (torch.bfloat16, 2**-8)])
@pytest.mark.parametrize("shape", [(1, 1), (7, 300), (256, 2816), (3, 5, 1031)], ids=str)
def test_rms_norm_kernel_close_to_reference(monkeypatch, shape, dtype, rtol):
    g = torch.Generator().manual_seed(shape[-1])
    x = (3 * torch.randn(*shape, generator=g)).to(dtype)
    w = 1 + torch.randn(shape[-1], generator=g)
    want = reference.rms_norm(x, w, 1e-6).float()
    _no_fallback(monkeypatch, "rms_norm")
    got = ops.rms_norm(x.cuda(), w.cuda(), 1e-6).float().cpu()
    torch.testing.assert_close(got, want, rtol=rtol, atol=0)
