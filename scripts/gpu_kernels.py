"""The device checks of scripts/gpu_check.sh that are not pytest runs.

    python scripts/gpu_kernels.py build-info [--device cuda]
    python scripts/gpu_kernels.py launch [--device cuda]
    python scripts/gpu_kernels.py big-step [--device cuda] [--rows 33] [--canvas 256] [--vocab 262144]

``build-info`` prints where dgserve._C was loaded from and its ``build_info()``; on CUDA it fails unless the build
has CUDA and links every op's CUDA path (``dgserve.ops.cuda_build_problem``).

``launch`` runs every kernel of dgserve._C once on small shapes, each template instance and launch variant
(rms_norm, moe_route and moe_combine in fp32 and bf16; diffusion_step with fp32 and bf16 logits, with and
without a bitmask; canvas and Gumbel noise; moe_align; the bf16 expert GEMMs; the NVFP4 repack (plain and
interleaved), decode, and both token-chunk widths of the W4A16 GEMMs), then synchronises. It is the workload
of the compute-sanitizer passes: seconds under memcheck and racecheck, where the whole cuda suite takes many
minutes. On CUDA it first fails unless every native op serves the device (else the kernels would not run).

``big-step`` runs one native diffusion_step over rows × canvas × vocab fp32 logits (default 33 × 256 × 262,144
= 2.21e9 > 2^31 elements: every flat index past 2^31 must be 64-bit), then reruns the first and the last row
alone (under 2^31) and requires bit-identical results, and the last row's processed logits and argmax equal to
the torch reference. Peak device memory ~18 GB at the default shape.

``--device cpu`` runs the same calls on the CPU paths (a rehearsal of the script itself; small shapes for
big-step). Exit status 0 when everything ran (and matched), 1 otherwise, with one line per check.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from dgserve import ops
from dgserve.ops import reference
from dgserve.ops.nvfp4_format import quantize
from dgserve.ops.nvfp4_repack import pack_experts


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _noise(device, B: int):
    seeds = torch.arange(B, dtype=torch.int64) * 7919 + 11
    return seeds.to(device), torch.arange(B, dtype=torch.int64).to(device), torch.full((B,), 3).to(device)


def _nvfp4_experts(device, E: int, H: int, I: int):
    g = _gen(12)

    def proj(n, k):
        qs = [quantize(torch.randn(n, k, generator=g) * k**-0.5) for _ in range(E)]
        return tuple(torch.stack([q[i] for q in qs]).to(device) for i in range(3))

    return pack_experts(proj(I, H), proj(I, H), proj(H, I))  # repack (interleaved, then plain)


def launch(device: torch.device) -> None:
    """Every kernel once (see the module docstring); raises on a launch or runtime error."""
    g = _gen(1)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(5, 300, generator=g).to(device, dtype)
        ops.rms_norm(x, torch.ones(300, device=device, dtype=dtype), 1e-6)
    B, C, V = 2, 24, 333
    noise = _noise(device, B)
    ops.canvas_noise(*noise, C, V)
    ops.gumbel_noise(*noise, C, V)
    temp, bound = torch.full((B,), 0.7, device=device), torch.tensor([1e30, 2.0], device=device)
    mask = torch.randint(-(2**31), 2**31 - 1, (B, C, (V + 31) // 32), generator=g, dtype=torch.int32).to(device)
    for dtype in (torch.float32, torch.bfloat16):
        logits = (4 * torch.randn(B, C, V, generator=g)).to(device, dtype)
        ops.diffusion_step(logits, temp, *noise, bound)
        ops.diffusion_step(logits, temp, *noise, bound, mask)
    T, H, I, E, K = 24, 64, 32, 16, 4
    for dtype in (torch.float32, torch.bfloat16):
        r = torch.randn(T, H, generator=g).to(device, dtype)
        proj = (torch.randn(E, H, generator=g) * 4 * H**-0.5).to(device, dtype)
        ops.moe_route(r, torch.ones(H, device=device, dtype=dtype), proj, torch.ones(E, device=device), K, 1e-6)
    ids = torch.rand(T, E, generator=g).topk(K, dim=-1).indices.to(device)
    ops.moe_align(ids, E, 8)
    y, w = torch.randn(T, K, H, generator=g).to(device), torch.rand(T, K, generator=g).to(device)
    for dtype in (torch.float32, torch.bfloat16):
        ops.moe_combine(y, w, dtype)
        ops.moe_combine(y, None, dtype)
    x = torch.randn(T, H, generator=g).to(device, torch.bfloat16)
    gate_up = (torch.randn(E, 2 * I, H, generator=g) * H**-0.5).to(device, torch.bfloat16)
    down = (torch.randn(E, H, I, generator=g) * I**-0.5).to(device, torch.bfloat16)
    ops.moe_experts(x, gate_up, down, w, ids)
    packed = _nvfp4_experts(device, 4, H, I)
    if ops.has_native("nvfp4_decode"):
        ops.nvfp4_decode(packed.w13, packed.s13)
    # the W4A16 GEMMs take 16-token chunks when T·K <= 8·E and 32-token chunks above: one launch of each
    for t, k in ((4, 2), (24, 4)):
        ids4 = torch.rand(t, 4, generator=g).topk(k, dim=-1).indices.to(device)
        ops.nvfp4_moe_experts(x[:t], packed, torch.rand(t, k, generator=g).to(device), ids4)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def big_step(device: torch.device, rows: int, canvas: int, vocab: int) -> list[str]:
    """One diffusion_step over rows × canvas × vocab logits; the problems found (empty: all agree)."""
    g = torch.Generator(device=device).manual_seed(3)
    logits = torch.randn(rows, canvas, vocab, generator=g, device=device).mul_(4)
    temp = torch.full((rows,), 0.8, device=device)
    bound = torch.full((rows,), 2.0, device=device)
    noise = _noise(device, rows)
    out = ops.diffusion_step(logits, temp, *noise, bound)
    problems = []
    for r in (0, rows - 1):
        sl = slice(r, r + 1)
        alone = ops.diffusion_step(logits[sl], temp[sl], *(t[sl] for t in noise), bound[sl])
        problems += [
            f"row {r}: {name} differs from the same row run alone"
            for name in ("canvas", "argmax", "entropy", "accepted", "mean_entropy", "processed")
            if not torch.equal(getattr(out, name)[sl], getattr(alone, name))
        ]
    last = slice(rows - 1, rows)
    want = reference.diffusion_step(logits[last], temp[last], *(t[last] for t in noise), bound[last])
    problems += [
        f"row {rows - 1}: {name} differs from the torch reference"
        for name in ("processed", "argmax")
        if not torch.equal(getattr(out, name)[last], getattr(want, name))
    ]
    return problems


def build_info(device: torch.device) -> int:
    """Prints the extension's file and build_info(); 1 on CUDA when the build cannot run every CUDA kernel."""
    print(f"gpu_kernels: dgserve._C: {ops.native.extension_path()}")
    print(f"gpu_kernels: build_info: {ops.native.build_info()}")
    problem = ops.cuda_build_problem() if device.type == "cuda" else None
    if problem is not None:
        print(f"gpu_kernels: build-info: {problem}")
        return 1
    print(f"gpu_kernels: build-info: serves {device}: {', '.join(ops.active_native_ops(device))}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("build-info", "launch", "big-step"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", type=int, default=33)
    ap.add_argument("--canvas", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=262_144)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if args.what == "build-info":
        return build_info(device)
    if device.type == "cuda":
        missing = sorted(set(ops.NATIVE_OPS) - set(ops.active_native_ops(device)))
        if missing:
            print(f"gpu_kernels: native ops not serving {device}: {missing} ({ops.cuda_build_problem()})")
            return 1
    t0 = time.perf_counter()
    if args.what == "launch":
        launch(device)
        print(f"gpu_kernels: launch: every kernel ran on {device} in {time.perf_counter() - t0:.1f} s")
        return 0
    n = args.rows * args.canvas * args.vocab
    problems = big_step(device, args.rows, args.canvas, args.vocab)
    for p in problems:
        print(f"gpu_kernels: big-step: {p}")
    verdict = "FAILED" if problems else "ok"
    print(f"gpu_kernels: big-step over {n:,} logits ({n / 2**31:.2f} × 2^31) on {device}: {verdict}")
    if device.type == "cuda":
        print(f"gpu_kernels: peak device memory {torch.cuda.max_memory_allocated(device) / 1e9:.1f} GB")
    print(f"gpu_kernels: {time.perf_counter() - t0:.1f} s")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
