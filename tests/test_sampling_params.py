"""SamplingParams: one table of knobs (field metadata) carries the types, bounds and validation; every knob is
checked at its bounds from that table, so a bound added or changed there is tested here without a second copy."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest

from dgserve.sampling_params import KNOBS, SCALAR_KNOBS, STORAGE, Knob, KnobError, SamplingParams


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


def test_the_storage_dtypes_are_torchs():
    """STORAGE restates torch.finfo / torch.iinfo (the module imports no torch): the same numbers."""
    import torch

    for name, st in STORAGE.items():
        if name == "uint64":
            assert (st.lo, st.hi) == (0, 2**64 - 1)
            continue
        dtype = getattr(torch, name)
        info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
        assert (st.lo, st.hi) == (info.min, info.max), name
        assert st.tiny == (info.tiny if dtype.is_floating_point else 0), name


def test_every_numeric_knob_names_the_dtype_that_holds_it():
    """Bounds come from the table and the dtype: every numeric knob names one, its accepted range lies inside
    it, and a float knob with an open or positive lower bound starts at the dtype's smallest normal."""
    for name, k in KNOBS.items():
        if not k.numeric:
            continue
        st, b = STORAGE[k.dtype], k.bounds
        assert b.lo is not None and b.hi is not None and st.lo <= b.lo and b.hi <= st.hi, name
        if k.kind is float and k.lo_open:
            assert (b.lo, b.lo_open) == (st.tiny, False), name
    assert KNOBS["entropy_bound"].bounds.hi == KNOBS["confidence_threshold"].bounds.hi == 3.4028234663852886e38


def test_knob_values_at_their_bounds_fit_their_tensors():
    """The largest and smallest accepted value of every numeric knob, written into a tensor of its dtype, stays
    finite and (for a positive knob) positive and normal: what validation passes, the engine can hold."""
    import torch

    for name, k in KNOBS.items():
        if not k.numeric or k.dtype == "uint64":  # the seed: bits in an int64 (to_signed64), tested there
            continue
        dtype = getattr(torch, k.dtype)
        for v in (k.bounds.lo, k.bounds.hi):
            t = torch.zeros(1, dtype=dtype)
            t[0] = v  # an overflow raises here, as it did inside the engine step
            assert math.isfinite(t.item()), name
            if k.kind is float and k.lo_open:
                assert t.item() >= torch.finfo(dtype).tiny, name


def _edges(k: Knob) -> tuple[list, list]:
    """(accepted, rejected) values at the knob's bounds (its own narrowed by its dtype: ``Knob.bounds``)."""
    b = k.bounds
    ok, bad = [], []
    for bound, is_open, sign in ((b.lo, b.lo_open, -1), (b.hi, b.hi_open, +1)):
        if bound is None:
            continue
        if k.kind is int:
            inside, outside = (bound - sign, bound) if is_open else (bound, bound + sign)
        else:  # the next double towards the inside / outside
            towards = math.inf * sign
            inside = math.nextafter(bound, -towards) if is_open else bound
            outside = bound if is_open else math.nextafter(bound, towards)
        ok.append(k.kind(inside))
        bad.append(k.kind(outside))
    return ok, bad


@pytest.mark.parametrize("name", [n for n, k in KNOBS.items() if k.numeric])
def test_numeric_knobs_at_their_bounds(name):
    k = KNOBS[name]
    ok, bad = _edges(k)
    base = dict(t_min=0.0, t_max=3e38) if name in ("t_min", "t_max") else {}  # keep t_min < t_max true
    if name == "min_tokens":  # keep min_tokens <= max_new_tokens true
        base = dict(max_new_tokens=KNOBS["max_new_tokens"].hi)
    for v in ok:
        if name == "t_min" and v == k.bounds.hi:
            base = dict(t_max=v)
            v = math.nextafter(v, 0)
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


@pytest.mark.parametrize("value", [10**310, -(10**310), 10**5000], ids=["1e310", "-1e310", "1e5000"])
def test_integers_beyond_the_double_range_are_a_value_error(value):
    """An integer no double holds (a JSON number of 310 digits) is a ValueError naming the knob, never the
    OverflowError ``math.isfinite`` raises on it, and the message does not print its digits."""
    from dgserve.sampling_params import with_temperature

    for name, k in KNOBS.items():
        if k.numeric:
            with pytest.raises(KnobError, match=rf"^{name} must be ") as e:
                SamplingParams(**{name: value})
            assert len(str(e.value)) < 200
    with pytest.raises(KnobError, match=r"^temperature must be a number in \[0, 2\], got an integer of \d+ bits"):
        with_temperature(SamplingParams(), value)


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
