"""An integer beyond the double range in a float knob (a JSON number of 310 digits: valid JSON, and Python reads
it as an exact int) is a 400 naming the field on every JSON door, never a 500 with a logged traceback
(``math.isfinite`` raises OverflowError on such an int). gRPC's float knobs are proto floats and cannot hold one;
its integer knobs are checked by their range."""

from __future__ import annotations

import json

import grpc
import pytest
from service_helpers import bad_request_field

from dgserve.sampling_params import KNOBS
from dgserve.service.http.openai import input as protocol
from dgserve.v1 import text_generation_pb2 as pb

FLOAT_KNOBS = [n for n in protocol.KNOBS if KNOBS[n].kind is float] + ["temperature"]
HUGE = {"1e310": 10**310, "-1e310": -(10**310)}
DOORS = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
    "completions": ("/v1/completions", {"prompt": "hi", "max_tokens": 4}),
    "responses": ("/v1/responses", {"input": "hi", "max_output_tokens": 4, "store": False}),
    "messages": ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
}


def test_the_float_knobs_are_the_ones_we_think():
    assert {"t_min", "t_max", "entropy_bound", "confidence_threshold", "temperature"} <= set(FLOAT_KNOBS)


@pytest.mark.parametrize("door", list(DOORS))
@pytest.mark.parametrize("knob", FLOAT_KNOBS)
@pytest.mark.parametrize("value", list(HUGE))
def test_an_integer_beyond_a_double_is_a_400_naming_the_knob(http, no_traceback, door, knob, value):
    path, body = DOORS[door]
    data = json.dumps({**body, knob: HUGE[value]})
    r = http.post(path, content=data, headers={"content-type": "application/json"})
    assert r.status_code == 400, (r.status_code, r.text)
    if door == "messages":
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        message = err["error"]["message"]
    else:
        err = r.json()["error"]
        assert err["param"] == knob and err["code"] == "invalid_argument"
        message = err["message"]
    assert message.startswith(f"{knob} must be ") and "beyond the range of a double" in message
    assert len(message) < 200  # not its 310 digits


def test_grpc_integer_knobs_beyond_their_range_are_invalid_argument(stub):
    """The proto's integer knobs are 64 bits at most: a value beyond a knob's range is INVALID_ARGUMENT naming it."""
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb.GenerateRequest(prompt="hi", params=pb.SamplingParams(max_new_tokens=2**31 - 1))))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_field(e.value).endswith("max_new_tokens")
