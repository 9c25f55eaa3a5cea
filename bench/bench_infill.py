"""Edit in place (docs/edit-in-place.md) on the shipped small model (or --model): a fill-in-the-middle task, and
what pins cost per denoising step.

    python bench/bench_infill.py [--windows 40] [--blank 6] [--suffix 10] [--prefix 24] [--steps 48]
                                 [--batch 8] [--repeats 3] [--json out.json]

Fill in the middle: windows of documentation prose (the docstrings of Python standard-library modules, the
domain the small model was trained in, though not its held-out split), cut into a prefix (the prompt), a middle of
--blank tokens and a suffix of --suffix tokens. Two ways to write the middle, same seeds:

* infill: initial_canvas = [-1] * blank + suffix, the suffix pinned, max_new_tokens = blank + suffix: the blanks
  start from the noise and are denoised with the suffix in view (the canvas holds both);
* noise: the same prompt, max_new_tokens = blank: the blanks from noise with the prefix only, as today.

Per way: exact-token accuracy of the middle against the original text, the fraction of its words found in the
model's training lexicon (tests/data/modern_train_words.txt, the model card's word score), and the denoising steps
to commit the block holding the middle. Both fit one canvas when blank + suffix <= C.

Pin cost: --batch requests with and without pins (same prompts, seeds and shapes), every block run to its full
--steps (confidence_threshold too small to stop early), the best of --repeats: seconds per denoising step of the
batch. One JSON line per measurement.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pathlib
import re
import time

from dgserve import Engine, SamplingParams
from dgserve.engine.prompt import Submission
from dgserve.model.default_model import default_model_path

MODULES = (
    "json",
    "textwrap",
    "argparse",
    "collections",
    "pathlib",
    "functools",
    "itertools",
    "logging",
    "csv",
    "subprocess",
    "shutil",
    "tempfile",
    "string",
    "inspect",
    "contextlib",
    "dataclasses",
    "enum",
    "typing",
)
LEXICON = pathlib.Path(__file__).resolve().parents[1] / "tests" / "data" / "modern_train_words.txt"


def texts() -> list[str]:
    """Prose paragraphs of the modules' docstrings (and their public functions'), whitespace-normalised."""
    out = []
    for name in MODULES:
        mod = importlib.import_module(name)
        objs = [mod] + [getattr(mod, a) for a in sorted(dir(mod)) if not a.startswith("_") and a not in ("io", "re")]
        docs = [o.__doc__ for o in objs if isinstance(getattr(o, "__doc__", None), str)]
        for d in docs:
            for para in re.split(r"\n\s*\n", d):
                para = " ".join(para.split())
                if len(para) > 200 and ">>>" not in para:
                    out.append(para)
    return out


def windows(engine: Engine, n: int, prefix: int, blank: int, suffix: int):
    """n (prefix ids, middle ids, suffix ids) windows, one per paragraph, in a fixed order."""
    tok = engine.tokenizer
    found = []
    for para in texts():
        ids = tok.encode_content(para)
        if len(ids) >= prefix + blank + suffix:
            bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
            found.append(
                (bos + ids[:prefix], ids[prefix : prefix + blank], ids[prefix + blank : prefix + blank + suffix])
            )
        if len(found) == n:
            break
    return found


def word_score(engine: Engine, ids: list[int], lexicon: set[str]) -> tuple[int, int]:
    words = re.findall(r"[A-Za-z]+", engine.tokenizer.decode(ids))
    return sum(w.lower() in lexicon for w in words), len(words)


def run(engine: Engine, subs: list[Submission]):
    reqs = [engine.add(engine.make_request(s)) for s in subs]
    while not all(r.finished for r in reqs):
        engine.step()
    return [r.result() for r in reqs]


def fill_in_the_middle(engine: Engine, args, lexicon: set[str]) -> list[dict]:
    rows = []
    wins = windows(engine, args.windows, args.prefix, args.blank, args.suffix)
    for way in ("infill", "noise"):
        hit = total = good = words = steps = early = 0
        for i, (pre, mid, suf) in enumerate(wins):
            if way == "infill":
                p = SamplingParams(max_new_tokens=args.blank + args.suffix, max_denoising_steps=args.steps, seed=i)
                sub = Submission(
                    pre, p, initial_canvas=[-1] * args.blank + suf, pinned=[[args.blank, args.blank + len(suf)]]
                )
            else:
                sub = Submission(pre, SamplingParams(max_new_tokens=args.blank, max_denoising_steps=args.steps, seed=i))
            res = run(engine, [sub])[0]
            got = res.token_ids[: args.blank]
            if way == "infill":
                assert res.token_ids[args.blank :] == suf, "a pinned token moved"
            # the blanks from noise may end early with EOS (the missing tokens count as misses); with the suffix
            # pinned they cannot (EOS is barred before the last pin)
            hit += sum(a == b for a, b in zip(got, mid, strict=False))
            early += res.finish_reason == "eos" and len(res.token_ids) < args.blank
            total += len(mid)
            g, w = word_score(engine, got, lexicon)
            good, words, steps = good + g, words + w, steps + res.blocks[0].denoising_steps
        rows.append(
            {
                "bench": "fill_in_the_middle",
                "way": way,
                "windows": len(wins),
                "blank": args.blank,
                "suffix": args.suffix,
                "prefix": args.prefix,
                "max_denoising_steps": args.steps,
                "middle_token_accuracy": round(hit / max(1, total), 4),
                "middle_real_words": round(good / max(1, words), 4),
                "steps_to_commit": round(steps / max(1, len(wins)), 2),
                "ended_before_the_blanks_were_filled": early,
            }
        )
    return rows


def pin_cost(engine: Engine, args) -> list[dict]:
    wins = windows(engine, args.batch, args.prefix, args.blank, args.suffix)
    C = engine.model.config.canvas_length
    rows = []
    for way in ("pinned", "plain"):
        best = float("inf")
        for _ in range(args.repeats):
            subs = []
            for i, (pre, _, suf) in enumerate(wins):
                p = SamplingParams(max_new_tokens=C, max_denoising_steps=args.steps, seed=i, confidence_threshold=1e-30)
                extra = {"initial_canvas": [-1] * args.blank + suf, "pinned": [[args.blank, args.blank + len(suf)]]}
                subs.append(Submission(pre, p, **(extra if way == "pinned" else {})))
            reqs = [engine.add(engine.make_request(s)) for s in subs]
            while any(r.block is None for r in reqs):  # prefill and start the blocks outside the clock
                engine.step()
            t0, n = time.perf_counter(), 0
            while not all(r.finished for r in reqs):
                engine.step()
                n += 1
            best = min(best, (time.perf_counter() - t0) / n)
        rows.append(
            {
                "bench": "pin_cost",
                "way": way,
                "batch": len(wins),
                "canvas": C,
                "pinned_per_row": args.suffix if way == "pinned" else 0,
                "seconds_per_step": round(best, 5),
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--prefix", type=int, default=24)
    ap.add_argument("--blank", type=int, default=6)
    ap.add_argument("--suffix", type=int, default=10)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    engine = Engine.from_pretrained(args.model or default_model_path())
    lexicon = set(LEXICON.read_text().split())
    rows = fill_in_the_middle(engine, args, lexicon) + pin_cost(engine, args)
    for r in rows:
        print(json.dumps(r))
    if args.json:
        pathlib.Path(args.json).write_text("\n".join(json.dumps(r) for r in rows) + "\n")


if __name__ == "__main__":
    main()
