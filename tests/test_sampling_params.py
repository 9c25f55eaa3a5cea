"""SamplingParams: one table of knobs (field metadata) carries the types, bounds and validation; every knob is
checked at its bounds from that table, so a bound added or changed there is tested here without a second copy."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest

from dgserve.sampling_params import KNOBS, SCALAR_KNOBS, Knob, KnobError, SamplingParams


def test_the_table_covers_the_contract_fields():
    """docs/architecture.md, "Public API": the ten fields, in order, all knobs; then the output knobs min_tokens
    and skip_special_tokens; the scalars are all but stop. The two fields after them, stop_token_ids (a list of ids
    checked against the vocabulary by the engine) and response_format (structured output), are not knobs: they
    have no bounds table."""
    assert [f.name for f in dataclasses.fields(SamplingParams)] == [*KNOBS, "stop_token_ids", "response_format"]
    assert list(KNOBS) == [
        "max_new_tokens",
        "max_denoising_steps",
        "t_min",
        "t_max",
        "entropy_bound",
        "stability_threshold",
        "confidence_threshold",
        "seed",
        "ignore_eos",
        "stop",
        "min_tokens",
        "skip_special_tokens",
    ]
    assert SCALAR_KNOBS == tuple(k for k in KNOBS if k != "stop")
    assert SamplingParams() == SamplingParams(256, 48, 0.4, 0.8, 0.1, 1, 0.005, None, False, ())
    doc = SamplingParams.__doc__ or ""
    assert all(f"    {n}: {k.doc}. Accepts: " in doc for n, k in KNOBS.items())  # the docstring lists the table


def test_every_integer_knob_has_an_upper_bound():
    """A server must bound what a request can make it do: every integer knob has a finite maximum."""
    for name, k in KNOBS.items():
        if k.kind is int:
            assert k.lo is not None and k.hi is not None, name
    assert KNOBS["stop"].max_items == 16 and KNOBS["stop"].max_chars == 256


def _edges(k: Knob) -> tuple[list, list]:
    """(accepted, rejected) values at the knob's bounds."""
    step = 1 if k.kind is int else 1e-6
    ok, bad = [], []
    for bound, is_open, sign in ((k.lo, k.lo_open, -1), (k.hi, k.hi_open, +1)):
        if bound is None:
            continue
        inside = bound - sign * step if is_open else bound
        ok.append(k.kind(inside))
        bad.append(k.kind(bound if is_open else bound + sign * step))
    return ok, bad


@pytest.mark.parametrize("name", [n for n, k in KNOBS.items() if k.numeric])
def test_numeric_knobs_at_their_bounds(name):
    k = KNOBS[name]
    ok, bad = _edges(k)
    base = dict(t_min=0.0, t_max=1e9) if name in ("t_min", "t_max") else {}  # keep t_min < t_max true
    if name == "min_tokens":  # keep min_tokens <= max_new_tokens true
        base = dict(max_new_tokens=KNOBS["max_new_tokens"].hi)
    for v in ok:
        assert getattr(SamplingParams(**{**base, name: v}), name) == v
    for v in bad:
        with pytest.raises(KnobError, match=rf"^{name} must be {re.escape(k.range_text())}, got ") as e:
            SamplingParams(**{**base, name: v})
        assert e.value.field == name and isinstance(e.value, ValueError)


@pytest.mark.parametrize("name", [n for n, k in KNOBS.items() if k.numeric])
@pytest.mark.parametrize("value", [True, "1", None, [1]])
def test_numeric_knobs_reject_other_types(name, value):
    if value is None and KNOBS[name].nullable:
        assert getattr(SamplingParams(**{name: None}), name) is None
        return
    with pytest.raises(KnobError, match=rf"^{name} must be an? "):
        SamplingParams(**{name: value})


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_float_knobs_must_be_finite(value):
    for name, k in KNOBS.items():
        if k.kind is float:
            with pytest.raises(KnobError, match=rf"^{name} must be a finite number"):
                SamplingParams(**{name: value})


def test_floats_are_stored_as_float_and_stop_as_a_tuple():
    p = SamplingParams(t_min=0, t_max=1, entropy_bound=1, confidence_threshold=2, stop="end")
    assert all(type(getattr(p, n)) is float for n in ("t_min", "t_max", "entropy_bound", "confidence_threshold"))
    assert p.stop == ("end",) and SamplingParams(stop=["a", "b"]).stop == ("a", "b")


def test_cross_field_rule_and_replace_revalidate():
    with pytest.raises(KnobError, match=r"^t_max must be > t_min \(0\.8\), got 0\.8"):
        SamplingParams(t_min=0.8, t_max=0.8)
    with pytest.raises(ValueError, match=r"^max_new_tokens"):
        dataclasses.replace(SamplingParams(), max_new_tokens=0)


@pytest.mark.parametrize(
    "stop, match",
    [
        (("a",) * 17, r"^stop has 17 strings; at most 16"),
        (("",), r"^stop\[0\] must be a non-empty string"),
        (("a", 5), r"^stop\[1\] must be a non-empty string"),
        (("x" * 257,), r"^stop\[0\] is 257 characters; at most 256"),
        (5, r"^stop must be a string or a sequence of strings"),
    ],
)
def test_stop_limits(stop, match):
    with pytest.raises(KnobError, match=match):
        SamplingParams(stop=stop)


def test_a_field_without_knob_metadata_is_not_a_knob():
    """response_format (structured output) has no `knob` metadata: it is left to its own checks, and the knob
    machinery neither validates nor lists it."""
    from dgserve.structured import ResponseFormat

    fmt = ResponseFormat(type="json_object")
    p = SamplingParams(response_format=fmt, max_new_tokens=3)
    assert p.response_format is fmt and p.max_new_tokens == 3
    assert "response_format" not in KNOBS
    with pytest.raises(KnobError, match=r"^max_new_tokens"):
        SamplingParams(response_format=fmt, max_new_tokens=0)
    with pytest.raises(ValueError, match=r"^response_format"):
        SamplingParams(response_format={"type": "json_object"})  # type: ignore[arg-type]


def test_min_tokens_at_most_max_new_tokens_and_output_fields_not_with_a_grammar():
    from dgserve.structured import ResponseFormat

    assert SamplingParams(max_new_tokens=8, min_tokens=8).min_tokens == 8
    with pytest.raises(KnobError, match=r"^min_tokens must be <= max_new_tokens \(8\), got 9"):
        SamplingParams(max_new_tokens=8, min_tokens=9)
    fmt = ResponseFormat("json_object")
    for kw in ({"min_tokens": 1}, {"stop_token_ids": (3,)}):
        with pytest.raises(ValueError, match=rf"^{next(iter(kw))}: cannot be combined with response_format"):
            SamplingParams(response_format=fmt, **kw)
    assert SamplingParams(stop_token_ids=[4, 5]).stop_token_ids == (4, 5)
    for bad in ((True,), ("1",), (-1,)):
        with pytest.raises(KnobError, match=r"^stop_token_ids\[0\] must be a non-negative integer"):
            SamplingParams(stop_token_ids=bad)
