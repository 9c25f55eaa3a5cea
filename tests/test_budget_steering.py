"""Steering a whole-or-nothing answer to a complete end inside its token budget (docs/structured-output.md §11.9):
the closer's plans (accepted by the grammar, end with EOS, within the limit, none when nothing fits), and on the
shipped model required / named tool calls and JSON documents that end complete and valid where the budget used to
cut them, exactly as alone when batched, seeded runs repeating."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from dgserve import Engine
from dgserve.engine.prompt import ChatPrompt, Submission
from dgserve.model.default_model import SHIPPED
from dgserve.outputs import FINISH_EOS
from dgserve.service.events import final_reason
from dgserve.structured import ResponseFormat
from dgserve.structured.closing import START, scan
from dgserve.structured.grammar import GrammarCompiler
from dgserve.structured.tools import ToolSet
from dgserve.text.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}
TIME_SCHEMA = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": TIME_SCHEMA}}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        "pet": {"enum": ["dog", "cat"]},
    },
    "required": ["name", "age", "tags", "pet"],
}
ASK = ({"role": "user", "content": "What is the weather in Paris?"},)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_pretrained(SHIPPED)


@pytest.fixture(scope="module")
def compiler(tok) -> GrammarCompiler:
    return GrammarCompiler(tok.to_json(), 2048, [1, 4])


def _required(thinking: bool = False) -> ResponseFormat:
    ts = ToolSet.from_openai([WEATHER, TIME], "required")
    assert ts is not None
    fmt = ts.response_format(thinking)
    assert fmt is not None
    return fmt


def _schema(schema: dict) -> ResponseFormat:
    return ResponseFormat("json_schema", schema=json.dumps(schema))


CASES = [
    (_required(), '<|tool_call>call:get_weather{"city":"Par', '"}<tool_call|>'),
    (_required(), "", None),
    (_required(), '<|tool_call>call:get_weather{"city":"Paris"}<tool_call|>', ""),
    (_required(), '<|tool_call>call:get_weather{"city":"Paris"}<tool_call|><', None),
    (_required(), '<|tool_call>call:get_time{"zone":"', None),
    (_required(thinking=True), '<|channel>thought\nhmm "a {', None),
    (_schema(PERSON), '{"name":"Bo', None),
    (ResponseFormat("json_object"), '{"a":[{"b":"x}]y', '"}]}'),
    (_schema({"type": "object", "properties": {"a": {"type": "array", "minItems": 2}}, "required": ["a"]}), "", None),
    (ResponseFormat("choice", choices=("alpha", "beta")), "al", "pha"),
]


@pytest.mark.parametrize("fmt, prefix, ending", CASES)
def test_a_plan_is_a_grammar_accepted_ending_within_the_limit(compiler, tok, fmt, prefix, ending):
    m = compiler.matcher(fmt)
    ids = tok.encode(prefix, add_special_tokens=False)
    assert all(m.consume_token(t) for t in ids)
    mask = bytes(m.compute_bitmask())
    where = scan(START, prefix.encode())
    plan = compiler.closer.plan(m, 60, where)
    assert plan is not None and len(plan) <= 60 and plan[-1] in (1, 4)
    assert bytes(m.compute_bitmask()) == mask  # the search left the matcher alone
    if ending is not None:
        assert tok.decode(plan[:-1], skip_special_tokens=False) == ending
    check = m.deep_copy()
    assert check.consume_tokens(plan) and check.is_stopped()
    too_short = compiler.closer.plan(m, 1, where) if len(plan) > 1 else None
    assert too_short is None


def test_no_plan_when_nothing_fits(compiler, tok):
    m = compiler.matcher(_required())
    for t in tok.encode('<|tool_call>call:get_weather{"city":"Par', add_special_tokens=False):
        m.consume_token(t)
    where = scan(START, b'{"city":"Par')
    assert len(compiler.closer.plan(m, 10, where) or []) == 10  # '"}' + the 7 tokens of <tool_call|> + EOS
    assert compiler.closer.plan(m, 9, where) is None
    assert compiler.closer.plan(m, 0, where) is None


def test_rank_prefers_value_starts(compiler):
    rank = compiler.closer.rank
    zero, letter = compiler.tokenizer.tokenize_str("0")[0], compiler.tokenizer.tokenize_str("q")[0]
    assert rank[zero] < rank[letter] < np.max(rank)


# ---------------------------------------------------------------------- the shipped model


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.from_pretrained(SHIPPED)


def _run(engine: Engine, prompt, budget: int, seed: int, fmt: ResponseFormat | None = None):
    params = engine.default_params(seed=seed, max_new_tokens=budget, max_denoising_steps=4, response_format=fmt)
    req = engine.add(engine.make_request(Submission(prompt, params)))
    while not req.finished:
        engine.step()
    return req


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_required_and_named_calls_end_complete_and_valid_at_128_tokens(engine, choice):
    """The issue's seeds: without steering these ended at length with cut arguments ({"city")."""
    prompt = ChatPrompt(ASK, tools=ToolSet.from_openai([WEATHER], choice))
    for seed in (6, 7, 8):
        req = _run(engine, prompt, 128, seed)
        result = req.result()
        parser = prompt.output_parser(req)
        for block in result.blocks:
            parser.push(block.text)
        parser.finish(cut=result.finish_reason != FINISH_EOS)
        msg = parser.message()
        assert result.finish_reason == FINISH_EOS and len(result.token_ids) <= 128, (seed, result.text)
        assert final_reason(result.finish_reason, msg.tool_calls) == "tool_calls" and msg.content == ""
        for call in msg.tool_calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMA)


def test_a_json_document_at_a_small_budget_ends_complete_and_valid(engine):
    prompt = ChatPrompt(({"role": "user", "content": "A person as JSON."},))
    for budget, seed in [(40, 0), (48, 1), (64, 2)]:  # the shortest document takes 36 tokens
        result = _run(engine, prompt, budget, seed, _schema(PERSON)).result()
        assert result.finish_reason == FINISH_EOS and len(result.token_ids) <= budget, result.text
        jsonschema.validate(json.loads(result.text), PERSON)


def test_a_budget_too_small_for_any_document_is_cut_and_says_so(engine):
    result = _run(engine, ChatPrompt(ASK), 3, 0, _schema(PERSON)).result()
    assert result.finish_reason == "length" and len(result.token_ids) == 3


def test_steered_rows_are_the_same_alone_and_batched(engine):
    prompt = ChatPrompt(ASK, tools=ToolSet.from_openai([WEATHER], "required"))
    params = [engine.default_params(seed=s, max_new_tokens=48, max_denoising_steps=4) for s in (6, 7)]
    alone = [engine.generate(prompt, p) for p in params]
    batched = engine.generate_batch([prompt, prompt], params)
    assert [r.token_ids for r in batched] == [r.token_ids for r in alone]
    assert engine.generate(prompt, params[0]).token_ids == alone[0].token_ids
