"""Grammar-constrained answers at the end of the token budget (docs/tools.md, "Valid to the last token").

    python bench/bench_tool_budget.py [--seeds 20] [--cases required,named,json] [--budgets 64,128,512]
                                      [--json-budgets 16,24,32]

On the shipped model, for each case × budget, `--seeds` seeded requests run batched (each row's result equals the
request alone: docs/exactness.md): "required" (tool_choice required, parallel calls allowed) and "named" (one named
function) with an ordinary schema (a `string` with no `maxLength`, an integer), "json" a `response_format`
json_schema document of the same kind. Per output: the finish reason the event layer reports, whether it is
*valid* (every returned call / the document parses and validates, and the answer is complete: at least one call,
or the whole document), whether a call or document that does not validate was returned, whether content holds a
piece of a marker, and the decoder forwards (denoising steps, all blocks). One JSON line per (case, budget).
"""

from __future__ import annotations

import argparse
import json
import time

import jsonschema
import torch

from dgserve import Engine, SamplingParams
from dgserve.engine.prompt import ChatPrompt, Submission
from dgserve.model.default_model import SHIPPED
from dgserve.outputs import FINISH_EOS
from dgserve.service.events import final_reason
from dgserve.structured import ResponseFormat
from dgserve.structured.tools import ToolSet

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The forecast", "parameters": SCHEMA}}
ASK = ({"role": "user", "content": "What is the weather in Paris?"},)
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def _prompt(case: str) -> ChatPrompt:
    if case == "json":
        return ChatPrompt(({"role": "user", "content": "Describe a person as JSON."},))
    choice = "required" if case == "required" else {"type": "function", "function": {"name": "get_weather"}}
    return ChatPrompt(ASK, tools=ToolSet.from_openai([WEATHER], choice))


def _judge(case: str, prompt: ChatPrompt, req, result) -> dict:
    """One output as the event layer would report it (its one parser, its finish rule)."""
    parser = prompt.output_parser(req)
    for block in result.blocks:
        parser.push(block.text)
    parser.finish(cut=result.finish_reason != FINISH_EOS)
    msg = parser.message()
    stray = any(m in msg.content for m in ("<|", "<tool", "<to")) or msg.content.endswith("<")
    if case == "json":
        try:
            jsonschema.validate(json.loads(result.text), PERSON)
            doc_ok = True
        except (ValueError, jsonschema.ValidationError):
            doc_ok = False
        returned_invalid = result.finish_reason == FINISH_EOS and not doc_ok
        return {"reason": result.finish_reason, "valid": doc_ok, "returned_invalid": returned_invalid, "stray": False}
    bad = 0
    for call in msg.tool_calls:
        try:
            jsonschema.validate(json.loads(call.arguments), SCHEMA)
        except (ValueError, jsonschema.ValidationError):
            bad += 1
    reason = final_reason(result.finish_reason, msg.tool_calls)
    valid = bool(msg.tool_calls) and bad == 0 and reason == "tool_calls"
    return {"reason": reason, "valid": valid, "returned_invalid": bad > 0, "stray": stray, "calls": len(msg.tool_calls)}


def run(engine: Engine, case: str, budget: int, seeds: int, steps: int | None = None) -> dict:
    """One line of figures for ``seeds`` seeded requests of ``case`` with max_tokens ``budget``, run batched."""
    prompt = _prompt(case)
    rf = ResponseFormat("json_schema", schema=json.dumps(PERSON)) if case == "json" else None
    knobs = {"max_denoising_steps": steps} if steps else {}
    params = [engine.default_params(seed=s, max_new_tokens=budget, response_format=rf, **knobs) for s in range(seeds)]
    t0 = time.perf_counter()
    reqs = [engine.add(engine.make_request(_submission(prompt, p))) for p in params]
    while not all(r.finished for r in reqs):
        engine.step()
    seconds = time.perf_counter() - t0
    rows = [_judge(case, prompt, r, r.result()) for r in reqs]
    steps = [sum(b.stats.denoising_steps for b in r.result().blocks) for r in reqs]
    reasons: dict[str, int] = {}
    for row in rows:
        reasons[row["reason"]] = reasons.get(row["reason"], 0) + 1
    return {
        "case": case,
        "max_tokens": budget,
        "seeds": seeds,
        "valid": sum(r["valid"] for r in rows),
        "returned_invalid": sum(r["returned_invalid"] for r in rows),
        "stray_marker": sum(r["stray"] for r in rows),
        "reasons": reasons,
        "calls": sum(r.get("calls", 0) for r in rows),
        "denoising_steps": sum(steps),
        "tokens": sum(len(r.result().token_ids) for r in reqs),
        "max_denoising_steps": params[0].max_denoising_steps,
        "seconds": round(seconds, 1),
    }


def _submission(prompt, params: SamplingParams) -> Submission:
    return Submission(prompt, params)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--cases", default="required,named,json")
    ap.add_argument("--budgets", default="64,128,512")
    ap.add_argument("--json-budgets", default="16,24,32")
    ap.add_argument("--steps", type=int, default=None, help="max_denoising_steps (default: the model's)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: a shared CPU host oversubscribes more)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine.from_pretrained(SHIPPED)
    for case in args.cases.split(","):
        budgets = args.json_budgets if case == "json" else args.budgets
        for budget in (int(b) for b in budgets.split(",")):
            print(json.dumps(run(engine, case, budget, args.seeds, args.steps)), flush=True)


if __name__ == "__main__":
    main()
