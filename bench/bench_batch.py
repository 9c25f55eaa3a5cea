"""CPU decoder throughput by concurrency: the stacked pass (model/stacked.py) vs the per-canvas path, side by side.

    python bench/bench_batch.py [--concurrency 1,4,16,32] [--rounds 5] [--blocks 2] [--steps 8] [--prompt-len 16]
                                [--threads N] [--clock wall|cpu] [--profile 16] [--efficiency 1,16,32] [--all]

The shipped model (python/dgserve/models/small, fp32) in one Engine; per concurrency n, n requests with seeds 1..n,
fixed work (``--steps`` denoising steps per block, adaptive stopping off, EOS ignored) through ``generate_batch``.
Each round runs every concurrency, and at each both paths back to back, alternating which goes first (a slow minute
of a shared machine then slows every concurrency of that round alike); the per-canvas path is the runner's decoder
with ``decode_stacked`` swapped for ``decode_row_hidden`` canvas by canvas (what the CPU ran before). Committed
tokens/s is the best of the rounds; the tokens of both paths must be equal (docs/exactness.md, "Batch invariance").
One JSON line per concurrency (tok/s of both paths and their ratio), then the ratio of tok/s at the largest
concurrency to that at 1.

``--profile n``: five steady denoising steps of n requests (stacked), each under torch.profiler (the median step is
printed, and every step's share outside), with ``ops.linear`` and
``ops.decode_attention`` wrapped in named ranges (the native ops are pybind calls the profiler does not see): the
shares of the step's wall time in ``linear`` (the projections, the experts, the LM head), in attention and
elsewhere, and the aten ops with the most self time.

``--efficiency 1,16,32``: per stream count, a steady-state denoising step's FLOPs (every ``linear`` and
``decode_attention`` call, counted as it runs) over its wall time, against this machine's GEMM peak as ``ops.linear``
reaches it, measured in the same run; and the step's shares in ``linear``, in attention and elsewhere, timed around
those calls (no profiler: its per-op cost would inflate the many small ops outside them).

``--clock cpu``: tok/s and step times over the process's CPU time instead of wall time. With ``--threads 1`` that
is the time the run computed; on a shared VM wall time also counts the stretches the hypervisor gave the core to
another guest (seen here: 42 s of CPU in a 76 s run of an otherwise idle container), which land on whichever
concurrency was running. The profile's shares stay wall-based (the profiler's clock).

``--all``: then the prefill figure (``bench_prefill``: dgserve's first block for a 2,000-token prompt over
transformers' prefill, median of 3 alternated rounds) and the memory figures (``bench_memory``: the CPU step's peak at
8 streams over 1 at the real vocabulary, and the 26B shape's state per stream and step peak in bf16).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from dgserve import Engine, SamplingParams
from dgserve.engine import model_runner

SMALL = Path(__file__).resolve().parents[1] / "python" / "dgserve" / "models" / "small"
STACKED = model_runner.decode_stacked
# --clock: wall time, or the process's CPU time (with one torch thread, the time the run computed: on a shared VM the
# stolen time, when another guest holds the core, is excluded, which wall time cannot do)
CLOCK = {"wall": time.perf_counter, "cpu": time.process_time}
clock = time.perf_counter


def _per_canvas(model, rows, canvases, signals):
    """The per-canvas decoder: ``decode_row_hidden`` canvas by canvas (the reference path)."""
    return torch.stack([model.decode_row_hidden(r, canvases[b], None, None, signals[b]) for b, r in enumerate(rows)])


def _run(engine: Engine, n: int, args, stacked: bool) -> tuple[float, list[list[int]]]:
    model_runner.decode_stacked = STACKED if stacked else _per_canvas  # type: ignore[attr-defined]
    fixed = dict(max_denoising_steps=args.steps, ignore_eos=True, confidence_threshold=1e-30)
    plist = [SamplingParams(max_new_tokens=args.blocks * 16, seed=1 + i, **fixed) for i in range(n)]
    prompt = list(range(5, 5 + args.prompt_len))
    t0 = clock()
    res = engine.generate_batch([prompt] * n, plist)
    secs = clock() - t0
    toks = [r.token_ids for r in res]
    return sum(len(t) for t in toks) / secs, toks


def _patched(replace: dict):
    """Every loaded dgserve module's reference to an op function ``f`` (the package's re-export and each module that
    imported it by name: the experts, the dense MLP, the router) replaced by ``replace[f]``; returns the undo list."""
    import sys

    by_id = {id(f): g for f, g in replace.items()}
    undo = []
    for name, mod in list(sys.modules.items()):
        if not name.startswith("dgserve"):
            continue
        for attr, value in list(vars(mod).items()):
            if id(value) in by_id:
                undo.append((mod, attr, value))
                setattr(mod, attr, by_id[id(value)])
    return undo


def _restore(undo) -> None:
    for mod, attr, value in undo:
        setattr(mod, attr, value)


def _labelled(label: str, fn):
    """fn inside a torch.profiler range named ``label`` (the native ops are pybind calls the profiler does not see)."""
    from torch.profiler import record_function

    def wrapped(*a, **k):
        with record_function(label):
            return fn(*a, **k)

    return wrapped


PROFILED_STEPS = 5  # one step alone reads whatever else the machine did in those 50 ms


def _profile(engine: Engine, n: int, args) -> None:
    """``PROFILED_STEPS`` steady denoising steps of n requests (stacked), each under torch.profiler: the shares of
    its wall time in ``linear`` (every projection, the experts, the LM head), in attention (``ops.decode_attention``)
    and outside both, and the aten ops with the most self time; printed for the median step by the share outside."""

    from torch.profiler import ProfilerActivity, profile

    from dgserve import ops

    undo = _patched(
        {
            ops.linear: _labelled("@linear", ops.linear),
            ops.decode_attention: _labelled("@attend", ops.decode_attention),
        }
    )
    model_runner.decode_stacked = STACKED  # type: ignore[attr-defined]
    fixed = dict(max_denoising_steps=64, ignore_eos=True, confidence_threshold=1e-30)  # steady: no commit
    prompt = list(range(5, 5 + args.prompt_len))
    for i in range(n):
        engine.add_request(prompt, SamplingParams(max_new_tokens=16, seed=1 + i, **fixed))
    engine.step()  # admission, prefill, first step
    engine.step()
    rows = []
    for _ in range(PROFILED_STEPS):  # each step its own session: a stolen stretch of time spoils one step, not all
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()  # the profiler's times are wall times
            engine.step()
            wall = (time.perf_counter() - t0) * 1e6
        rows.append(_profile_row(prof, wall))
    while engine.has_unfinished():
        engine.step()
    _restore(undo)
    rows.sort(key=lambda r: r["other_share"])
    row = {"profile_streams": n, "profiled_steps": PROFILED_STEPS, **rows[len(rows) // 2]}  # the median step
    row["other_share_of_each_step"] = [r["other_share"] for r in rows]
    print(json.dumps(row))


def _profile_row(prof, wall: float) -> dict:
    """One profiled step's shares: wall (µs) in ``@linear``, ``@attend`` and outside both; its top aten ops."""
    by = {e.key: e.cpu_time_total for e in prof.key_averages()}
    self_by = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
    lin, att = by.get("@linear", 0.0), by.get("@attend", 0.0)
    top = sorted(((k, v) for k, v in self_by.items() if not k.startswith("@")), key=lambda kv: -kv[1])[:10]
    row = {"step_wall_ms": round(wall / 1e3, 1), "linear_share": round(lin / wall, 3)}
    row |= {"attention_share": round(att / wall, 3), "other_share": round(1 - (lin + att) / wall, 3)}
    row["top_aten_self_ms"] = {k: round(v / 1e3, 2) for k, v in top}
    return row


def _peak_gflops() -> float:
    """This machine's GEMM peak as ``ops.linear`` reaches it, measured now: the best of 30 calls at 512 × 384 × 192
    (the shipped model's largest GEMM shape at 32 streams) on the torch thread count in force."""
    from dgserve import ops

    x, w = torch.randn(512, 192), torch.randn(384, 192)
    best = float("inf")
    for _ in range(30):
        t0 = clock()
        ops.linear(x, w)
        best = min(best, clock() - t0)
    return 2 * 512 * 384 * 192 / best / 1e9


def _efficiency(engine: Engine, n: int, args, peak: float) -> None:
    """Steady-state denoising steps of n requests (stacked): the FLOPs of every ``linear`` and ``decode_attention``
    call, counted as they run, over the step's wall time (best of 4 steps), against the measured GEMM peak."""

    from dgserve import ops

    counted = [0.0, 0.0, 0.0]  # FLOPs, seconds in linear, seconds in attention

    def linear(x, w, _f=ops.linear):
        counted[0] += 2.0 * (x.numel() // x.shape[-1]) * w.shape[0] * w.shape[1]
        t0 = clock()
        y = _f(x, w)
        counted[1] += clock() - t0
        return y

    def attention(q, keys, values, canvas_keys, canvas_values, C, slots=None, _f=ops.decode_attention):
        cached = [k.shape[1] for k in keys] if slots is None else [n for _, _, n in slots]
        counted[0] += sum(4.0 * q.shape[0] * C * (P + C) * q.shape[2] for P in cached)  # scores and p·v
        t0 = clock()
        y = _f(q, keys, values, canvas_keys, canvas_values, C, slots)
        counted[2] += clock() - t0
        return y

    undo = _patched({ops.linear: linear, ops.decode_attention: attention})
    model_runner.decode_stacked = STACKED  # type: ignore[attr-defined]
    fixed = dict(max_denoising_steps=64, ignore_eos=True, confidence_threshold=1e-30)
    for i in range(n):
        engine.add_request(list(range(5, 5 + args.prompt_len)), SamplingParams(max_new_tokens=16, seed=1 + i, **fixed))
    engine.step()  # admission, prefill, first step
    best, flops, lin, att = float("inf"), 0.0, 0.0, 0.0
    for _ in range(4):
        counted[:] = [0.0, 0.0, 0.0]
        t0 = clock()
        engine.step()
        dt = clock() - t0
        if dt < best:
            best, (flops, lin, att) = dt, counted
    while engine.has_unfinished():
        engine.step()
    _restore(undo)
    row = {"streams": n, "step_ms": round(best * 1e3, 1), "gflop_per_step": round(flops / 1e9, 3)}
    row |= {"gflop_s": round(flops / best / 1e9, 1), "peak_gflop_s": round(peak, 1)}
    row["fraction_of_peak"] = round(flops / best / 1e9 / peak, 3)
    row |= {"linear_share": round(lin / best, 3), "attention_share": round(att / best, 3)}
    row["other_share"] = round(1 - (lin + att) / best, 3)
    print(json.dumps(row))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="1,4,16,32")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument(
        "--clock",
        choices=sorted(CLOCK),
        default="wall",
        help="time runs and steps by wall time or by the process's CPU time (with --threads 1: what the run computed, "
        "without the time a shared VM gave to other guests)",
    )
    ap.add_argument("--profile", type=int, default=0)
    ap.add_argument("--efficiency", default="", help="stream counts whose step GFLOP/s to report, e.g. 1,16,32")
    ap.add_argument(
        "--all", action="store_true", help="also the prefill and memory figures (bench_prefill, bench_memory)"
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    global clock
    clock = CLOCK[args.clock]
    conc = [int(c) for c in args.concurrency.split(",") if c]
    most = max(conc + [args.profile] + [int(c) for c in args.efficiency.split(",") if c])
    engine = Engine.from_pretrained(SMALL, max_model_len=512, scheduler_config=_sched(most))
    head = {
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "clock": args.clock,
    }
    print(json.dumps({"bench": "batch", **head, "steps": args.steps, "blocks": args.blocks}))
    _run(engine, 2, args, True)  # warm-up both paths
    _run(engine, 2, args, False)
    best: dict[int, dict[bool, float]] = {n: {True: 0.0, False: 0.0} for n in conc}
    for r in range(args.rounds):  # every concurrency in every round: a slow minute slows them all alike
        for n in conc:
            order = (True, False) if r % 2 == 0 else (False, True)
            toks = {}
            for stacked in order:
                tps, toks[stacked] = _run(engine, n, args, stacked)
                best[n][stacked] = max(best[n][stacked], tps)
            assert toks[True] == toks[False], f"stacked and per-canvas tokens differ at {n} streams"
    for n in conc:
        s, p = best[n][True], best[n][False]
        print(
            json.dumps(
                {"streams": n, "stacked_tok_s": round(s, 1), "per_canvas_tok_s": round(p, 1), "ratio": round(s / p, 3)}
            )
        )
    lo, hi = min(conc), max(conc)
    print(
        json.dumps(
            {
                f"stacked_{hi}_over_{lo}": round(best[hi][True] / best[lo][True], 2),
                f"per_canvas_{hi}_over_{lo}": round(best[hi][False] / best[lo][False], 2),
            }
        )
    )
    if args.profile:
        _profile(engine, args.profile, args)
    if args.efficiency:
        peak = _peak_gflops()
        for n in [int(c) for c in args.efficiency.split(",") if c]:
            _efficiency(engine, n, args, peak)
    if args.all:
        _prefill_and_memory(args)


def _prefill_and_memory(args) -> None:
    """The rest of the batch-scaling figures in the same run (docs/memory.md): the first block of a 2,000-token prompt
    against transformers' prefill (bench_prefill), the CPU step's peak at the real vocabulary at 1 and 8 streams, and
    the 26B shape's state per stream and step peak at 1, 8, 32 and 64 streams in bf16 (bench_memory, exact accounting
    on the meta device)."""
    import bench_memory
    import bench_prefill

    bench_prefill.main(["--rounds", "3"] + (["--threads", str(args.threads)] if args.threads else []))
    vocab = ["--vocab", "262144", "--canvas-length", "16", "--rows", "per-row", "--tile", "1"]
    one, eight = (bench_memory.main(vocab + ["--canvases", str(n)]) for n in (1, 8))
    print(
        json.dumps({"cpu_step_peak_8_over_1_real_vocab": round(eight["step_peak_bytes"] / one["step_peak_bytes"], 3)})
    )
    bench_memory.main(["--rows", "per-row"])


def _sched(n: int):
    from dgserve.engine.scheduler import SchedulerConfig

    return SchedulerConfig(max_num_seqs=max(n, 1))


if __name__ == "__main__":
    main()
