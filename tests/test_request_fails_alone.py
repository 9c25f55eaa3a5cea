"""A request fails alone: schemas that admit no finite document, nest too deep or admit only an empty output are
refused before admission; a grammar that fails inside the engine step ends its own request with an error naming
response_format, frees its slot, and leaves the other requests' tokens exactly what they are alone."""

from __future__ import annotations

import json

import pytest

from dgserve import Engine, SamplingParams
from dgserve.engine.prompt import Submission
from dgserve.model.default_model import write_tiny_random_model
from dgserve.structured import ResponseFormat
from dgserve.structured.constrained import GrammarFailure
from dgserve.structured.schema_check import MAX_SCHEMA_DEPTH, check_productive

# no finite document: each must contain itself
UNPRODUCTIVE = {
    "array_of_itself": {"type": "array", "minItems": 1, "items": {"$ref": "#"}},
    "defs_ring": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    "required_self": {
        "$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}},
        "$ref": "#/$defs/n",
    },
    "prefix_items": {"type": "array", "prefixItems": [{"$ref": "#"}], "minItems": 1},
    "all_of": {
        "allOf": [{"type": "object"}, {"type": "object", "required": ["x"], "properties": {"x": {"$ref": "#"}}}]
    },
    "false_required": {"type": "object", "properties": {"x": False}, "required": ["x"]},
}
# recursive, with finite documents (the recursion can stop)
PRODUCTIVE = {
    "tree": {
        "type": "object",
        "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#"}}},
        "required": ["v"],
    },
    "nested_arrays": {"type": "array", "items": {"$ref": "#"}},
    "linked_list": {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {"next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}},
                "required": ["next"],
            }
        },
        "$ref": "#/$defs/node",
    },
    "either": {"anyOf": [{"type": "array", "minItems": 1, "items": {"$ref": "#"}}, {"type": "string"}]},
    "enum_stops": {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"], "enum": [{"x": 1}]},
}
# a ring through an "$id" reference: not judged before admission (the check is conservative), and the grammar
# engine runs into its own limit on the first forced tokens, inside the engine step
FAILS_IN_THE_STEP = {
    "$defs": {
        "a": {"$id": "http://example.com/a", "type": "array", "minItems": 1, "items": {"$ref": "http://example.com/a"}}
    },
    "$ref": "http://example.com/a",
}
GOOD = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    return Engine.from_pretrained(write_tiny_random_model(tmp_path_factory.mktemp("alone") / "tiny"))


def fmt(schema: dict | str) -> ResponseFormat:
    return ResponseFormat("json_schema", schema=schema if isinstance(schema, str) else json.dumps(schema))


def params(schema=None, seed: int = 3, **kw) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=64,
        max_denoising_steps=4,
        seed=seed,
        response_format=None if schema is None else fmt(schema),
        **kw,
    )


@pytest.mark.parametrize("name", sorted(UNPRODUCTIVE))
def test_unproductive_schemas_are_refused_before_admission(engine, name):
    with pytest.raises(ValueError, match="response_format: the schema admits no finite JSON document"):
        engine.add_request("x", params(UNPRODUCTIVE[name]))
    assert not engine.has_unfinished()


@pytest.mark.parametrize("name", sorted(PRODUCTIVE))
def test_recursive_schemas_with_finite_documents_pass(name):
    check_productive(PRODUCTIVE[name])


def test_deep_schemas_are_refused():
    deep = {"type": "array", "items": {}}
    node = deep
    for _ in range(MAX_SCHEMA_DEPTH):
        node["items"] = {"type": "array", "items": {}}
        node = node["items"]
    with pytest.raises(ValueError, match=f"response_format: schema nests .* at most {MAX_SCHEMA_DEPTH}"):
        fmt(deep)
    with pytest.raises(ValueError, match="response_format: schema nests too deep"):
        fmt("[" * 30_000)


@pytest.mark.parametrize(
    "schema",
    [{"type": "integer", "minimum": 5, "maximum": 3}, {"enum": []}, {"type": "string", "minLength": 2, "maxLength": 1}],
)
def test_contradictory_schemas_are_refused(engine, schema):
    """Contradictions the grammar compiler finds before admission."""
    with pytest.raises(ValueError, match="response_format: invalid json_schema: Unsatisfiable"):
        engine.add_request("x", params(schema))
    assert not engine.has_unfinished()


def test_stop_strings_are_refused_with_a_response_format():
    with pytest.raises(ValueError, match=r"^stop: cannot be combined with response_format"):
        params(GOOD, stop=("}",))


def test_a_grammar_failing_in_the_step_ends_its_request_alone(engine):
    """The failing request ends with a GrammarFailure naming response_format; its slot is free; its neighbours
    give exactly the tokens they give alone; the engine keeps serving."""
    alone = [engine.generate("hello", params(GOOD, seed=5)), engine.generate("free text", params(seed=6))]
    reqs = [
        engine.add(engine.make_request(Submission("hi", params(FAILS_IN_THE_STEP, seed=1)))),
        engine.add(engine.make_request(Submission("hello", params(GOOD, seed=5)))),
        engine.add(engine.make_request(Submission("free text", params(seed=6)))),
    ]
    failed = []
    while not all(r.finished for r in reqs):
        failed += engine.step().failed
    assert failed == [reqs[0]] and isinstance(reqs[0].error, GrammarFailure)
    assert str(reqs[0].error).startswith("response_format: the grammar failed during generation")
    with pytest.raises(GrammarFailure):
        reqs[0].result()
    for r, ref in zip(reqs[1:], alone, strict=True):
        assert r.result().token_ids == ref.token_ids and r.result().finish_reason == ref.finish_reason
    assert engine.runner.occupants == [] and not engine.has_unfinished()
    assert engine.generate("again", params(GOOD, seed=5)).finish_reason in ("eos", "length")


def test_output_failure_ends_its_request_alone(engine, monkeypatch):
    """Per-request work after the batched step (here: decoding its block) that raises ends that request with a
    generic RequestFailedError, never its content; the neighbour completes."""
    from dgserve.engine.request import RequestFailedError

    victim = engine.add(engine.make_request(Submission("boom", params(seed=8))))
    other = engine.add(engine.make_request(Submission("fine", params(seed=9))))

    def broken(canvas):
        raise RuntimeError("secret prompt text")

    monkeypatch.setattr(victim.tracker, "add_block", broken)
    while not (victim.finished and other.finished):
        engine.step()
    assert isinstance(victim.error, RequestFailedError) and "secret" not in str(victim.error)
    assert other.result().finish_reason in ("eos", "length")
    assert engine.runner.occupants == []
