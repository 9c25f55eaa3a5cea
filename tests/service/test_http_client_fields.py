"""What OpenAI and vLLM clients send and call, on a real server: ``temperature`` (1 = the model's schedule, 0 =
deterministic at the default quality, others scale the schedule, explicit t_min/t_max win), ``GET
/v1/models/{id}``, ``GET /health``, ``GET /version``, ``POST /tokenize`` and ``/detokenize``."""

from __future__ import annotations

import httpx
import openai
import pytest

import dgserve
from dgserve.engine.prompt import ChatPrompt
from dgserve.v1 import text_generation_pb2 as pb

KNOBS = {"max_denoising_steps": 4}


@pytest.fixture(scope="module")
def url(server) -> str:
    return f"http://127.0.0.1:{server.server.http_port}"


@pytest.fixture(scope="module")
def client(url):
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    yield c
    c.close()


def _text(client, **kw) -> tuple[str, int]:
    extra = {**KNOBS, **kw.pop("extra_body", {})}
    r = client.completions.create(model="tiny", prompt="the quick", max_tokens=32, extra_body=extra, **kw)
    return r.choices[0].text, r.model_extra["dgserve"]["seed"]


# ---------------------------------------------------------------------------------------------- temperature


def test_temperature_one_is_the_models_schedule(client):
    assert _text(client, seed=5, temperature=1) == _text(client, seed=5)
    assert _text(client, seed=5, temperature=1.0) == _text(client, seed=5)


def test_temperature_zero_is_deterministic_with_the_default_schedule(client):
    first, seed = _text(client, temperature=0)
    assert seed == 0  # no seed given: seed 0, the model's own schedule
    assert _text(client, temperature=0) == (first, 0)
    assert _text(client, seed=0) == (first, 0)  # exactly the default sampler: no quality traded for determinism
    assert _text(client, temperature=0, seed=9) == _text(client, seed=9)  # a given seed is kept


def test_other_temperatures_scale_the_schedule_and_explicit_knobs_win(client, local_engine):
    d = local_engine.default_params()
    scaled = _text(client, seed=3, extra_body={"t_min": d.t_min * 0.5, "t_max": d.t_max * 0.5})
    assert _text(client, seed=3, temperature=0.5) == scaled
    explicit = _text(client, seed=3, extra_body={"t_min": 0.3, "t_max": 0.9})
    assert _text(client, seed=3, temperature=0.5, extra_body={"t_min": 0.3, "t_max": 0.9}) == explicit
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=16, temperature=0, extra_body=KNOBS
    )
    assert chat.model_extra["dgserve"]["seed"] == 0


@pytest.mark.parametrize("value", [-0.1, 2.5, "hot", True])
def test_bad_temperature_is_400_naming_it(url, value):
    r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 8, "temperature": value}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text


# ---------------------------------------------------------------------------------------------- routes


def test_model_by_id(client, url):
    m = client.models.retrieve("tiny-alias")
    assert m.id == "tiny-alias" and m.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    r = httpx.get(url + "/v1/models/gpt-4", timeout=10)
    assert r.status_code == 404 and "tiny" in r.json()["error"]["message"]


def test_health_and_version(url):
    r = httpx.get(url + "/health", timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "ready"
    assert httpx.get(url + "/version", timeout=10).json() == {"version": dgserve.__version__}


def test_tokenize_matches_what_generation_encodes(url, stub):
    want = list(stub.Tokenize(pb.TokenizeRequest(prompt="hello there"), timeout=30).token_ids)
    r = httpx.post(url + "/tokenize", json={"prompt": "hello there", "return_token_strs": True}, timeout=30).json()
    assert r["tokens"] == want and r["count"] == len(want) and r["max_model_len"] > 0
    assert len(r["token_strs"]) == len(want) and "".join(r["token_strs"]).endswith("there")
    bare = httpx.post(url + "/tokenize", json={"prompt": "hello there", "add_special_tokens": False}, timeout=30)
    assert len(bare.json()["tokens"]) < len(want)  # no BOS
    back = httpx.post(url + "/detokenize", json={"tokens": want, "model": "tiny"}, timeout=30).json()
    assert back["prompt"].endswith("hello there")


def test_tokenize_a_chat_as_chat_completions_renders_it(url, stub, local_engine):
    messages = [{"role": "user", "content": "hi"}]
    r = httpx.post(url + "/tokenize", json={"messages": messages}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == local_engine.prompt_ids(ChatPrompt(tuple(messages)))


@pytest.mark.parametrize(
    "route, body, param",
    [
        ("/tokenize", {"prompt": "x", "messages": []}, "prompt"),
        ("/tokenize", {"prompt": 3}, "prompt"),
        ("/tokenize", {"prompt": "x", "frobnicate": 1}, "frobnicate"),
        ("/tokenize", {"prompt": "x", "model": "gpt-4"}, None),  # 404 model_not_found, as for generation
        ("/detokenize", {"tokens": [10**9]}, "tokens[0]"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ],
)
def test_token_routes_name_the_bad_field(url, route, body, param):
    r = httpx.post(url + route, json=body, timeout=30)
    assert r.status_code == (404 if param is None else 400) and r.json()["error"]["param"] == param, r.text


# ---------------------------------------------------------------------------------------------- max_tokens omitted


def test_structured_request_without_max_tokens_fills_the_context():
    """No token limit + a response_format: the request may use the room left in its context (as vLLM does), so a
    grammar's document is not cut at the default max_new_tokens; with a limit, or free text, nothing changes."""
    from dgserve.sampling_params import SamplingParams
    from dgserve.service.http import protocol

    d = SamplingParams()
    fmt = {"response_format": {"type": "json_object"}}
    assert protocol.completion_request({"prompt": "x", **fmt}, d, 300).fill_context
    assert not protocol.completion_request({"prompt": "x", "max_tokens": 9, **fmt}, d, 300).fill_context
    assert not protocol.completion_request({"prompt": "x"}, d, 300).fill_context
    chat = {"messages": [{"role": "user", "content": "x"}], **fmt}
    assert protocol.chat_request(chat, d).fill_context
    assert not protocol.chat_request({**chat, "max_completion_tokens": 9}, d).fill_context
