"""End-to-end generation speed on CPU: dgserve's Engine vs transformers' generate() on the same weights.

    python bench/bench_engine.py [--shapes tiny,mid] [--steps 16] [--blocks 4] [--prompt-len 32] [--repeats 3]

For each shape: writes a random checkpoint (dgserve.tiny presets), loads it in both, runs the same
prompt for the same number of blocks × fixed denoising steps (adaptive stopping off, EOS ignored), warm-up
first, best of N. Prints one JSON line per configuration with tokens/s of both and the ratio ours/theirs,
plus where our time goes (encoder, decoder, sampler) from one profiled run.
"""
from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time

import torch


def _ours(engine, prompt, params, repeats):
    from dgserve import SamplingParams  # noqa: F401

    engine.generate(prompt, params)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        res = engine.generate(prompt, params)
        best = min(best, time.perf_counter() - t0)
    return best, len(res.token_ids)


def _theirs(hf, prompt, blocks, C, steps, repeats):
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

    kw = dict(max_new_tokens=blocks * C, max_denoising_steps=steps, t_min=0.4, t_max=0.8,
              sampler_config=EntropyBoundSamplerConfig(entropy_bound=0.1), stability_threshold=1,
              confidence_threshold=1e-30, eos_token_id=None, pad_token_id=None)
    x = torch.tensor([prompt])
    with torch.no_grad():
        hf.generate(x, **kw)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = hf.generate(x, **kw)
            best = min(best, time.perf_counter() - t0)
    return best, out.sequences.shape[1] - len(prompt)


def _breakdown(engine, prompt, params):
    """Seconds in encoder, decoder and sampler for one generate() call (wrapping the three entry points)."""
    spent = {"encode": 0.0, "denoise": 0.0, "sample": 0.0}

    def timed(key, fn):
        def run(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[key] += time.perf_counter() - t0
        return run

    m, s = engine.model, engine.sampler
    orig = m.encode_row, m.denoise, s.step
    m.encode_row, m.denoise, s.step = timed("encode", orig[0]), timed("denoise", orig[1]), timed("sample", orig[2])
    try:
        t0 = time.perf_counter()
        engine.generate(prompt, params)
        total = time.perf_counter() - t0
    finally:
        m.encode_row, m.denoise, s.step = orig
    return {k: round(v / total, 3) for k, v in spent.items()}


def bench_shape(name, steps, blocks, prompt_len, repeats, threads):
    from transformers import DiffusionGemmaForBlockDiffusion

    from dgserve import Engine, SamplingParams, ops
    from dgserve.tiny import make_random_checkpoint, preset

    cfg = preset(name)
    path = make_random_checkpoint(tempfile.mkdtemp(prefix=f"dg-bench-{name}-"), cfg, seed=0)
    engine = Engine.from_pretrained(path)
    hf = DiffusionGemmaForBlockDiffusion.from_pretrained(path, dtype=torch.float32).eval()
    prompt = torch.randint(3, cfg.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_new_tokens=blocks * cfg.canvas_length, max_denoising_steps=steps, seed=1,
                            ignore_eos=True, confidence_threshold=1e-30)   # never stops early: fixed work
    ours_s, ours_n = _ours(engine, prompt, params, repeats)
    theirs_s, theirs_n = _theirs(hf, prompt, blocks, cfg.canvas_length, steps, repeats)
    return {
        "bench": "engine", "device": f"cpu ({platform.processor() or platform.machine()}, {threads} threads)",
        "shape": name, "vocab": cfg.vocab_size, "hidden": cfg.hidden_size, "layers": cfg.num_hidden_layers,
        "experts": f"{cfg.top_k_experts}/{cfg.num_experts}", "canvas": cfg.canvas_length, "prompt_len": prompt_len,
        "blocks": blocks, "steps_per_block": steps, "native_diffusion_step": ops.has_native("diffusion_step"),
        "ours_s": round(ours_s, 4), "ours_tok_s": round(ours_n / ours_s, 1),
        "transformers_s": round(theirs_s, 4), "transformers_tok_s": round(theirs_n / theirs_s, 1),
        "ratio_ours_over_transformers": round((ours_n / ours_s) / (theirs_n / theirs_s), 3),
        "ms_per_denoising_step": round(1e3 * ours_s / (blocks * steps), 2),
        "time_share": _breakdown(engine, prompt, params),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="tiny,mid")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for name in args.shapes.split(","):
        print(json.dumps(bench_shape(name, args.steps, args.blocks, args.prompt_len, args.repeats, args.threads)),
              flush=True)


if __name__ == "__main__":
    main()
