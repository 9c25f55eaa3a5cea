"""Op-level benchmarks of dgserve.ops, one JSON line per configuration.

    python bench/bench_ops.py moe|nvfp4|diffusion_step|linear [--shape 26b|small] [--device cuda|cpu]
                                  [--dtype bfloat16|float32] [--canvases 1,4,16] [--hbm-gbps 3350]
                                  [--repeats 20] [--warmup 3] [--no-reference]

Each subcommand is a pair of functions (``add_<name>_args``, ``bench_<name>``) registered in ``SUBCOMMANDS``;
shared helpers (timing, device names, JSON rows) live at the top. Timing: warm-up calls, then ``--repeats``
calls between synchronisations (CUDA: events around the whole run, mean per call; CPU: the best per-call
wall time, as bench_engine.py does: robust on a shared, loaded machine). Weights are random; routing is
uniform (softmax of Gaussian logits, top-k).

``moe``: ``dgserve.ops.moe_experts`` (align → grouped expert GEMMs → combine) at the 26B-A4B shapes
(hidden 2816, expert intermediate 704, 128 experts, top-8) for 1, 4 and 16 canvases of 256 tokens, against the
PyTorch reference (one F.linear pair per expert, ``ops.native_disabled()``) and ``torch._grouped_mm`` when
this torch has it and it runs on the device. GB/s counts the expert weight bytes of the experts that received
tokens (each must be read once per call: the roofline of the op at small batch), and the percentage is of
``--hbm-gbps`` (default 3350 GB/s, H100 SXM HBM3 spec; pass 4800 for an H200). ``--shape small`` runs in
seconds on a CPU. The weights (1.5 GB in bf16 at 26B) exceed any L2, so the 26B timings are cold-cache.

``nvfp4``: ``dgserve.ops.nvfp4_moe_experts`` (W4A16 NVFP4 experts, quantized from the same random bf16 weights)
at the same shapes, with the bf16 path ``ops.moe_experts`` timed in the same run (``speedup_vs_bf16``), the two
native grouped GEMMs alone (``gemm_ms``), GB/s of the NVFP4 bytes of the active experts (0.5625 B/weight) as % of
``--hbm-gbps`` and of a copy bandwidth measured in the run. docs/kernels.md targets at one canvas on an H100: ≥ 70 %
of HBM bandwidth and ≥ 2.5× the bf16 path.

``diffusion_step``: ``dgserve.ops.diffusion_step`` over [B, 256, V] logits (V = 262,144 at 26b; 8,192 small) for
1, 4, 16 canvases: time, GB/s of logits read + processed logits written, % of ``--hbm-gbps``, and the speed-up
over the PyTorch reference (``ops.native_disabled()``; skipped on CUDA at V = 262,144, where the reference's
Philox temporaries take several GB per canvas).

``linear``: ``dgserve.ops.linear`` (the batch-invariant GEMM) against ``F.linear`` at the shipped small model's
GEMM shapes (hidden 192, MLP 384, expert intermediate 192, vocabulary 2048) for ``--rows`` 16, 256 and 512: GFLOP/s
of each and the ratio, timed side by side (the two calls alternate, best of ``--repeats`` rounds of a few calls
each), plus the machine's measured fp32 matmul peak (F.linear at 1024 x 1024 x 1024, best of ``--repeats``).
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import time

import torch
import torch.nn.functional as F

from dgserve import ops
from dgserve.ops import reference
from dgserve.ops.nvfp4_format import quantize
from dgserve.ops.nvfp4_moe_experts import nvfp4_expert_gemms
from dgserve.ops.nvfp4_repack import pack_experts

CANVAS = 256
MOE_SHAPES = {  # name -> (hidden, expert intermediate, experts, top_k)
    "26b": (2816, 704, 128, 8),
    "small": (256, 64, 32, 8),
}


# ---------------------------------------------------------------------------------------------------------
# shared helpers
# ---------------------------------------------------------------------------------------------------------


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"


def time_ms(fn, device: torch.device, repeats: int, warmup: int) -> float:
    """Milliseconds per call of fn() after warm-up (CUDA: mean over events; CPU: best of `repeats`)."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / repeats
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return min(times)


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def emit(row: dict) -> None:
    print(json.dumps(row), flush=True)


# ---------------------------------------------------------------------------------------------------------
# moe
# ---------------------------------------------------------------------------------------------------------


def add_expert_shape_args(p: argparse.ArgumentParser, no_reference_help: str) -> None:
    """The flags the expert benches (moe, nvfp4) share: problem shape, batch sizes, roofline, reference check."""
    p.add_argument(
        "--shape", choices=sorted(MOE_SHAPES), default=None, help="26b (default on CUDA) or small (default on CPU)"
    )
    p.add_argument("--canvases", default="1,4,16", help="comma-separated canvases of 256 tokens")
    p.add_argument("--hbm-gbps", type=float, default=3350.0, help="memory bandwidth roofline in GB/s")
    p.add_argument("--no-reference", action="store_true", help=no_reference_help)


def add_moe_args(p: argparse.ArgumentParser) -> None:
    add_expert_shape_args(p, "skip the (slow) per-expert PyTorch reference")


def moe_problem(H, I, E, K, tokens, dtype, device, seed):
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rand(*shape, scale=1.0):  # drawn on the CPU in chunks of experts to bound host memory, then moved
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)

    gate_up = torch.cat([rand(min(16, E - e), 2 * I, H, scale=H**-0.5) for e in range(0, E, 16)])
    down = torch.cat([rand(min(16, E - e), H, I, scale=I**-0.5) for e in range(0, E, 16)])
    x = rand(tokens, H)
    probs = torch.randn(tokens, E, generator=gen).softmax(-1)
    w, ids = probs.topk(K, dim=-1)
    return x, gate_up, down, (w / w.sum(-1, keepdim=True)).to(device), ids.to(device)


def moe_grouped_mm(x, gate_up, down, weights, ids):
    """The same MoE with torch._grouped_mm (stable sort → two grouped GEMMs → scatter → fp32 combine)."""
    T, K = ids.shape
    E, I = gate_up.shape[0], gate_up.shape[1] // 2
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
    gu = torch._grouped_mm(x[order // K], gate_up.transpose(-2, -1), offs=offs)
    h = F.gelu(gu[:, :I], approximate="tanh") * gu[:, I:]
    ys = torch._grouped_mm(h, down.transpose(-2, -1), offs=offs)
    y = torch.empty(T * K, x.shape[-1], dtype=torch.float32, device=x.device)
    y[order] = ys.float()
    return reference.moe_combine(y.view(T, K, -1), weights, x.dtype)


def moe_path(device: torch.device, dtype: torch.dtype) -> str:
    """Which implementation ops.moe_experts runs here (for the JSON row)."""
    if not ops.has_native("moe_combine"):
        return "reference (dgserve._C not built)"
    if device.type == "cuda":
        cuda = ops.native.cuda_built() and dtype == torch.bfloat16
        return "native CUDA grouped GEMMs" if cuda else "reference (needs the CUDA build and bf16)"
    return "native align/combine + torch GEMMs per expert"


def bench_moe(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> None:
    shape = args.shape or ("26b" if device.type == "cuda" else "small")
    H, I, E, K = MOE_SHAPES[shape]
    for n in (int(c) for c in args.canvases.split(",")):
        T = n * CANVAS
        x, gate_up, down, w, ids = moe_problem(H, I, E, K, T, dtype, device, args.seed + n)
        active = int((torch.bincount(ids.reshape(-1), minlength=E) > 0).sum())
        weight_bytes = active * 3 * I * H * gate_up.element_size()
        out = ops.moe_experts(x, gate_up, down, w, ids)
        ms = time_ms(functools.partial(ops.moe_experts, x, gate_up, down, w, ids), device, args.repeats, args.warmup)
        gbps = weight_bytes / (ms * 1e-3) / 1e9
        row = {
            "bench": "moe",
            "device": device_name(device),
            "shape": shape,
            "dtype": str(dtype).split(".")[-1],
            "canvases": n,
            "tokens": T,
            "pairs": T * K,
            "hidden": H,
            "inter": I,
            "experts": E,
            "top_k": K,
            "active_experts": active,
            "weight_bytes": weight_bytes,
            "path": moe_path(device, dtype),
            "ms": round(ms, 4),
            "gbps": round(gbps, 1),
            "hbm_gbps": args.hbm_gbps,
            "pct_hbm_roofline": round(100 * gbps / args.hbm_gbps, 1),
        }
        if not args.no_reference:
            with ops.native_disabled():
                ref = reference.moe_experts(x, gate_up, down, w, ids)
                ref_ms = time_ms(
                    functools.partial(reference.moe_experts, x, gate_up, down, w, ids),
                    device,
                    max(1, args.repeats // 4),
                    1,
                )
            row.update(
                reference_ms=round(ref_ms, 4),
                speedup_vs_reference=round(ref_ms / ms, 2),
                rel_l2_vs_reference=rel_l2(out, ref),
            )
        row.update(moe_grouped_mm_row(x, gate_up, down, w, ids, device, args, ms))
        emit(row)
        del x, gate_up, down, w, ids, out
        if device.type == "cuda":
            torch.cuda.empty_cache()


def moe_grouped_mm_row(x, gate_up, down, w, ids, device, args, ms) -> dict:
    if not hasattr(torch, "_grouped_mm"):
        return {"grouped_mm_ms": None, "grouped_mm": "torch._grouped_mm not in this torch"}
    try:
        moe_grouped_mm(x, gate_up, down, w, ids)
        gms = time_ms(lambda: moe_grouped_mm(x, gate_up, down, w, ids), device, args.repeats, args.warmup)
    except (RuntimeError, NotImplementedError) as e:  # e.g. no CPU kernel, or not this dtype / GPU
        return {"grouped_mm_ms": None, "grouped_mm": f"unavailable: {str(e).splitlines()[0][:120]}"}
    return {"grouped_mm_ms": round(gms, 4), "speedup_vs_grouped_mm": round(gms / ms, 2)}


# ---------------------------------------------------------------------------------------------------------
# nvfp4
# ---------------------------------------------------------------------------------------------------------


def add_nvfp4_args(p: argparse.ArgumentParser) -> None:
    add_expert_shape_args(p, "skip the accuracy check against the reference")


def sig(v: float) -> float:
    """Four significant digits (CPU bandwidths are tiny next to the HBM roofline)."""
    return float(f"{v:.4g}")


def copy_gbps(device: torch.device) -> float:
    """Measured copy bandwidth (bytes read + written per second) of a 256 MiB clone on this device."""
    src = torch.empty(64 << 20, dtype=torch.float32, device=device).fill_(1.0)
    ms = time_ms(lambda: src.clone(), device, 5, 2)
    return 2 * src.numel() * 4 / (ms * 1e-3) / 1e9


def nvfp4_layer(gate_up: torch.Tensor, down: torch.Tensor):
    """Quantize bf16 experts with ModelOpt's rules (on their device) and repack → nvfp4_format.PackedExperts."""
    inter = gate_up.shape[1] // 2

    def stack(ws):
        parts = [quantize(w) for w in ws]
        return tuple(torch.stack([q[i] for q in parts]) for i in range(3))

    return pack_experts(stack(gate_up[:, :inter]), stack(gate_up[:, inter:]), stack(down))


def bench_nvfp4(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> None:
    """W4A16 NVFP4 experts (ops.nvfp4_moe_experts: align → GEMM1+GELU → GEMM2 → combine) vs the bf16 expert
    path (ops.moe_experts) on the same routing, in one run. GB/s counts the NVFP4 bytes (codes, block scales,
    global scales) of the experts that received tokens; `gemm_ms` times the two grouped GEMMs alone."""
    shape = args.shape or ("26b" if device.type == "cuda" else "small")
    H, I, E, K = MOE_SHAPES[shape]
    counts = [int(c) for c in args.canvases.split(",")]
    x_all, gate_up, down, w_all, ids_all = moe_problem(
        H, I, E, K, max(counts) * CANVAS, torch.bfloat16, device, args.seed
    )
    packed = nvfp4_layer(gate_up, down)
    bytes_per_expert = sum(t[0].numel() * t.element_size() for t in packed[:4]) + 12
    measured = copy_gbps(device)
    for n in counts:
        T = n * CANVAS
        x, w, ids = x_all[:T].contiguous(), w_all[:T].contiguous(), ids_all[:T].contiguous()
        active = int((torch.bincount(ids.reshape(-1), minlength=E) > 0).sum())
        nbytes = active * bytes_per_expert
        out = ops.nvfp4_moe_experts(x, packed, w, ids)
        ms = time_ms(functools.partial(ops.nvfp4_moe_experts, x, packed, w, ids), device, args.repeats, args.warmup)
        bf16_ms = time_ms(
            functools.partial(ops.moe_experts, x, gate_up, down, w, ids), device, args.repeats, args.warmup
        )
        gemm_ms = nvfp4_gemm_ms(x, packed, w, ids, device, args)
        gbps = nbytes / (ms * 1e-3) / 1e9
        row = {
            "bench": "nvfp4",
            "device": device_name(device),
            "shape": shape,
            "canvases": n,
            "tokens": T,
            "pairs": T * K,
            "hidden": H,
            "inter": I,
            "experts": E,
            "top_k": K,
            "active_experts": active,
            "nvfp4_bytes": nbytes,
            "bf16_bytes": active * 3 * I * H * 2,
            "path": nvfp4_path(device),
            "ms": round(ms, 4),
            "gbps": sig(gbps),
            "hbm_gbps": args.hbm_gbps,
            "pct_hbm_roofline": sig(100 * gbps / args.hbm_gbps),
            "floor_ms_at_hbm": sig(1e3 * nbytes / (args.hbm_gbps * 1e9)),
            "copy_gbps_measured": sig(measured),
            "pct_of_measured_copy": sig(100 * gbps / measured),
            "gemm_ms": None if gemm_ms is None else round(gemm_ms, 4),
            "bf16_ms": round(bf16_ms, 4),
            "speedup_vs_bf16": round(bf16_ms / ms, 2),
        }
        if gemm_ms is not None:
            row["gemm_pct_hbm_roofline"] = sig(100 * nbytes / (gemm_ms * 1e-3) / 1e9 / args.hbm_gbps)
        if not args.no_reference and n == counts[0]:
            with ops.native_disabled():
                row["rel_l2_vs_reference"] = rel_l2(out, reference.nvfp4_moe_experts(x, packed, w, ids))
        emit(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()


def nvfp4_path(device: torch.device) -> str:
    if not ops.has_native("nvfp4_moe_experts"):
        return "reference (dgserve._C not built)"
    if device.type == "cuda":
        return "native CUDA W4A16 grouped GEMMs" if ops.native.cuda_built() else "reference (needs the CUDA build)"
    return "native align/combine + torch GEMMs on exactly decoded weights"


def nvfp4_gemm_ms(x, packed, w, ids, device, args) -> float | None:
    """The native grouped GEMMs alone on a precomputed alignment (CUDA kernels, or the C++ CPU loop)."""
    if not ops.has_native("nvfp4_moe_experts") or (device.type == "cuda" and not ops.native.cuda_built()):
        return None
    align = ops.moe_align(ids, packed.gs.shape[0], 8 if device.type == "cuda" else 1)
    weights = w.to(torch.float32).contiguous()
    call = lambda: nvfp4_expert_gemms(x, packed, weights, align)  # noqa: E731
    repeats = args.repeats if device.type == "cuda" else 1
    return time_ms(call, device, repeats, args.warmup if device.type == "cuda" else 0)


# ---------------------------------------------------------------------------------------------------------
# diffusion_step
# ---------------------------------------------------------------------------------------------------------

STEP_VOCAB = {"26b": 262_144, "small": 8192}


def add_diffusion_step_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", choices=sorted(STEP_VOCAB), default="26b" if torch.cuda.is_available() else "small")
    p.add_argument("--canvases", default="1,4,16")
    p.add_argument("--hbm-gbps", type=float, default=3350.0)
    p.add_argument("--no-reference", action="store_true")
    p.add_argument(
        "--bitmask", action="store_true", help="with a token bitmask (structured output): ~1 token in 16 allowed"
    )


def bench_diffusion_step(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> None:
    """The fused sampler step over [B, 256, V] logits: bytes = logits read + processed logits written (fp32)."""
    V = STEP_VOCAB[args.shape]
    for B in [int(c) for c in args.canvases.split(",")]:
        g = torch.Generator().manual_seed(args.seed)
        inputs = [
            (4 * torch.randn(B, CANVAS, V, generator=g)).to(dtype),
            0.4 + 0.4 * torch.rand(B, generator=g),
            torch.randint(0, 2**62, (B,), generator=g),
            torch.zeros(B, dtype=torch.int64),
            torch.full((B,), 16, dtype=torch.int64),
            torch.full((B,), 0.1),
        ]
        if args.bitmask:  # random bits among 0, 8, 16, 24 of each word: ~1 token in 16 allowed
            words = torch.randint(-(2**31), 2**31 - 1, (B, CANVAS, (V + 31) // 32), generator=g, dtype=torch.int32)
            inputs.append(words & 0x01010101)
        inputs = [t.to(device) for t in inputs]
        ms = time_ms(functools.partial(ops.diffusion_step, *inputs), device, args.repeats, args.warmup)
        nbytes = B * CANVAS * V * (inputs[0].element_size() + 4)
        row = {
            "bench": "diffusion_step",
            "device": device_name(device),
            "dtype": str(dtype)[6:],
            "canvases": B,
            "canvas": CANVAS,
            "vocab": V,
            "native": ops.has_native("diffusion_step"),
            "bitmask": bool(args.bitmask),
            "ms": round(ms, 3),
            "gb_s": round(nbytes / ms / 1e6, 1),
            "pct_of_hbm": round(100 * nbytes / ms / 1e6 / args.hbm_gbps, 1),
        }
        if not args.no_reference and (device.type == "cpu" or V <= 32768):
            with ops.native_disabled():
                ref_ms = time_ms(functools.partial(ops.diffusion_step, *inputs), device, max(1, args.repeats // 4), 1)
            row["reference_ms"] = round(ref_ms, 3)
            row["speedup_vs_reference"] = round(ref_ms / ms, 2)
        emit(row)


# ---------------------------------------------------------------------------------------------------------
# linear
# ---------------------------------------------------------------------------------------------------------

LINEAR_SHAPES = {  # name -> (N, K) at python/dgserve/models/small (H 192, I 384, moe I 192, V 2048)
    "q_o_proj": (192, 192),
    "mlp_gate_up": (384, 192),
    "mlp_down": (192, 384),
    "expert_down": (192, 192),
    "lm_head": (2048, 192),
}


def add_linear_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", default="16,256,512", help="comma-separated row counts T")
    p.add_argument("--calls", type=int, default=10, help="calls per timed round")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads first (default: torch's own)")


def side_by_side_ms(fns, repeats: int, calls: int) -> list[float]:
    """Best per-call milliseconds of each fn, the fns alternating round by round (a shared machine's load hits
    both alike)."""
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            best[i] = min(best[i], (time.perf_counter() - t0) * 1e3 / calls)
    return best


def bench_linear(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)  # both sides use torch's thread count (OpenMP)
    gen = torch.Generator().manual_seed(args.seed)
    big = torch.randn(1024, 1024, generator=gen).to(device)
    (peak_ms,) = side_by_side_ms([functools.partial(F.linear, big, big)], args.repeats, 1)
    peak = 2 * 1024**3 / (peak_ms * 1e-3) / 1e9
    for name, (N, K) in LINEAR_SHAPES.items():
        w = (torch.randn(N, K, generator=gen) * K**-0.5).to(dtype).to(device)
        for T in (int(t) for t in args.rows.split(",")):
            x = torch.randn(T, K, generator=gen).to(dtype).to(device)
            for _ in range(args.warmup):
                ops.linear(x, w), F.linear(x, w)
            calls = [functools.partial(ops.linear, x, w), functools.partial(F.linear, x, w)]
            dg_ms, torch_ms = side_by_side_ms(calls, args.repeats, args.calls)
            flop = 2 * T * N * K
            emit(
                {
                    "bench": "linear",
                    "device": device_name(device),
                    "dtype": str(dtype).removeprefix("torch."),
                    "gemm": name,
                    "T": T,
                    "N": N,
                    "K": K,
                    "dg_gflops": sig(flop / (dg_ms * 1e-3) / 1e9),
                    "torch_gflops": sig(flop / (torch_ms * 1e-3) / 1e9),
                    "speed_dg_over_torch": round(torch_ms / dg_ms, 3),
                    "peak_fp32_gflops_measured": sig(peak),
                    "max_abs_diff_vs_torch": float((ops.linear(x, w).float() - F.linear(x, w).float()).abs().max()),
                }
            )


# ---------------------------------------------------------------------------------------------------------
# entry point
# ---------------------------------------------------------------------------------------------------------

SUBCOMMANDS = {  # name -> (add_args, bench, help)
    "moe": (add_moe_args, bench_moe, "MoE expert block: align, grouped expert GEMMs, combine"),
    "nvfp4": (add_nvfp4_args, bench_nvfp4, "NVFP4 W4A16 experts vs the bf16 expert path"),
    "diffusion_step": (
        add_diffusion_step_args,
        bench_diffusion_step,
        "fused sampler step over [B, 256, V] logits vs the PyTorch reference",
    ),
    "linear": (add_linear_args, bench_linear, "batch-invariant linear vs F.linear at the small model's shapes"),
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="op", required=True)
    for name, (add_args, _, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
        p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
        p.add_argument("--repeats", type=int, default=20)
        p.add_argument("--warmup", type=int, default=3)
        p.add_argument("--seed", type=int, default=0)
        add_args(p)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    SUBCOMMANDS[args.op][1](args, device, getattr(torch, args.dtype))


if __name__ == "__main__":
    main()
