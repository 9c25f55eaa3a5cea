"""Bad input → status codes, with messages naming the field and the bound, and google.rpc details; the server
keeps serving."""

from __future__ import annotations

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status
from service_helpers import params, wait_until

from dgserve.v1 import text_generation_pb2 as pb


def error_of(stub, request, **kw) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(request, **kw))
    return e.value


def bad_request_field(err) -> str:
    status = rpc_status.from_call(err)
    for d in status.details:
        if d.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            br = error_details_pb2.BadRequest()
            d.Unpack(br)
            return br.field_violations[0].field
    raise AssertionError("no BadRequest detail")


@pytest.mark.parametrize(
    "request_kw, field",
    [
        (dict(prompt=""), "prompt"),
        (dict(), "input"),
        (dict(token_ids=pb.TokenIds()), "token_ids.ids"),
        (dict(chat=pb.Chat()), "chat.messages"),
    ],
)
def test_empty_input_is_invalid_argument(stub, server, request_kw, field):
    """INVALID_ARGUMENT + BadRequest naming the input; no model work; failure counted."""
    m = server.server.metrics
    before = m.value("dgserve_rpc_total", {"method": "Generate", "code": "INVALID_ARGUMENT"})
    err = error_of(stub, pb.GenerateRequest(params=params(), **request_kw))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith(field)
    assert bad_request_field(err) == field
    # the call's outcome is counted in the handler's cleanup, which may finish just after the client returns
    wait_until(lambda: m.value("dgserve_rpc_total", {"method": "Generate", "code": "INVALID_ARGUMENT"}) == before + 1)


@pytest.mark.parametrize(
    "knobs, field, bound",
    [
        (dict(max_new_tokens=0), "params.max_new_tokens", "[1, 1048576]"),
        (dict(max_new_tokens=2**31), "params.max_new_tokens", "[1, 1048576]"),
        (dict(max_denoising_steps=0), "params.max_denoising_steps", "[1, 1024]"),
        (dict(max_denoising_steps=5000), "params.max_denoising_steps", "[1, 1024]"),
        (dict(t_min=0.9, t_max=0.5), "params.t_max", "> t_min"),
        (dict(t_min=-1.0), "params.t_min", ">= 0"),
        (dict(t_max=float("nan")), "params.t_max", "finite"),
        (dict(entropy_bound=0.0), "params.entropy_bound", "> 0"),
        (dict(entropy_bound=-3.0), "params.entropy_bound", "> 0"),
        (dict(confidence_threshold=0.0), "params.confidence_threshold", "> 0"),
        (dict(stability_threshold=2000), "params.stability_threshold", "[0, 1024]"),
        (dict(stop=["s"] * 17), "params.stop", "at most 16"),
        (dict(stop=["x" * 300]), "params.stop[0]", "at most 256"),
        (dict(stop=[""]), "params.stop[0]", "non-empty"),
    ],
)
def test_out_of_range_knobs(stub, knobs, field, bound):
    """INVALID_ARGUMENT; the message names the field and the bound."""
    err = error_of(stub, pb.GenerateRequest(prompt="hi", params=params(**knobs)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith(field) and bound in err.details(), err.details()
    assert bad_request_field(err) == field


def test_prompt_beyond_context_window(stub):
    """A prompt that leaves no room for one canvas: INVALID_ARGUMENT with both numbers, before admission (an output
    limit above the room left is clamped to it: docs/generation.md, "Limits")."""
    err = error_of(stub, pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 4090), params=params(max_new_tokens=200)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "4090 tokens" in err.details() and "4096" in err.details() and "canvas" in err.details()


def test_token_id_outside_vocabulary(stub):
    err = error_of(stub, pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 300]), params=params()))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == "token_ids.ids[2]: token id 300 is outside the vocabulary [0, 300)"


def test_bad_chat_role_and_request_id(stub):
    chat = pb.Chat(messages=[pb.ChatMessage(role="robot", content="hi")])
    err = error_of(stub, pb.GenerateRequest(chat=chat, params=params()))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "role" in err.details()
    err = error_of(stub, pb.GenerateRequest(request_id="r" * 300, prompt="hi", params=params()))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("request_id")


def test_request_larger_than_max_message(stub):
    """RESOURCE_EXHAUSTED from the library (16 MiB limit); the server stays healthy."""
    err = error_of(stub, pb.GenerateRequest(prompt="x" * (17 << 20), params=params()))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in err.details()
    assert list(stub.Generate(pb.GenerateRequest(prompt="ok", params=params(max_new_tokens=1))))[-1].HasField(
        "finished"
    )


def test_unknown_model_is_not_found(stub):
    """An unknown model name: NOT_FOUND naming it and the served model."""
    err = error_of(stub, pb.GenerateRequest(model="gpt-5", prompt="hi", params=params()))
    assert err.code() == grpc.StatusCode.NOT_FOUND and "gpt-5" in err.details() and "tiny" in err.details()
    with pytest.raises(grpc.RpcError) as e:
        stub.Tokenize(pb.TokenizeRequest(model="nope", prompt="x"))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize(
    "request_kw, field",
    [
        (dict(prompt="hi", params=params(n=2)), "params.n"),
    ],
)
def test_unsupported_options_are_unimplemented(stub, request_kw, field):
    """n > 1: UNIMPLEMENTED naming the field."""
    err = error_of(stub, pb.GenerateRequest(**request_kw))
    assert err.code() == grpc.StatusCode.UNIMPLEMENTED and err.details().startswith(field)


@pytest.mark.parametrize(
    "request_kw, field",
    [
        (
            dict(
                chat=pb.Chat(
                    messages=[
                        pb.ChatMessage(
                            role="user",
                            parts=[
                                pb.ContentPart(text="look"),
                                pb.ContentPart(image=pb.Media(data=b"\x89PNG", mime_type="image/png")),
                            ],
                        )
                    ]
                ),
                params=params(),
            ),
            "chat.messages[0].parts[1]: this model cannot take images",
        ),
    ],
)
def test_images_on_a_model_without_them_are_invalid_argument(stub, request_kw, field):
    """The test model's image token ids lie outside its vocabulary (the tiny config's): an image part is
    INVALID_ARGUMENT naming the part and the reason (docs/images.md)."""
    err = error_of(stub, pb.GenerateRequest(**request_kw))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith(field)


def test_unknown_method_and_unknown_health_service(channel):
    """unknown method → UNIMPLEMENTED; health Check of an unknown service → NOT_FOUND."""
    call = channel.unary_unary("/dgserve.v1.TextGeneration/Nope")
    with pytest.raises(grpc.RpcError) as e:
        call(b"")
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    with pytest.raises(grpc.RpcError) as e:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="no.such.Service"))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_abort_unknown_id_is_not_found(stub):
    with pytest.raises(grpc.RpcError) as e:
        stub.Abort(pb.AbortRequest(request_id="never-seen"))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_every_reason_has_a_grpc_status_code():
    """service/errors.py names every exception's reason; service/grpc/errors.py gives each reason its code."""
    from dgserve.service import errors
    from dgserve.service.grpc.errors import CODES, classify

    assert {reason for _, reason in errors.REASONS} | {"INTERNAL"} == set(CODES)
    assert classify(errors.DrainingError("x")) == (grpc.StatusCode.UNAVAILABLE, "DRAINING")
    assert classify(KeyError("x")) == (grpc.StatusCode.INTERNAL, "INTERNAL")
