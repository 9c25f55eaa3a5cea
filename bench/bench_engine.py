"""End-to-end generation speed: dgserve's Engine vs transformers 5.23.0's generate() on the same weights.

    python bench/bench_engine.py [--shape tiny|mid|26b-a4b] [--device cpu|cuda] [--dtype float32|bfloat16]
                                 [--experts bf16|nvfp4] [--steps 16] [--blocks 4] [--prompt-len 512]
                                 [--concurrency 1,4,16] [--no-baseline] [--mem-gbps 3000]
    python bench/bench_engine.py --step-figures [--baseline-src /path/to/old/python] [--prompt-lens 32,1024,...]

``--step-figures`` (issue 17) measures the engine itself, before and after in one run: with ``--baseline-src`` (a
``python/`` directory of another checkout, e.g. ``git archive main python``) the same measurement runs in a
subprocess with that tree on PYTHONPATH, and both are printed with their ratios. Per prompt length: the median
time of a denoising step (steps with no prefill and no block commit), the time per step including prefill,
and the bytes allocated by one denoising step (a TorchDispatchMode summing every op output that is not a view
or an in-place result); per concurrency: tokens/s; and a digest of the tokens, which must be equal.

Weights are random, drawn per tensor from a seed directly on the device (dgserve.tiny.random_tensor), so the
baseline and ours see identical weights without a checkpoint on disk. transformers runs first and is freed
before ours is built (two bf16 copies of 26B-A4B do not fit an H100). Work is fixed: `--steps` denoising steps
per block with adaptive stopping off and EOS ignored; one more configuration uses the default adaptive
settings. Warm-up first, best of `--repeats`. One JSON line per configuration: per-step and per-block time,
time to first block, tokens/s, peak memory, the ratio to transformers, and, with `--mem-gbps`, the fraction of
the memory-bandwidth roofline (every weight byte read once per denoising step at batch 1).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import platform
import resource
import time

import torch

from dgserve.checkpoint import expected_shapes, hf_names


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _device_name(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"


def _peak_bytes(device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _weight_bytes(config, dtype, experts) -> int:
    total = 0
    for name, shape in expected_shapes(config).items():
        n = torch.Size(shape).numel()
        if experts == "nvfp4" and ".experts." in name:
            total += n // 2 + n // 16 + 8  # 4-bit codes + one E4M3 scale per 16 (+ global scales)
        else:
            total += n * torch.tensor([], dtype=dtype).element_size()
    return total


def _weights(config, seed, dtype, device, experts):
    from dgserve import nvfp4
    from dgserve.tiny import random_weights

    w = random_weights(config, seed, dtype, device)
    if experts == "nvfp4":  # the CPU/reference path runs on exactly dequantized NVFP4 weights
        for name in [n for n in w if ".experts." in n]:
            t = w[name]
            for e in range(t.shape[0]):
                t[e] = nvfp4.dequantize(*nvfp4.quantize(t[e]), t.shape[2]).to(dtype)
    return w


def _hf_model(config, seed, dtype, device, experts):
    """transformers' model with the same weights as ours (loaded into its parameters, then ours are freed)."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    hf_cfg = DiffusionGemmaConfig.from_dict(config.to_dict())
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            hf = DiffusionGemmaForBlockDiffusion(hf_cfg).eval()
    finally:
        torch.set_default_dtype(old)
    state = {}
    for canonical, t in _weights(config, seed, dtype, device, experts).items():
        for hf_name in hf_names(canonical):
            state[hf_name] = t
    missing, _ = hf.load_state_dict(state, strict=False)
    text_missing = [
        m for m in missing if "vision" not in m and not m.endswith(("inv_freq", "embed_scale", "lm_head.weight"))
    ]
    assert not text_missing, text_missing[:5]
    return hf


def _time(fn, device, repeats):
    fn()
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best, out


def _baseline(args, config, dtype, device, prompt):
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

    hf = _hf_model(config, 0, dtype, device, args.experts)
    kw = dict(
        max_new_tokens=args.blocks * config.canvas_length,
        max_denoising_steps=args.steps,
        sampler_config=EntropyBoundSamplerConfig(entropy_bound=0.1),
        confidence_threshold=1e-30,
        eos_token_id=None,
        pad_token_id=None,
    )
    x = torch.tensor([prompt], device=device)
    with torch.no_grad():
        secs, out = _time(functools.partial(hf.generate, x, **kw), device, args.repeats)
    n = out.sequences.shape[1] - len(prompt)
    del hf, out
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return n / secs


def _ours(args, config, dtype, device, prompt, params, concurrency):
    from dgserve import SamplingParams

    engine = args.engine
    plist = [SamplingParams(**{**params.__dict__, "seed": 1 + i}) for i in range(concurrency)]
    secs, results = _time(lambda: engine.generate_batch([prompt] * concurrency, plist), device, args.repeats)
    ntok = sum(len(r.token_ids) for r in results)
    steps = sum(r.denoising_steps for r in results) / concurrency
    _sync(device)
    t0 = time.perf_counter()
    first = next(iter(engine.stream(prompt, plist[0])))
    ttfb = time.perf_counter() - t0
    return secs, ntok, steps, ttfb, len(results[0].blocks), first


def _step_figures_main(args) -> None:
    """--step-figures: ours (this tree) and, with --baseline-src, the baseline's in a subprocess; ratios."""
    import os
    import statistics
    import subprocess
    import sys

    argv = [a for a in sys.argv[1:] if a != "--step-figures"]
    if "--baseline-src" in argv:  # the children measure; they must not recurse
        i = argv.index("--baseline-src")
        del argv[i : i + 2]
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python")
    trees = {"after": here} | ({"before": args.baseline_src} if args.baseline_src else {})
    runs: dict[str, list[dict]] = {k: [] for k in trees}
    for _ in range(args.rounds):  # alternate the trees: a shared, noisy machine loads both alike
        for key, src in trees.items():
            # the child puts the tree first on sys.path before this file imports dgserve
            boot = (
                "import runpy, sys; sys.path.insert(0, sys.argv[1]); sys.argv = sys.argv[2:]; "
                "runpy.run_path(sys.argv[0], run_name='__main__')"
            )
            cmd = [sys.executable, "-c", boot, src, __file__, "--step-figures-json", *argv]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            runs[key].append(json.loads(out.strip().splitlines()[-1]))
    rows = {}
    for key, rs in runs.items():  # medians over rounds (bytes and tokens do not vary)
        row = dict(rs[0])
        for k in ("ms_per_step", "ms_per_step_incl_prefill", "tok_s"):
            row[k] = {n: round(statistics.median(r[k][n] for r in rs), 2) for n in rs[0][k]}
        row["rounds"] = len(rs)
        rows[key] = row
    load = os.getloadavg()
    for key, row in rows.items():
        print(json.dumps({"bench": "engine-steps", "tree": key, "loadavg": [round(x, 2) for x in load], **row}))
    if "before" in rows:
        b, a = rows["before"], rows["after"]
        ratio = {
            k: {n: round(b[k][n] / a[k][n], 3) if a[k][n] else None for n in a[k]}
            for k in ("ms_per_step", "ms_per_step_incl_prefill", "bytes_per_step", "cat_bytes_per_step")
        }
        ratio["tok_s"] = {n: round(a["tok_s"][n] / b["tok_s"][n], 3) for n in a["tok_s"]}
        same = a["tokens_digest"] == b["tokens_digest"]
        print(json.dumps({"bench": "engine-steps", "before_over_after": ratio, "tokens_equal": same}))


def _count_alloc_bytes():
    """A TorchDispatchMode that sums the bytes of every op output that is a new tensor (not a view, not an
    in-place or out= result): what the allocator hands out, kernel workspaces excepted."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        nbytes = 0
        cat_bytes = 0  # of which by concatenation (the old cache layout's per-step copies)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            rets = func._schema.returns
            if not func.is_view and rets and all(r.alias_info is None for r in rets):
                for t in out if isinstance(out, (tuple, list)) else (out,):
                    if isinstance(t, torch.Tensor):
                        self.nbytes += t.numel() * t.element_size()
                        if func is torch.ops.aten.cat.default:
                            self.cat_bytes += t.numel() * t.element_size()
            return out

    return Count()


def _step_figures(args) -> dict:
    """Runs in either tree (uses only Engine(model, scheduler_config=...), add_request, step, generate_batch)."""
    import hashlib
    import statistics

    from dgserve import DiffusionGemma, Engine, SamplingParams
    from dgserve.scheduler import SchedulerConfig
    from dgserve.tiny import preset

    torch.manual_seed(0)
    device, dtype = torch.device("cpu"), torch.float32
    config = preset(args.shape)
    model = DiffusionGemma(config, _weights(config, 0, dtype, device, "bf16"), dtype, device)
    C, chunk = config.canvas_length, 512
    engine = Engine(
        model, scheduler_config=SchedulerConfig(max_num_seqs=16, prefill_chunk=chunk, max_prefill_tokens=chunk)
    )
    params = SamplingParams(
        max_new_tokens=args.blocks * C, max_denoising_steps=args.steps, ignore_eos=True, confidence_threshold=1e-30
    )
    out: dict = {"shape": args.shape, "steps": args.steps, "blocks": args.blocks, "threads": torch.get_num_threads()}
    ms, incl, nbytes, cat_bytes, digest = {}, {}, {}, {}, hashlib.sha256()
    engine.generate([5, 6, 7], params)  # warm-up: lazy initialisation out of the figures
    for n in [int(x) for x in args.prompt_lens.split(",")]:
        prompt = torch.randint(3, config.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        engine.add_request(prompt, params)
        times = []
        while engine.has_unfinished():
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        n_prefill = -(-n // chunk)  # steps that only encode prompt chunks (the last one also runs a step)
        decode = [t for i, t in enumerate(times[n_prefill:]) if i % args.steps != 0]  # no prefill, no commit
        ms[n] = round(1e3 * statistics.median(decode), 2)
        incl[n] = round(1e3 * sum(times) / (args.steps * args.blocks), 2)
        engine.add_request(prompt, params)
        for _ in range(n_prefill + 2):  # prefill, then the block's first step
            engine.step()
        with _count_alloc_bytes() as counter:
            engine.step()  # one denoising step, mid-block
        nbytes[n], cat_bytes[n] = counter.nbytes, counter.cat_bytes
        while engine.has_unfinished():
            engine.step()
    prompt = [3 + i % (config.vocab_size - 3) for i in range(512)]
    tok_s = {}
    for conc in [int(c) for c in args.concurrency.split(",")]:
        plist = [SamplingParams(**{**params.__dict__, "seed": 1 + i}) for i in range(conc)]
        t0 = time.perf_counter()
        results = engine.generate_batch([prompt] * conc, plist)
        tok_s[conc] = round(sum(len(r.token_ids) for r in results) / (time.perf_counter() - t0), 1)
        for r in results:
            digest.update(str(r.token_ids).encode())
    out.update(
        ms_per_step=ms,
        ms_per_step_incl_prefill=incl,
        bytes_per_step=nbytes,
        cat_bytes_per_step=cat_bytes,
        tok_s=tok_s,
        tokens_digest=digest.hexdigest()[:16],
    )
    return out


def main() -> None:
    from dgserve import DiffusionGemma, Engine, SamplingParams, ops
    from dgserve.tiny import preset

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="mid")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    ap.add_argument("--experts", choices=["bf16", "nvfp4"], default="bf16")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--mem-gbps", type=float, default=None, help="memory bandwidth for the roofline (H100: 3000)")
    ap.add_argument("--step-figures", action="store_true", help="issue 17: step time, bytes per step, tok/s")
    ap.add_argument("--step-figures-json", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--baseline-src", default=None, help="with --step-figures: a python/ dir to measure as before")
    ap.add_argument("--prompt-lens", default="32,1024,4096,8000")
    ap.add_argument("--rounds", type=int, default=3, help="with --step-figures: alternating runs per tree")
    args = ap.parse_args()
    if args.step_figures_json:
        print(json.dumps(_step_figures(args)))
        return
    if args.step_figures:
        _step_figures_main(args)
        return
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    config = preset(args.shape)
    prompt = torch.randint(
        3, config.vocab_size, (args.prompt_len,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    hf_tok_s = None if args.no_baseline else _baseline(args, config, dtype, device, prompt)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model = DiffusionGemma(config, _weights(config, 0, dtype, device, args.experts), dtype, device)
    args.engine = Engine(model)
    fixed = SamplingParams(
        max_new_tokens=args.blocks * config.canvas_length,
        max_denoising_steps=args.steps,
        ignore_eos=True,
        confidence_threshold=1e-30,
    )
    adaptive = SamplingParams(max_new_tokens=args.blocks * config.canvas_length, ignore_eos=True)
    wbytes = _weight_bytes(config, dtype, args.experts)
    for label, params in (("fixed", fixed), ("adaptive", adaptive)):
        for conc in [int(c) for c in args.concurrency.split(",")]:
            if label == "adaptive" and conc != 1:
                continue
            secs, ntok, steps, ttfb, blocks, _ = _ours(args, config, dtype, device, prompt, params, conc)
            step_s = secs / steps  # steps: denoising steps each request ran (rows advance together)
            row = {
                "bench": "engine",
                "device": _device_name(device),
                "shape": args.shape,
                "dtype": str(dtype)[6:],
                "experts": args.experts,
                "steps": label if label == "adaptive" else args.steps,
                "concurrency": conc,
                "prompt_len": args.prompt_len,
                "blocks": blocks,
                "native_diffusion_step": ops.has_native("diffusion_step"),
                "tok_s": round(ntok / secs, 1),
                "ms_per_step": round(1e3 * step_s, 2),
                "ms_per_block": round(1e3 * secs / blocks, 1),
                "ms_to_first_block": round(1e3 * ttfb, 1),
                "mean_steps_per_block": round(steps / blocks, 2),
                "peak_mem_gb": round(_peak_bytes(device) / 1e9, 2),
            }
            if hf_tok_s is not None and conc == 1 and label == "fixed":
                row["transformers_tok_s"] = round(hf_tok_s, 1)
                row["ratio_vs_transformers"] = round(ntok / secs / hf_tok_s, 3)
            if args.mem_gbps and conc == 1:
                row["roofline_ms_per_step"] = round(1e3 * wbytes / (args.mem_gbps * 1e9), 2)
                row["pct_of_roofline"] = round(100 * wbytes / (args.mem_gbps * 1e9) / step_s, 1)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
