"""Structured output on a random tiny model (its free output is noise, so the grammar does all the work): every
output parses and validates against its schema across seeds; EOS only where the grammar ends; seeded determinism
and batch invariance; jump-forward; the grammar cache; bad formats rejected with a message naming response_format.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from dgserve import Engine, SamplingParams
from dgserve.model.default_model import SHIPPED, write_tiny_random_model
from dgserve.structured import ResponseFormat
from dgserve.structured.grammar import NUMBER_LIMIT, GrammarCompiler, bound_numbers

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "email": {"type": "string", "pattern": "^[a-z]{2,6}@[a-z]{2,5}\\.com$"},
                },
                "required": ["id", "email"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
        "additionalProperties": False,
    },
    "array": {
        "type": "object",
        "properties": {"scores": {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 4}},
        "required": ["scores"],
        "additionalProperties": False,
    },
    "enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": ["S", "M", "L", 42]}},
        "required": ["color", "size"],
        "additionalProperties": False,
    },
    "numbers": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "ratio": {"type": "number"},
            "count": {"type": "integer"},
        },
        "required": ["age", "ratio", "count"],
        "additionalProperties": False,
    },
    "pattern": {
        "type": "object",
        "properties": {
            "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
            "code": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
            "note": {"type": "string", "maxLength": 12},
        },
        "required": ["date", "code", "note"],
        "additionalProperties": False,
    },
    "array_of_objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"k": {"type": "string", "enum": ["x", "y"]}, "v": {"type": ["integer", "null"]}},
            "required": ["k", "v"],
            "additionalProperties": False,
        },
        "maxItems": 3,
    },
}
SEEDS = range(6)


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    return Engine.from_pretrained(write_tiny_random_model(tmp_path_factory.mktemp("structured") / "tiny"))


def schema_format(schema: dict) -> ResponseFormat:
    return ResponseFormat("json_schema", schema=json.dumps(schema), name="test")


def params(fmt: ResponseFormat | None, seed: int, **kw) -> SamplingParams:
    base = dict(max_new_tokens=160, max_denoising_steps=6, seed=seed, response_format=fmt)
    base.update(kw)
    return SamplingParams(**base)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_output_parses_and_validates(engine, name):
    schema = SCHEMAS[name]
    fmt = schema_format(schema)
    results = engine.generate_batch(["Answer in JSON:"] * len(SEEDS), [params(fmt, s) for s in SEEDS])
    for r in results:
        assert r.finish_reason == "eos", (r.finish_reason, r.text)
        assert r.token_ids[-1] in engine.eos_ids and not any(t in engine.eos_ids for t in r.token_ids[:-1])
        jsonschema.validate(json.loads(r.text), schema)
    assert len({r.text for r in results}) > 1  # the seeds matter: the constraint does not pick one document


def test_json_object_regex_and_choice(engine):
    fmts = [
        ResponseFormat("json_object"),
        ResponseFormat("regex", regex="[0-9]{3}-[a-z]{2,4}"),
        ResponseFormat("choice", choices=("yes", "no", 'maybe "so"')),
    ]
    for s in range(4):
        obj, rx, ch = engine.generate_batch(["q"] * 3, [params(f, s) for f in fmts])
        # any object: its strings are unbounded, and noise rarely closes one, so "length" is a legal end here
        if obj.finish_reason == "eos":
            assert isinstance(json.loads(obj.text), dict)
        else:
            assert obj.finish_reason == "length" and obj.text.startswith("{")
            assert engine._grammar_compiler().matcher(fmts[0]).consume_tokens(obj.token_ids)
        assert rx.finish_reason == "eos" and len(rx.text) in range(6, 9) and rx.text[:3].isdigit() and rx.text[3] == "-"
        assert ch.text in fmts[2].choices


def test_seeded_determinism_alone_and_batched(engine):
    """Same seed, same tokens: alone, batched with constrained and unconstrained requests, and again."""
    fa, fb = schema_format(SCHEMAS["nested"]), schema_format(SCHEMAS["pattern"])
    batch = [params(fa, 3), params(None, 4), params(fb, 5), params(fa, 6)]
    prompts = ["hello", [5, 6, 7], "JSON please", "x"]
    together = engine.generate_batch(prompts, batch)
    for prompt, p, res in zip(prompts, batch, together, strict=True):
        alone = engine.generate(prompt, p)
        assert alone.token_ids == res.token_ids and alone.finish_reason == res.finish_reason
        assert [b.denoising_steps for b in alone.blocks] == [b.denoising_steps for b in res.blocks]
    assert engine.generate_batch(prompts, batch)[0].token_ids == together[0].token_ids


def test_unconstrained_request_unchanged_by_a_constrained_neighbour(engine):
    p = params(None, 9, max_new_tokens=40)
    alone = engine.generate([5, 6, 7], p)
    mixed = engine.generate_batch([[5, 6, 7], "x"], [p, params(schema_format(SCHEMAS["enum"]), 1)])[0]
    assert mixed.token_ids == alone.token_ids


def test_length_ends_with_an_accepted_prefix(engine):
    """max_new_tokens runs out inside the document: finish "length", and the text is a grammar-accepted prefix."""
    fmt = schema_format(SCHEMAS["pattern"])  # at least 40 characters: cannot fit in 7 tokens
    r = engine.generate("x", params(fmt, 2, max_new_tokens=7))
    assert r.finish_reason == "length" and len(r.token_ids) == 7
    m = engine._grammar_compiler().matcher(fmt)
    assert m.consume_tokens(r.token_ids) and not m.is_error()


def test_jump_forward_commits_forced_tokens_without_forwards(engine):
    """A schema that leaves one choice per position (a const object) needs no model decision at all."""
    const = {
        "type": "object",
        "properties": {"a": {"const": "fixed-value"}},
        "required": ["a"],
        "additionalProperties": False,
    }
    r = engine.generate("x", params(schema_format(const), 0))
    assert json.loads(r.text) == {"a": "fixed-value"}
    assert all(b.denoising_steps == 1 for b in r.blocks)  # each block is complete before its first step


def test_grammar_compiled_once_per_format(engine):
    fmt = schema_format({"type": "object", "properties": {"once": {"type": "integer"}}, "required": ["once"]})
    engine.generate("x", params(fmt, 0))
    n = engine._grammar_compiler().compiles
    engine.generate_batch(["x", "y"], [params(fmt, 1), params(fmt, 2)])
    assert engine._grammar_compiler().compiles == n


@pytest.mark.parametrize(
    "kw, problem",
    [
        (dict(type="json_schema", schema="{not json"), "not valid JSON"),
        (dict(type="json_schema", schema="[1, 2]"), "must be a JSON object"),
        (dict(type="json_schema", schema=json.dumps({"type": "objectx"})), "invalid json_schema"),
        (dict(type="json_schema", schema=json.dumps({"pattern": "x" * 40000})), "bytes"),
        (dict(type="regex", regex="[a-"), "invalid regex"),
        (dict(type="choice", choices=()), "at least one"),
        (dict(type="xml"), "type must be one of"),
        (dict(type="json_object", regex="a"), "not used"),
    ],
)
def test_bad_formats_name_response_format(engine, kw, problem):
    with pytest.raises(ValueError, match=problem) as e:
        engine.add_request("x", params(ResponseFormat(**kw), 0))
    assert "response_format" in str(e.value)
    assert not engine.has_unfinished()


def test_no_tokenizer_and_ignore_eos_are_rejected(tmp_path):
    from dgserve.model.tiny import make_random_checkpoint

    bare = Engine.from_pretrained(make_random_checkpoint(tmp_path / "bare", "tiny", seed=1))
    with pytest.raises(ValueError, match="response_format: structured output needs a tokenizer"):
        bare.add_request([5, 6], params(ResponseFormat("json_object"), 0))
    with pytest.raises(ValueError, match="response_format: cannot be combined with ignore_eos"):
        params(ResponseFormat("json_object"), 0, ignore_eos=True)


def test_compiler_rejects_a_model_without_eos():
    with pytest.raises(ValueError, match="response_format: this model has no EOS"):
        GrammarCompiler("{}", 10, ())


def test_shipped_model_outputs_validate():
    """The shipped model (a real tokenizer and confident logits: blocks end by the finish walk) on every schema."""
    engine = Engine.from_pretrained(str(SHIPPED))
    names = sorted(SCHEMAS)
    fmts = [schema_format(SCHEMAS[n]) for n in names]
    results = engine.generate_batch(["Reply with JSON:"] * len(names), [params(f, 1, max_new_tokens=128) for f in fmts])
    for name, r in zip(names, results, strict=True):
        assert r.finish_reason == "eos", (name, r.text)
        jsonschema.validate(json.loads(r.text), SCHEMAS[name])


def test_bound_numbers_adds_bounds_only_where_missing():
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "number"},
            "b": {"type": "integer", "minimum": 3},
            "c": {"type": ["number", "null"], "exclusiveMaximum": 5, "multipleOf": 0.5},
            "d": {"const": {"type": "number"}},  # data, not a schema: untouched
        },
        "items": [{"type": "integer"}],
        "anyOf": [{"type": "string"}],
    }
    out = bound_numbers(json.loads(json.dumps(schema)))
    p = out["properties"]
    assert p["a"] == {"type": "number", "minimum": -NUMBER_LIMIT, "maximum": NUMBER_LIMIT, "multipleOf": 1e-6}
    assert p["b"] == {"type": "integer", "minimum": 3, "maximum": NUMBER_LIMIT}
    assert p["c"] == {**schema["properties"]["c"], "minimum": -NUMBER_LIMIT}
    assert p["d"] == schema["properties"]["d"] and out["anyOf"] == schema["anyOf"]
    assert out["items"] == [{"type": "integer", "minimum": -NUMBER_LIMIT, "maximum": NUMBER_LIMIT}]
