"""The ``dgserve`` command line: generate from a checkpoint directory, or make a random one.

    python -m dgserve generate [--model DIR] (--prompt TEXT | --prompt-ids 1,2,3) [--max-new-tokens N] ...
    python -m dgserve make-random DIR [--preset tiny|mid] [--seed S]

With no ``--model``, ``generate`` uses a tiny random checkpoint it writes to a temporary directory
(until the package ships a trained small model), so the command works on a fresh machine.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dgserve", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate from a prompt and stream each committed block")
    g.add_argument("--model", help="checkpoint directory (default: a tiny random model made on the fly)")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text (needs tokenizer.json in the checkpoint)")
    src.add_argument("--prompt-ids", help="comma-separated prompt token ids")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--max-denoising-steps", type=int, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--device", default="cpu")
    g.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    m = sub.add_parser("make-random", help="write a random checkpoint directory")
    m.add_argument("path")
    m.add_argument("--preset", default="tiny")
    m.add_argument("--seed", type=int, default=0)
    return p


def _generate(args) -> int:
    from dgserve import Engine

    model = args.model
    if model is None:
        from dgserve.tiny import make_random_checkpoint

        model = make_random_checkpoint(tempfile.mkdtemp(prefix="dgserve-tiny-"))
        print(f"# no --model given: generating from a tiny random checkpoint at {model}", file=sys.stderr)
    engine = Engine.from_pretrained(model, device=args.device, dtype=_DTYPES[args.dtype])
    if args.prompt is not None:
        prompt = args.prompt
    elif args.prompt_ids:
        prompt = [int(t) for t in args.prompt_ids.split(",")]
    else:
        prompt = [engine.model.config.bos_token_id or 2]
    overrides = dict(max_new_tokens=args.max_new_tokens, seed=args.seed, ignore_eos=args.ignore_eos,
                     stop=tuple(args.stop))
    if args.max_denoising_steps is not None:
        overrides["max_denoising_steps"] = args.max_denoising_steps
    try:
        params = engine.default_params(**overrides)
        t0 = time.perf_counter()
        for block in engine.stream(prompt, params):
            print(json.dumps({"block": block.index, "token_ids": block.token_ids, "text": block.text,
                              "denoising_steps": block.stats.denoising_steps,
                              "finish_reason": block.finish_reason}), flush=True)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"# {time.perf_counter() - t0:.2f} s", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "generate":
        return _generate(args)
    from dgserve.tiny import make_random_checkpoint

    print(make_random_checkpoint(args.path, args.preset, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
