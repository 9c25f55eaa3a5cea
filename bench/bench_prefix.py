"""Prefix caching (docs/prefix-caching.md): a 10-turn chat over a ~1.5 K-token system prompt, with and without reuse,
in one run on one machine, with the shipped small model (or --model).

    python bench/bench_prefix.py [--turns 10] [--system-tokens 1500] [--prefill-chunk 512] [--reply-tokens 16]
                                 [--repeats 3] [--json out.json]

Both engines get the same requests: the conversation is built once, from the replies of the engine without
reuse (the two engines' replies are identical: reuse does not change tokens, and the bench checks it on every
turn). Per turn it measures the first block (request added to first committed block, the best of --repeats
replays of the whole conversation; the reusing engine starts each replay with an empty prefix cache, so at each
turn it holds what the turns before left) and the prompt tokens encoded (prompt − cached). It
reports, per turn and in total, the ratio reuse / no reuse, and the bytes the prefix cache holds at the end.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from dgserve import Engine, SamplingParams
from dgserve.engine.prompt import ChatPrompt, Submission
from dgserve.engine.scheduler import SchedulerConfig
from dgserve.model.default_model import default_model_path

WORDS = (
    "You are the operations assistant of a logistics company. Answer precisely, cite the relevant policy section,"
    " and never invent shipment numbers. Policies: "
)


def system_prompt(engine: Engine, tokens: int) -> str:
    """A system message of about ``tokens`` tokens (policy sections numbered so that no two repeat exactly)."""
    text, i = WORDS, 0
    while len(engine.prompt_ids(text)) < tokens:
        i += 1
        text += f"Section {i}: parcels over {i * 3} kg ship by freight, refunds within {i + 14} days. "
    return text


def first_block(engine: Engine, prompt: ChatPrompt, params: SamplingParams) -> tuple[float, list[int], int, int]:
    """(seconds from add to the first committed block, all tokens, prompt tokens, cached tokens)."""
    req = engine.add(engine.make_request(Submission(prompt, params)))
    t0 = time.perf_counter()
    first = None
    while not req.finished:
        out = engine.step()
        if first is None and any(r is req for r, _ in out.blocks):
            first = time.perf_counter() - t0
    res = req.result()
    assert first is not None
    return first, res.token_ids, res.prompt_tokens, res.cached_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--system-tokens", type=int, default=1500)
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--reply-tokens", type=int, default=16)  # one canvas: 10 turns fit the 2 K context
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    path = args.model or default_model_path()
    sched = SchedulerConfig(max_num_seqs=4, prefill_chunk=args.prefill_chunk, max_prefill_tokens=args.prefill_chunk)
    engines = {
        reuse: Engine.from_pretrained(path, scheduler_config=sched, prefix_caching=reuse) for reuse in (False, True)
    }
    cold, warm = engines[False], engines[True]
    system = system_prompt(cold, args.system_tokens)
    params = SamplingParams(max_new_tokens=args.reply_tokens, seed=1234, max_denoising_steps=16)
    tok = cold.tokenizer
    assert tok is not None
    cold.generate("warm up", params)
    warm.generate("warm up", params)
    assert warm.runner.prefix is not None
    warm.runner.prefix.clear()

    # the conversation, once: each turn's prompt and the reply the model gives to it (identical on both engines)
    messages: list[dict] = [{"role": "system", "content": system}]
    prompts = []
    for turn in range(args.turns):
        messages.append({"role": "user", "content": f"Turn {turn}: where is shipment batch {turn * 7 + 3}?"})
        prompts.append(ChatPrompt(tuple(messages)))
        reply = cold.generate(prompts[-1], params).token_ids
        messages.append({"role": "assistant", "content": tok.decode(reply, skip_special_tokens=True)})

    # --repeats replays of the whole conversation; the reusing engine starts each with an empty prefix cache
    times: dict[tuple[bool, int], list[float]] = {}
    seen: dict[tuple[bool, int], tuple[list[int], int, int]] = {}
    for _ in range(args.repeats):
        warm.runner.prefix.clear()
        for turn, prompt in enumerate(prompts):
            for reuse, engine in engines.items():
                t, ids, n_prompt, n_cached = first_block(engine, prompt, params)
                times.setdefault((reuse, turn), []).append(t)
                if seen.setdefault((reuse, turn), (ids, n_prompt, n_cached)) != (ids, n_prompt, n_cached):
                    raise AssertionError(f"turn {turn}: a replay differs from the first")
    rows = []
    for turn in range(args.turns):
        (ids0, n_prompt, _), (ids1, _, n_cached) = seen[(False, turn)], seen[(True, turn)]
        assert ids0 == ids1, f"turn {turn}: reuse changed the tokens"
        t_cold, t_warm = min(times[(False, turn)]), min(times[(True, turn)])
        rows.append(
            {
                "turn": turn + 1,
                "prompt_tokens": n_prompt,
                "cached_tokens": n_cached,
                "prefill_tokens_reuse": n_prompt - n_cached,
                "first_block_ms_no_reuse": round(t_cold * 1e3, 1),
                "first_block_ms_reuse": round(t_warm * 1e3, 1),
                "ratio": round(t_warm / t_cold, 3),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    total_cold = sum(r["prompt_tokens"] for r in rows)
    total_warm = sum(r["prefill_tokens_reuse"] for r in rows)
    prefix = warm.runner.prefix
    summary = {
        "model": str(path),
        "device": str(warm.model.device),
        "threads": torch.get_num_threads(),
        "prefill_chunk": args.prefill_chunk,
        "turns": args.turns,
        "prefill_tokens_no_reuse": total_cold,
        "prefill_tokens_reuse": total_warm,
        "prefill_ratio": round(total_warm / total_cold, 3),
        "first_block_ms_no_reuse_total": round(sum(r["first_block_ms_no_reuse"] for r in rows), 1),
        "first_block_ms_reuse_total": round(sum(r["first_block_ms_reuse"] for r in rows), 1),
        "prefix_cache_blocks": len(prefix),
        "prefix_cache_bytes": prefix.held_bytes,
        "prefix_cache_capacity_bytes": prefix.capacity_bytes,
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"turns": rows, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
