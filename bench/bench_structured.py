"""Structured output: validity, tokens committed per forward, ms per denoising step with and without a grammar,
and the grammar matcher's share of a step (docs/structured-output.md).

    python bench/bench_structured.py [--models small,tiny] [--seeds 10] [--max-new-tokens 128] [--steps 16]

Models: "small" is the shipped checkpoint (python/dgserve/models/small), "tiny" a random tiny model with a
300-id byte-level BPE (its free output is noise, so the grammar does all the work). For each model, five schemas
(nested objects, arrays, enums, numbers, strings with patterns) × `--seeds` seeds run one request at a time
(batch 1), constrained, and the same prompts and seeds unconstrained. Per request: tokens returned / decoder
forwards, denoise wall time / forwards (the forward + the sampler step + the grammar hooks), and the time spent in
the grammar hooks (bitmask, verification walk, block finish, jump-forward at block start). One JSON line per
(model, schema, mode) with medians, then one summary line per model; plus the diffusion_step op alone with and
without a bitmask at the model's shape. CPU timings on a shared machine are noisy: medians are reported.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import tempfile
import time

import torch

from dgserve import Engine, ops
from dgserve.model.default_model import SHIPPED, write_tiny_random_model
from dgserve.structured import ResponseFormat, hooks
from dgserve.structured.constrained import StructuredRow

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 16}},
                "required": ["id", "name"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
        "additionalProperties": False,
    },
    "array": {
        "type": "object",
        "properties": {"scores": {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 5}},
        "required": ["scores"],
        "additionalProperties": False,
    },
    "enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": ["S", "M", "L"]}},
        "required": ["color", "size"],
        "additionalProperties": False,
    },
    "numbers": {
        "type": "object",
        "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 150}, "ratio": {"type": "number"}},
        "required": ["age", "ratio"],
        "additionalProperties": False,
    },
    "pattern": {
        "type": "object",
        "properties": {
            "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
            "code": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
        },
        "required": ["date", "code"],
        "additionalProperties": False,
    },
}


class HookTimer:
    """Wall time spent in the structured-output hooks (patched in for the bench only)."""

    def __init__(self):
        self.seconds = 0.0
        self.rows: list[StructuredRow] = []

    def wrap(self, fn):
        @functools.wraps(fn)
        def timed(*args, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.seconds += time.perf_counter() - t0

        return timed

    def install(self) -> None:
        hooks.step_bitmask = self.wrap(hooks.step_bitmask)
        hooks.after_step = self.wrap(hooks.after_step)
        StructuredRow.start_block = self.wrap(StructuredRow.start_block)


def validate(text: str, schema: dict) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    try:
        import jsonschema
    except ImportError:  # the test extra is not installed: parsing is the check
        return True
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return False
    return True


def run(engine: Engine, timer: HookTimer, schema: dict | None, seed: int, args) -> dict:
    fmt = None if schema is None else ResponseFormat("json_schema", schema=json.dumps(schema))
    params = engine.default_params(
        max_new_tokens=args.max_new_tokens, max_denoising_steps=args.steps, seed=seed, response_format=fmt
    )
    before = timer.seconds
    r = engine.generate("Reply with a JSON document:", params)
    forwards = r.denoising_steps
    denoise = sum(b.stats.denoise_seconds for b in r.blocks)
    return dict(
        tokens=len(r.token_ids),
        forwards=forwards,
        tokens_per_forward=len(r.token_ids) / forwards,
        ms_per_step=1e3 * denoise / forwards,
        matcher_share=(timer.seconds - before) / denoise if denoise else 0.0,
        valid=(schema is None) or (r.finish_reason == "eos" and validate(r.text, schema)),
        finish=r.finish_reason,
    )


def median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def op_times(engine: Engine, repeats: int = 50) -> dict:
    """ms of ops.diffusion_step at [1, C, V] without a bitmask, with an all-allowed one, and a sparse one."""
    C, V = engine.model.config.canvas_length, engine.model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    args = (4 * torch.randn(1, C, V, generator=g), torch.tensor([0.6]), torch.tensor([7]), torch.tensor([0]))
    args += (torch.tensor([9]), torch.tensor([0.1]))
    sparse = torch.randint(-(2**31), 2**31 - 1, (1, C, (V + 31) // 32), generator=g, dtype=torch.int32) & 0x01010101
    out = {}
    for name, mask in [("none", None), ("all_ones", torch.full_like(sparse, -1)), ("sparse", sparse)]:
        ops.diffusion_step(*args, mask)
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            ops.diffusion_step(*args, mask)
            ts.append(time.perf_counter() - t0)
        out[f"op_ms_{name}"] = round(1e3 * statistics.median(ts), 4)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="small,tiny")
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=16, help="max_denoising_steps (adaptive stopping stays on)")
    args = ap.parse_args()
    timer = HookTimer()
    timer.install()
    tmp = tempfile.mkdtemp(prefix="bench-structured-")
    for model in args.models.split(","):
        path = str(SHIPPED) if model == "small" else write_tiny_random_model(f"{tmp}/tiny")
        engine = Engine.from_pretrained(path)
        engine.generate("warm up", engine.default_params(max_new_tokens=16, seed=0))
        shape = dict(C=engine.model.config.canvas_length, V=engine.model.config.vocab_size)
        every: dict[str, list[dict]] = {"free": [], "json_schema": []}
        for name, schema in SCHEMAS.items():
            for mode, sch in (("free", None), ("json_schema", schema)):
                rows = [run(engine, timer, sch, seed, args) for seed in range(args.seeds)]
                every[mode] += rows
                line = dict(model=model, schema=name, mode=mode, requests=len(rows), **shape)
                line.update({k: round(median(rows, k), 4) for k in ("tokens", "tokens_per_forward", "ms_per_step")})
                line["matcher_share"] = round(median(rows, "matcher_share"), 4)
                line["valid"] = f"{sum(r['valid'] for r in rows)}/{len(rows)}"
                line["finish"] = {f: sum(r["finish"] == f for r in rows) for f in {r["finish"] for r in rows}}
                print(json.dumps(line), flush=True)
        summary = dict(model=model, summary=True, threads=torch.get_num_threads(), **shape, **op_times(engine))
        for mode, rows in every.items():
            summary[mode] = {k: round(median(rows, k), 4) for k in ("tokens_per_forward", "ms_per_step")}
        summary["json_schema"]["matcher_share"] = round(median(every["json_schema"], "matcher_share"), 4)
        summary["json_schema"]["valid"] = f"{sum(r['valid'] for r in every['json_schema'])}/{len(every['json_schema'])}"
        print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
