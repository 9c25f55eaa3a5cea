"""Per-request soft tokens per image (docs/images.md, "Per request"): ``mm_processor_kwargs.max_soft_tokens`` on the
JSON doors and ``Chat.max_soft_tokens`` on gRPC change the image's placeholders (usage, /tokenize, count_tokens);
a value the checkpoint's processor does not allow is a 400 / INVALID_ARGUMENT naming the field and the values."""

from __future__ import annotations

import base64
import io

import grpc
import httpx
import numpy as np
import pytest
from service_helpers import base_config, running
from tiny_models import make_processor_checkpoint

from dgserve.media.images import soft_tokens
from dgserve.v1 import text_generation_pb2 as pb
from dgserve.v1 import text_generation_pb2_grpc as pb_grpc


def _png(w: int, h: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


IMG = _png(90, 61)
URL = f"data:image/png;base64,{base64.b64encode(IMG).decode()}"
# the checkpoint's processor: 8-pixel patches pooled 2x2, 140 soft tokens at most (tests/tiny_models.py)
TOKENS = {n: soft_tokens(90, 61, 8, 2, n) for n in (70, 140)}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("dg-odd-processor-server")
    make_processor_checkpoint(path)
    with running(base_config(path)) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.http_url, timeout=60) as c:
        yield c


def _chat(**kw) -> dict:
    content = [{"type": "text", "text": "what is"}, {"type": "image_url", "image_url": {"url": URL}}]
    return {"messages": [{"role": "user", "content": content}], **kw}


def test_max_soft_tokens_per_request_changes_the_prompt_on_every_door(server, http):
    assert TOKENS[70] < TOKENS[140]
    usage = {}
    for n in (None, 70, 140):
        kw = {} if n is None else {"mm_processor_kwargs": {"max_soft_tokens": n}}
        r = http.post("/v1/chat/completions", json=_chat(max_tokens=4, seed=1, **kw))
        assert r.status_code == 200, r.text
        usage[n] = r.json()["usage"]["prompt_tokens"]
        tok = http.post("/tokenize", json=_chat(**kw))
        assert tok.status_code == 200 and tok.json()["count"] == usage[n], tok.text
    assert usage[None] == usage[140] and usage[140] - usage[70] == TOKENS[140] - TOKENS[70]

    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(IMG).decode()}
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is"}, {"type": "image", "source": source}]}]
    counts = [
        http.post("/v1/messages/count_tokens", json={"model": "tiny", "messages": messages, **kw}).json()
        for kw in ({}, {"mm_processor_kwargs": {"max_soft_tokens": 70}})
    ]
    assert counts[0]["input_tokens"] - counts[1]["input_tokens"] == TOKENS[140] - TOKENS[70], counts
    made = http.post(
        "/v1/messages",
        json={"max_tokens": 4, "messages": messages, "mm_processor_kwargs": {"max_soft_tokens": 70}},
    )
    assert made.status_code == 200 and made.json()["usage"]["input_tokens"] == counts[1]["input_tokens"], made.text
    parts = [{"type": "input_text", "text": "what is"}, {"type": "input_image", "image_url": URL}]
    resp = http.post(
        "/v1/responses",
        json={
            "input": [{"role": "user", "content": parts}],
            "max_output_tokens": 4,
            "mm_processor_kwargs": {"max_soft_tokens": 70},
        },
    )
    assert resp.status_code == 200, resp.text

    with grpc.insecure_channel(server.target) as ch:
        stub = pb_grpc.TextGenerationStub(ch)
        msg = pb.ChatMessage(
            role="user", parts=[pb.ContentPart(text="what is"), pb.ContentPart(image=pb.Media(data=IMG))]
        )
        ids = {
            n: len(stub.Tokenize(pb.TokenizeRequest(chat=pb.Chat(messages=[msg], max_soft_tokens=n))).token_ids)
            for n in (70, 140)
        }
        assert ids[140] - ids[70] == TOKENS[140] - TOKENS[70]
        with pytest.raises(grpc.RpcError) as e:
            stub.Tokenize(pb.TokenizeRequest(chat=pb.Chat(messages=[msg], max_soft_tokens=280)))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "chat.max_soft_tokens" in e.value.details()


@pytest.mark.parametrize(
    "path, kwargs, param",
    [
        ("/v1/chat/completions", {"max_soft_tokens": 280}, "mm_processor_kwargs.max_soft_tokens"),  # over the model's
        ("/v1/chat/completions", {"max_soft_tokens": 100}, "mm_processor_kwargs.max_soft_tokens"),  # not supported
        ("/v1/chat/completions", {"max_soft_tokens": "70"}, "mm_processor_kwargs.max_soft_tokens"),
        ("/v1/chat/completions", {"do_resize": False}, "mm_processor_kwargs.do_resize"),
        ("/v1/chat/completions", [70], "mm_processor_kwargs"),
        ("/tokenize", {"max_soft_tokens": 560}, "mm_processor_kwargs.max_soft_tokens"),
    ],
)
def test_a_value_the_model_does_not_allow_is_a_400_naming_the_field(http, path, kwargs, param):
    r = http.post(
        path,
        json=_chat(max_tokens=4, mm_processor_kwargs=kwargs) if "chat" in path else _chat(mm_processor_kwargs=kwargs),
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    if param.endswith("max_soft_tokens"):
        assert "one of 70, 140" in r.json()["error"]["message"]
