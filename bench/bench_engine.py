"""End-to-end generation speed: dgserve's Engine vs transformers 5.23.0's generate() on the same weights.

    python bench/bench_engine.py [--shape tiny|mid|26b-a4b] [--device cpu|cuda] [--dtype float32|bfloat16]
                                 [--experts bf16|nvfp4] [--steps 16] [--blocks 4] [--prompt-len 512]
                                 [--concurrency 1,4,16] [--no-baseline] [--mem-gbps 3000]
    python bench/bench_engine.py --figures --shape 26b-a4b --device cuda --experts nvfp4|bf16 [--max-seconds 90]
    python bench/bench_engine.py --step-figures [--baseline-src /path/to/old/python] [--prompt-lens 32,1024,...]

``--figures`` (what scripts/gpu_check.sh runs): the step alone at batch 1 and 16 (CUDA events after warm-up), a
canvas, the first block after a 4K prompt, tok/s at 1K in / 1K out for 1, 16 and 64 requests, peak memory, % of
the HBM roofline (H100 3350 GB/s, H200 4800 GB/s unless --mem-gbps), and as baseline the same engine and weights
with native ops off. The KV budget is explicit (``_kv_plan``): max_model_len as long as the longest figure needs,
one slot per request of the largest batch where the memory left after the LM-head / sampler tile, the requests'
self-conditioning logits and a margin allows; the "kv_plan" line prints the slots it got, and each figure the
requests that ran at once (a batch over the slots runs in waves and says so). With ``--experts nvfp4`` the
experts are real NVFP4 built on the device (random codes and scales, no dense copy) and run through the W4A16
kernels; on the CPU through their reference.

``--step-figures`` measures the engine itself, before and after in one run: with ``--baseline-src`` (a
``python/`` directory of another checkout, e.g. ``git archive main python``) the same measurement runs in a
subprocess with that tree on PYTHONPATH, and both are printed with their ratios. Per prompt length: the median
time of a denoising step (steps with no prefill and no block commit), the time per step including prefill,
and the bytes allocated by one denoising step (a TorchDispatchMode summing every op output that is not a view
or an in-place result); per concurrency: tokens/s; and a digest of the tokens, which must be equal.

Weights are random, drawn per tensor from a seed directly on the device (dgserve.model.tiny.random_tensor), so the
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

from dgserve.model.checkpoint import expected_shapes, hf_names


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _row_head(bench: str, args, device: torch.device, dtype: torch.dtype) -> dict:
    """The fields every JSON line of a bench names first: which bench, device, shape, dtype and expert format."""
    return {
        "bench": bench,
        "device": _device_name(device),
        "shape": args.shape,
        "dtype": str(dtype)[6:],
        "experts": args.experts,
    }


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


def _random_packed_experts(config, layer: int, seed: int, device) -> object:
    """One layer's experts as NVFP4, built on ``device`` without a dense copy: random E2M1 codes (packed two per
    byte), random E4M3 block scales in [0.5, 2) and a per-expert global scale that gives the decoded weights an
    RMS of about 0.02 (as ``random_weights`` draws the dense ones), then ``nvfp4.pack_experts`` (the native repack
    on CUDA) into the W4A16 kernel layout that ``ops.nvfp4_moe_experts`` runs on."""
    from dgserve.model import nvfp4

    E, H, I = config.num_experts, config.hidden_size, config.moe_intermediate_size
    g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + 7919 * layer + 1)
    rms_e2m1 = (sum(v * v for v in nvfp4.E2M1_VALUES) / 16) ** 0.5  # of a uniformly random code

    def proj(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        kp = nvfp4.padded(k)
        codes = torch.randint(0, 256, (E, n, kp // 2), generator=g, device=device, dtype=torch.uint8)
        # E4M3 bytes 0x30..0x3F: exponent 6 or 7, any mantissa = [0.5, 2); finite and positive as the kernels need
        scale = torch.randint(0x30, 0x40, (E, n, kp // nvfp4.GROUP), generator=g, device=device, dtype=torch.uint8)
        scale_2 = torch.full((E,), 0.02 / (rms_e2m1 * 1.2), device=device)  # 1.2: the mean block scale, roughly
        return codes, scale.view(torch.float8_e4m3fn), scale_2

    return nvfp4.pack_experts(proj(I, H), proj(I, H), proj(H, I))


def _weights(config, seed, dtype, device, experts):
    """Random weights on ``device``; with ``experts="nvfp4"`` the experts are real NVFP4 (``_random_packed_experts``
    under ``layers.{i}.experts.packed``), served by the W4A16 kernels on CUDA and by their reference on the CPU."""
    from dgserve.model.checkpoint import PACKED
    from dgserve.model.tiny import random_tensor, random_weights

    if experts != "nvfp4":
        return random_weights(config, seed, dtype, device)
    w = {
        n: random_tensor(n, s, seed, dtype, device) for n, s in expected_shapes(config).items() if ".experts." not in n
    }
    for layer in range(config.num_hidden_layers):
        w[f"layers.{layer}.{PACKED}"] = _random_packed_experts(config, layer, seed, device)
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
    from dgserve.engine.scheduler import SchedulerConfig
    from dgserve.model.tiny import preset

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


# HBM bandwidth (GB/s) of the cards the targets name, for the roofline when --mem-gbps is not given
_MEM_GBPS = {"H100": 3350.0, "H200": 4800.0}


def _mem_gbps(args, device) -> float | None:
    if args.mem_gbps or device.type != "cuda":
        return args.mem_gbps
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in _MEM_GBPS.items() if k in name), None)


class _Clock:
    """Wall time of a region: CUDA events on a CUDA device (read after one synchronisation), else perf_counter."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.end.record()
            self.end.synchronize()
            self.ms = self.start.elapsed_time(self.end)
        else:
            self.ms = 1e3 * (time.perf_counter() - self.t0)


def _step_ms(engine, config, device, batch: int, steps: int, timed: int = 4) -> float:
    """Median ms of one denoising step alone for ``batch`` running canvases: requests with 32-token prompts
    are admitted and prefilled, two steps run as warm-up, then ``timed`` steps are timed one by one (all inside
    the first block: no prefill, no commit), and the requests are aborted."""
    import statistics

    from dgserve import SamplingParams

    params = SamplingParams(
        max_new_tokens=config.canvas_length, max_denoising_steps=steps, ignore_eos=True, confidence_threshold=1e-30
    )
    prompt = [3 + i % (config.vocab_size - 3) for i in range(32)]
    ids = [engine.add_request(prompt, SamplingParams(**{**params.__dict__, "seed": 1 + i})) for i in range(batch)]
    for _ in range(2 + -(-32 * batch // 512)):  # prefill (512 prompt tokens per iteration), then two steps
        engine.step()
    times = []
    for _ in range(timed):
        with _Clock(device) as c:
            engine.step()
        times.append(c.ms)
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    return statistics.median(times)


# Device memory beside the weights and the KV cache that --figures budgets before sizing the cache (estimates):
# one LM-head / sampler tile holds per logit the model-dtype LM-head output, its fp32 copy and the sampler's fp32
# processed logits (2 + 4 + 4 bytes, 12 with slack); each running request keeps its self-conditioning logits
# [C, V] in the model dtype; the decoder's activations at the largest batch and the allocator's slack get a margin.
TILE_BYTES_PER_LOGIT = 12
ACTIVATION_MARGIN = {"cuda": 4 << 30, "cpu": 1 << 30}


def _kv_plan(model, args, device) -> dict:
    """The KV budget of --figures, explicit rather than 90% of the free memory for max_model_len 262,144 (6 GB of KV
    per slot at the 26B shape, so "batch 16" ran in waves of 5-10 slots): max_model_len just long enough for the
    figures' longest request, and a cache budget of exactly one slot per request of the largest batch (at least
    16), or of as many slots as fit in the free memory less one LM-head / sampler tile and a margin, each slot
    with its request's self-conditioning logits (TILE_BYTES_PER_LOGIT, ACTIVATION_MARGIN). Returns the Engine
    kwargs' values and the figures behind them."""
    from dgserve.engine.model_runner import free_memory
    from dgserve.engine.scheduler import SchedulerConfig
    from dgserve.model.cache import SlotCache

    cfg, C, V = model.config, model.config.canvas_length, model.config.vocab_size
    concurrency = [int(c) for c in args.concurrency.split(",")]
    slots = max(16, *concurrency)
    longest = max(args.long_prompt + C, args.prompt_len + -(-args.out_len // C) * C, 32 + C)
    max_len = min(-(-longest // C) * C, cfg.max_position_embeddings)
    chunk = max(SchedulerConfig().prefill_chunk, C)
    per_slot = SlotCache.bytes_per_slot(cfg, max_len, chunk, model.dtype)
    elt = torch.tensor([], dtype=model.dtype).element_size()
    tile = model.canvas_tile * C * V * TILE_BYTES_PER_LOGIT
    self_cond = C * V * elt  # per running request
    margin = ACTIVATION_MARGIN.get(device.type, ACTIVATION_MARGIN["cpu"])
    free, _ = free_memory(device)  # (bytes, what bounds them)
    fit = max(1, min(slots, (free - tile - margin) // (per_slot + self_cond)))
    return {
        "max_model_len": max_len,
        "slots_wanted": slots,
        "kv_bytes": fit * per_slot,
        "kv_gb_per_slot": round(per_slot / 1e9, 3),
        "lm_head_tile_gb": round(tile / 1e9, 2),
        "self_cond_gb": round(fit * self_cond / 1e9, 2),
        "margin_gb": round(margin / 1e9, 2),
        "free_gb": round(free / 1e9, 2),
    }


def _figures(args) -> None:
    """--figures: the step alone (batch 1 and 16), a canvas, the first block after a long prompt, tok/s at
    --prompt-len in / --out-len out for each --concurrency, peak memory and % of the HBM roofline; then the
    baseline: the same engine and weights with native ops off (the torch reference path). One JSON line per
    figure as it is measured; configurations that would start after --max-seconds are reported as skipped."""
    from dgserve import DiffusionGemma, Engine, SamplingParams, ops
    from dgserve.engine.cache_config import CacheConfig
    from dgserve.engine.scheduler import SchedulerConfig
    from dgserve.model.tiny import preset

    t_start = time.monotonic()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    config = preset(args.shape)
    torch.manual_seed(0)
    model = DiffusionGemma(config, _weights(config, 0, dtype, device, args.experts), dtype, device)
    build_s = time.monotonic() - t_start
    plan = _kv_plan(model, args, device)
    engine = Engine(
        model,
        scheduler_config=SchedulerConfig(max_num_seqs=plan["slots_wanted"]),
        max_model_len=plan["max_model_len"],
        cache_config=CacheConfig(memory=plan["kv_bytes"]),
        prefix_caching=False,  # every tok/s request has the same prompt: no reuse of its KV across requests
    )
    slots = engine.runner.num_slots
    C = config.canvas_length
    gbps = _mem_gbps(args, device)
    wbytes = _weight_bytes(config, dtype, args.experts)
    base = {
        **_row_head("engine-figures", args, device, dtype),
        "native_ops": ops.active_native_ops(device),
        "weight_gb": round(wbytes / 1e9, 2),
    }
    print(json.dumps({**base, "figure": "weights", "build_s": round(build_s, 1)}), flush=True)
    kv_gb = round(plan.pop("kv_bytes") / 1e9, 2)
    print(
        json.dumps(
            {**base, "figure": "kv_plan", **plan, "kv_gb": kv_gb, "slots": slots, "slot_len": engine.runner.slot_len}
        ),
        flush=True,
    )

    def emit(figure: str, **kw) -> None:
        print(
            json.dumps({**base, "figure": figure, **kw, "peak_mem_gb": round(_peak_bytes(device) / 1e9, 2)}), flush=True
        )

    def time_left(figure: str) -> bool:
        if time.monotonic() - t_start < args.max_seconds:
            return True
        print(json.dumps({**base, "figure": figure, "skipped": f"past --max-seconds {args.max_seconds:g}"}), flush=True)
        return False

    fixed = dict(max_denoising_steps=args.steps, ignore_eos=True, confidence_threshold=1e-30)
    step_ms: dict[int, float] = {}
    for batch in (1, 16):
        if time_left(f"step_b{batch}"):
            step_ms[batch] = _step_ms(engine, config, device, batch, args.steps)
            row = {"batch": batch, "slots": min(batch, slots), "ms_per_step": round(step_ms[batch], 2)}
            if batch > slots:
                row["waves"] = -(-batch // slots)  # the KV budget held fewer slots than the batch: not batch-B figures
            if gbps and batch == 1:
                roof = 1e3 * wbytes / (gbps * 1e9)
                row |= {"roofline_ms_per_step": round(roof, 2), "pct_of_roofline": round(100 * roof / step_ms[1], 1)}
            emit(f"step_b{batch}", **row)
    if time_left("canvas"):
        params = SamplingParams(max_new_tokens=C, **fixed)
        with _Clock(device) as c:
            engine.generate([3 + i % (config.vocab_size - 3) for i in range(32)], params)
        emit("canvas", steps=args.steps, canvas=C, ms_per_canvas=round(c.ms, 1))
    if time_left("first_block"):
        long_prompt = torch.randint(
            3, config.vocab_size, (args.long_prompt,), generator=torch.Generator().manual_seed(1)
        )
        params = SamplingParams(max_new_tokens=C, **fixed)
        with _Clock(device) as c:
            next(iter(engine.stream(long_prompt.tolist(), params)))
        while engine.has_unfinished():
            engine.step()
        emit("first_block", prompt_len=args.long_prompt, ms_to_first_block=round(c.ms, 1))
    prompt = torch.randint(3, config.vocab_size, (args.prompt_len,), generator=torch.Generator().manual_seed(0))
    for conc in [int(c) for c in args.concurrency.split(",")]:
        if not time_left(f"tok_s_c{conc}"):
            continue
        plist = [SamplingParams(max_new_tokens=args.out_len, seed=1 + i, **fixed) for i in range(conc)]
        with _Clock(device) as c:
            results = engine.generate_batch([prompt.tolist()] * conc, plist)
        ntok = sum(len(r.token_ids) for r in results)
        emit(
            f"tok_s_c{conc}",
            concurrency=conc,
            running=min(conc, slots),
            prompt_len=args.prompt_len,
            out_len=args.out_len,
            tok_s=round(1e3 * ntok / c.ms, 1),
            s_total=round(c.ms / 1e3, 2),
        )
    with ops.native_disabled():  # the baseline: the same engine and weights on the torch reference path
        for batch in (1, 16):
            if batch in step_ms and time_left(f"baseline_step_b{batch}"):
                ms = _step_ms(engine, config, device, batch, args.steps, timed=2)
                emit(
                    f"baseline_step_b{batch}",
                    batch=batch,
                    ms_per_step=round(ms, 2),
                    speedup_vs_baseline=round(ms / step_ms[batch], 2),
                )
    emit("done", total_s=round(time.monotonic() - t_start, 1))


def main() -> None:
    from dgserve import DiffusionGemma, Engine, SamplingParams, ops
    from dgserve.model.tiny import preset

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="mid")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    ap.add_argument("--experts", choices=["bf16", "nvfp4"], default="bf16")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=None, help="default 512 (--figures: 1024)")
    ap.add_argument("--concurrency", default=None, help="default 1,4 (--figures: 1,16,64)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--mem-gbps", type=float, default=None, help="memory bandwidth for the roofline (H100: 3000)")
    ap.add_argument("--step-figures", action="store_true", help="the engine itself: step time, bytes per step, tok/s")
    ap.add_argument("--step-figures-json", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--baseline-src", default=None, help="with --step-figures: a python/ dir to measure as before")
    ap.add_argument("--prompt-lens", default="32,1024,4096,8000")
    ap.add_argument("--figures", action="store_true", help="step, canvas, first block, tok/s, roofline, baseline")
    ap.add_argument("--out-len", type=int, default=1024, help="with --figures: tokens generated per request")
    ap.add_argument("--long-prompt", type=int, default=4096, help="with --figures: prompt of the first-block figure")
    ap.add_argument("--max-seconds", type=float, default=float("inf"), help="with --figures: start nothing after")
    ap.add_argument("--rounds", type=int, default=3, help="with --step-figures: alternating runs per tree")
    args = ap.parse_args()
    if not args.figures:
        args.concurrency = args.concurrency or "1,4"
        args.prompt_len = args.prompt_len or 512
    if args.step_figures_json:
        print(json.dumps(_step_figures(args)))
        return
    if args.step_figures:
        _step_figures_main(args)
        return
    if args.figures:
        args.concurrency = args.concurrency or "1,16,64"  # the figures' own defaults: 1K in, 1, 16, 64 requests
        args.prompt_len = args.prompt_len or 1024
        _figures(args)
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
                **_row_head("engine", args, device, dtype),
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
