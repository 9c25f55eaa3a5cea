"""Prefill speed against transformers: the first committed block of a long prompt in dgserve (every prompt chunk
encoded, then the block's denoising steps) beside transformers' prefill of the same prompt (its encoder over the
whole prompt, filling a DynamicCache), the shipped small model, fp32, CPU, in one process, alternated.

    python bench/bench_prefill.py [--tokens 2000] [--rounds 3] [--threads N] [--profile]

Each round runs transformers' prefill, then dgserve's first block (a fresh request, prefix caching off, so every
round encodes the whole prompt); the ratios are per round (dgserve / transformers), their median printed last.
dgserve's own prefill time (the runner's encoder passes, ``Request.encode_seconds``) is printed beside its first
block. ``--profile``: one more dgserve first block under torch.profiler, its top ops by CPU time.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import torch

import dgserve
from dgserve import Engine, SamplingParams
from dgserve.engine.prompt import Submission

SMALL = pathlib.Path(dgserve.__file__).resolve().parent / "models" / "small"


def prompt_ids(engine: Engine, tokens: int) -> list[int]:
    """``tokens`` ids: the small model's card text, tokenized and repeated (real text, no special ids)."""
    assert engine.tokenizer is not None
    ids = engine.tokenizer.encode_content((SMALL / "README.md").read_text())
    return [engine.model.config.bos_token_id] + (ids * (tokens // len(ids) + 1))[: tokens - 1]


def dgserve_first_block(engine: Engine, ids: list[int]) -> tuple[float, float, list[int]]:
    """(seconds to the first committed block, of which encoding the prompt, its tokens)."""
    C = engine.model.config.canvas_length
    params = SamplingParams(max_new_tokens=C, seed=1, max_denoising_steps=8)
    req = engine.add(engine.make_request(Submission(ids, params)))
    t0 = time.perf_counter()
    while True:
        out = engine.step()
        if out.blocks:  # the first block: no committed block before it to encode, so encode_seconds is the prompt's
            return time.perf_counter() - t0, req.encode_seconds, out.blocks[0][1].token_ids


def hf_prefill(hf, ids: list[int]) -> float:
    """Seconds of transformers' prefill: its encoder over the prompt, with a fresh DynamicCache."""
    from transformers import DynamicCache

    x = torch.tensor([ids])
    t0 = time.perf_counter()
    with torch.inference_mode():
        hf.model.encoder(
            input_ids=x,
            position_ids=torch.arange(len(ids))[None],
            past_key_values=DynamicCache(config=hf.config.get_text_config()),
            use_cache=True,
        )
    return time.perf_counter() - t0


def profile(engine: Engine, ids: list[int], rows: int = 15) -> str:
    """One dgserve first block under torch.profiler: the top ops by self CPU time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    with prof(activities=[ProfilerActivity.CPU]) as p:
        dgserve_first_block(engine, ids)
    return p.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--profile", action="store_true")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import DiffusionGemmaForBlockDiffusion

    hf = DiffusionGemmaForBlockDiffusion.from_pretrained(SMALL, dtype=torch.float32).eval()
    engine = Engine.from_pretrained(SMALL, dtype=torch.float32, prefix_caching=False)
    ids = prompt_ids(engine, args.tokens)
    hf_prefill(hf, ids[:64])  # warm both up on a short prompt
    dgserve_first_block(engine, ids[:64])
    rounds = []
    for r in range(args.rounds):
        hf_s = hf_prefill(hf, ids)
        first, encode, _ = dgserve_first_block(engine, ids)
        row = {
            "round": r,
            "hf_prefill_s": round(hf_s, 3),
            "dgserve_first_block_s": round(first, 3),
            "dgserve_prefill_s": round(encode, 3),
            "ratio_first_block": round(first / hf_s, 3),
            "ratio_prefill": round(encode / hf_s, 3),
        }
        rounds.append(row)
        print(json.dumps(row), flush=True)
    res = {
        "tokens": len(ids),
        "threads": torch.get_num_threads(),
        "median_ratio_first_block": statistics.median(r["ratio_first_block"] for r in rounds),
        "median_ratio_prefill": statistics.median(r["ratio_prefill"] for r in rounds),
    }
    print(json.dumps(res))
    if args.profile:
        print(profile(engine, ids))
    return res


if __name__ == "__main__":
    main()
