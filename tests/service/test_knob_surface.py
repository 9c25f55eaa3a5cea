"""The service's knob surface derives from SamplingParams' one table (dgserve.sampling_params.KNOBS): the proto
carries every scalar knob under its name, GetModelInfo's bounds are the table's, the gRPC and HTTP conversions
list the same fields and leave validation to SamplingParams. No server: the conversions are called directly."""

from __future__ import annotations

import math

import pytest

from dgserve.sampling_params import KNOBS, SCALAR_KNOBS, SamplingParams
from dgserve.service.grpc import convert
from dgserve.service.http.openai import input as protocol
from dgserve.v1 import text_generation_pb2 as pb

_PROTO_KIND = {int: ("uint32", "uint64"), float: ("double",), bool: ("bool",)}


def test_proto_has_every_knob_under_its_name():
    fields = pb.SamplingParams.DESCRIPTOR.fields_by_name
    for name in SCALAR_KNOBS:
        f = fields[name]
        assert f.has_presence, f"{name}: must be `optional` (unset = the model's default)"
        assert f.type in {getattr(f, f"TYPE_{t.upper()}") for t in _PROTO_KIND[KNOBS[name].kind]}, name
    assert fields["stop"].is_repeated


def test_model_info_bounds_are_the_tables():
    d = SamplingParams(seed=None, t_min=0.3)
    got = {b.name: b for b in convert.bounds(d)}
    assert list(got) == [n for n, k in KNOBS.items() if k.numeric]
    for name, b in got.items():
        k = KNOBS[name]  # the bounds validation applies: the knob's own, narrowed to its dtype
        assert b.integer == (k.kind is int) and b.min_exclusive == k.bounds.lo_open and b.min == k.bounds.lo, name
        assert b.default_value == (getattr(d, name) or 0), name
        assert math.isfinite(b.max), name  # every knob's dtype bounds it
    for name in ("t_max", "entropy_bound", "confidence_threshold"):  # float32: (0, max] as [tiny, max]
        assert (got[name].min, got[name].min_exclusive) == (1.1754943508222875e-38, False), name
        assert (got[name].max, got[name].max_exclusive) == (3.4028234663852886e38, False), name
    assert (got["max_denoising_steps"].max, got["max_denoising_steps"].max_exclusive) == (1024, False)
    assert got["t_max"].note == "t_max > t_min" and got["t_min"].note == "t_min < t_max"
    # 2^64 - 1 is no double: reported exactly as 2^64, excluded
    assert (got["seed"].max, got["seed"].max_exclusive) == (2.0**64, True)


def test_grpc_params_round_trip_and_validation_by_the_table():
    p = SamplingParams(max_denoising_steps=5, t_min=0.1, seed=2**64 - 1, ignore_eos=True, stop=("a", "b"))
    msg = convert.params_message(p)
    assert all(msg.HasField(n) for n in SCALAR_KNOBS if getattr(p, n) is not None)
    assert convert.sampling_params(msg, SamplingParams()) == p
    assert convert.sampling_params(pb.SamplingParams(), p) == p  # unset: the defaults
    with pytest.raises(ValueError, match=r"^params\.max_denoising_steps must be in \[1, 1024\]"):
        convert.sampling_params(pb.SamplingParams(max_denoising_steps=1025), p)


def test_http_body_fields_are_the_scalar_knobs():
    assert set(protocol.KNOBS) == set(SCALAR_KNOBS) - {"max_new_tokens"}  # OpenAI's max_tokens
    body = {name: getattr(SamplingParams(t_min=0.2, seed=7), name) for name in protocol.KNOBS}
    got = protocol.sampling_params({**body, "max_tokens": 9}, SamplingParams())
    assert got == SamplingParams(t_min=0.2, seed=7, max_new_tokens=9)


@pytest.mark.parametrize(
    "body, message",
    [
        ({"seed": -1}, r"^seed must be in \[0, 18446744073709551615\], got -1"),
        ({"seed": True}, r"^seed must be an integer"),
        ({"max_completion_tokens": 0}, r"^max_completion_tokens must be in \[1, 1048576\]"),
        ({"entropy_bound": 0}, r"^entropy_bound must be > 0"),
    ],
)
def test_http_errors_name_the_body_field(body, message):
    limit = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    with pytest.raises(ValueError, match=message):
        protocol.sampling_params(body, SamplingParams(), limit)
