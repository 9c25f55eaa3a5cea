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


# ---------------------------------------------------------------------------------------------- by construction


def test_a_knob_beyond_its_dtype_is_refused_before_admission(engine):
    """entropy_bound / confidence_threshold above float32's largest value used to pass validation and overflow in
    the model runner's float32 knob table inside the engine step (an engine fault for every caller); a positive
    one below float32's smallest normal would be flushed towards zero. Both are refused, naming the field."""
    for name in ("entropy_bound", "confidence_threshold", "t_max"):
        for value in (3.5e38, 1e300, 1e-39, 1e-300):
            with pytest.raises(ValueError, match=rf"^{name} must be > 0, a float32 in \[1\.17549"):
                params(**{name: value})
    big = params(entropy_bound=3.4028234663852886e38, confidence_threshold=3.4028234663852886e38, seed=2)
    tiny = params(entropy_bound=1.1754943508222875e-38, confidence_threshold=1.1754943508222875e-38, seed=2)
    for p in (big, tiny):  # the extremes accepted run, alone
        assert engine.generate("edge", p).finish_reason in ("eos", "length")
    assert engine.runner.occupants == [] and not engine.has_unfinished()


def _forced(p: SamplingParams, **values) -> SamplingParams:
    """``p`` with values validation would refuse (as a gap in it would let through)."""
    for name, v in values.items():
        object.__setattr__(p, name, v)
    return p


def _run(engine, reqs) -> list:
    failed = []
    while not all(r.finished for r in reqs):
        failed += engine.step().failed
    return failed


def test_a_value_that_fails_in_the_step_ends_its_request_alone(engine):
    """The structural guarantee, whatever validation misses: a knob that overflows its float32 table at admission
    (the exact failure of an entropy_bound of 1e39 before its bound came from its dtype) ends that request alone,
    with a RequestFailedError naming neither the value nor the prompt; the others give their solo tokens."""
    from dgserve.engine.request import RequestFailedError

    alone = [engine.generate("hello", params(seed=5)), engine.generate("more text", params(seed=6))]
    victim = engine.make_request(Submission("secret prompt", _forced(params(seed=4), entropy_bound=1e39)))
    reqs = [engine.add(victim), engine.add(engine.make_request(Submission("hello", params(seed=5))))]
    reqs.append(engine.add(engine.make_request(Submission("more text", params(seed=6)))))
    assert _run(engine, reqs) == [victim]
    assert isinstance(victim.error, RequestFailedError) and "admission" in str(victim.error)
    assert "secret" not in str(victim.error) and "1e+39" not in str(victim.error)
    for r, ref in zip(reqs[1:], alone, strict=True):
        assert r.result().token_ids == ref.token_ids
    assert engine.runner.occupants == [] and not engine.has_unfinished()


@pytest.mark.parametrize(
    "phase, method", [("admission", "admit"), ("prefill", "prefill"), ("block start", "start_block")]
)
@pytest.mark.parametrize("error", [ValueError("max_new_tokens: bad"), RuntimeError("secret prompt text")])
def test_every_per_request_phase_is_guarded(engine, monkeypatch, phase, method, error):
    """An exception in one request's admission, prefill or block start ends that request alone: a ValueError (its
    input) is its error as it is (INVALID_ARGUMENT / 400 naming the field); anything else becomes a
    RequestFailedError naming the phase and not the content (INTERNAL for that request only). The neighbour
    completes with its solo tokens, the victim's slot is freed, and the engine keeps serving."""
    from dgserve.engine.request import RequestFailedError

    ref = engine.generate("neighbour", params(seed=9))
    victim = engine.add(engine.make_request(Submission("victim", params(seed=8), request_id="victim")))
    other = engine.add(engine.make_request(Submission("neighbour", params(seed=9))))
    real = getattr(engine.runner, method)

    def failing(req, *args, **kwargs):
        if req is victim:
            raise error
        return real(req, *args, **kwargs)

    monkeypatch.setattr(engine.runner, method, failing)
    # the stacked encoder pass (several requests' chunks as one) fails with the victim among them: each request's
    # prefill then runs alone, where the victim's fails
    stacked = {"prefill": "prefill_stacked", "start_block": "encode_pending"}.get(method)
    if stacked is not None:
        real_stacked = getattr(engine.runner, stacked)

        def failing_stacked(work):
            if any((w[0] if isinstance(w, tuple) else w) is victim for w in work):
                raise error
            return real_stacked(work)

        monkeypatch.setattr(engine.runner, stacked, failing_stacked)
    assert _run(engine, [victim, other]) == [victim]
    if isinstance(error, ValueError):
        assert victim.error is error
    else:
        assert isinstance(victim.error, RequestFailedError) and phase in str(victim.error)
        assert "secret" not in str(victim.error)
    assert other.result().token_ids == ref.token_ids
    assert engine.runner.occupants == [] and not engine.has_unfinished()
    monkeypatch.undo()
    assert engine.generate("neighbour", params(seed=9)).token_ids == ref.token_ids


def test_a_failure_of_the_shared_pass_is_an_engine_fault_naming_its_phase(engine, monkeypatch):
    """The batched denoising pass is every running request's work: its exception is raised out of ``step`` as a
    SharedWorkError that says which phase failed and that it is no single request's, without the cause's text."""
    from dgserve.engine.request import SharedWorkError

    def broken(reqs):
        raise RuntimeError("secret prompt text")

    monkeypatch.setattr(engine.runner, "run", broken)
    req = engine.add(engine.make_request(Submission("x", params(seed=1))))
    with pytest.raises(SharedWorkError, match=r"batched denoising pass over 1 requests.*no single request's") as e:
        while True:
            engine.step()
    assert "secret" not in str(e.value) and isinstance(e.value.__cause__, RuntimeError)
    engine.abort(req.request_id)
    monkeypatch.undo()
    engine.step()
    assert engine.runner.occupants == [] and not engine.has_unfinished()


# ---------------------------------------------------------------------------------------------- time


def test_a_request_past_its_time_ends_with_length_and_frees_its_slot(engine, monkeypatch):
    """max_request_seconds, counted from admission: a long request ends at the first step after its time is up
    with finish reason "length", keeping the blocks it committed (token_ids and text agree with them); its slot
    is freed; a short neighbour is unaffected (its solo tokens). The clock is moved, not waited for: the request's
    admission time is set back once it has committed two blocks."""
    monkeypatch.setattr(engine, "max_request_seconds", 3600.0)
    ref = engine.generate("short", params(seed=2))
    long_params = SamplingParams(max_new_tokens=16 * 200, max_denoising_steps=2, ignore_eos=True, seed=3)
    long = engine.add(engine.make_request(Submission("long", long_params)))
    short = engine.add(engine.make_request(Submission("short", params(seed=2))))
    assert long.time_limit == 3600.0
    while len(long.blocks) < 2:
        engine.step()
    assert long.admitted_at is not None
    long.admitted_at -= 3600.0  # its hour is up
    engine.step()
    result = long.result()
    assert result.finish_reason == "length" and len(result.blocks) == 2 and long.block is None
    assert result.token_ids == [t for b in result.blocks for t in b.token_ids] and len(result.token_ids) == 32
    while not short.finished:
        engine.step()
    assert short.result().token_ids == ref.token_ids
    engine.step()
    assert engine.runner.occupants == [] and not engine.has_unfinished()


def test_a_running_request_ends_at_its_deadline(engine):
    """The client's deadline ends a running request too (finish reason "length"), as the server's limit does."""
    import time

    req = engine.make_request(
        Submission("long", SamplingParams(max_new_tokens=16 * 200, max_denoising_steps=2, ignore_eos=True, seed=3)),
        deadline=time.monotonic() + 3600,
    )
    engine.add(req)
    while not req.blocks:
        engine.step()
    req.deadline = time.monotonic() - 1  # passed while it runs
    engine.step()
    assert req.finished and req.result().finish_reason == "length" and len(req.result().token_ids) == 16
    engine.step()
    assert engine.runner.occupants == [] and not engine.has_unfinished()


def test_a_failing_prefix_lookup_costs_its_request_the_reuse_only(engine, monkeypatch):
    """Planning: the prefix-cache lookup at admission is one request's; if it raises, that request encodes its
    whole prompt (the same tokens) and the scheduling of the others goes on."""
    ref = engine.generate("a prompt to look up", params(seed=12))

    def broken(req):
        raise RuntimeError("secret")

    monkeypatch.setattr(engine.runner, "match_prefix", broken)
    assert engine.generate("a prompt to look up", params(seed=12)).token_ids == ref.token_ids
    assert engine.runner.occupants == [] and not engine.has_unfinished()
