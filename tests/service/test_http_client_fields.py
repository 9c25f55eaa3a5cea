"""What OpenAI and vLLM clients send and call, on a real server: ``temperature`` (1 = the model's schedule, 0 =
deterministic at the default quality, others scale the schedule, explicit t_min/t_max win), ``GET
/v1/models/{id}``, ``GET /health``, ``GET /version``, ``POST /tokenize`` and ``/detokenize``."""

from __future__ import annotations

import httpx
import openai
import pytest
from service_helpers import base_config, running

import dgserve
from dgserve.engine.prompt import ChatPrompt
from dgserve.v1 import text_generation_pb2 as pb

KNOBS = {"max_denoising_steps": 4}


def _text(client, **kw) -> tuple[str, int]:
    extra = {**KNOBS, **kw.pop("extra_body", {})}
    r = client.completions.create(model="tiny", prompt="the quick", max_tokens=32, extra_body=extra, **kw)
    return r.choices[0].text, r.model_extra["dgserve"]["seed"]


# ---------------------------------------------------------------------------------------------- temperature


def test_temperature_one_is_the_models_schedule(openai_client):
    assert _text(openai_client, seed=5, temperature=1) == _text(openai_client, seed=5)
    assert _text(openai_client, seed=5, temperature=1.0) == _text(openai_client, seed=5)


def test_temperature_zero_is_deterministic_with_the_default_schedule(openai_client):
    first, seed = _text(openai_client, temperature=0)
    assert seed == 0  # no seed given: seed 0, the model's own schedule
    assert _text(openai_client, temperature=0) == (first, 0)
    assert _text(openai_client, seed=0) == (first, 0)  # exactly the default sampler: no quality traded for determinism
    assert _text(openai_client, temperature=0, seed=9) == _text(openai_client, seed=9)  # a given seed is kept


def test_other_temperatures_scale_the_schedule_and_explicit_knobs_win(openai_client, local_engine):
    d = local_engine.default_params()
    scaled = _text(openai_client, seed=3, extra_body={"t_min": d.t_min * 0.5, "t_max": d.t_max * 0.5})
    assert _text(openai_client, seed=3, temperature=0.5) == scaled
    explicit = _text(openai_client, seed=3, extra_body={"t_min": 0.3, "t_max": 0.9})
    assert _text(openai_client, seed=3, temperature=0.5, extra_body={"t_min": 0.3, "t_max": 0.9}) == explicit
    chat = openai_client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=16, temperature=0, extra_body=KNOBS
    )
    assert chat.model_extra["dgserve"]["seed"] == 0


@pytest.mark.parametrize("value", [-0.1, 2.5, "hot", True])
def test_bad_temperature_is_400_naming_it(url, value):
    r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 8, "temperature": value}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text


# ---------------------------------------------------------------------------------------------- routes


def test_model_by_id(openai_client, url):
    m = openai_client.models.retrieve("tiny-alias")
    assert m.id == "tiny-alias" and m.object == "model"
    with pytest.raises(openai.NotFoundError):
        openai_client.models.retrieve("gpt-4")
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
    from dgserve.service.http.openai import input as protocol

    d = SamplingParams()
    fmt = {"response_format": {"type": "json_object"}}
    assert protocol.completion_request({"prompt": "x", **fmt}, d, 300).fill_context
    assert not protocol.completion_request({"prompt": "x", "max_tokens": 9, **fmt}, d, 300).fill_context
    assert protocol.completion_request({"prompt": "x"}, d, 300).fill_context  # no limit: the server's default
    chat = {"messages": [{"role": "user", "content": "x"}], **fmt}
    assert protocol.chat_request(chat, d).fill_context
    assert not protocol.chat_request({**chat, "max_completion_tokens": 9}, d).fill_context


# ---------------------------------------------------------------------------------------------- vLLM's fields


def _post(url, route: str, body: dict) -> httpx.Response:
    return httpx.post(url + route, json=body, timeout=60)


def _complete(url, **body) -> dict:
    r = _post(url, "/v1/completions", {"prompt": "the quick", "max_tokens": 32, "seed": 5, **KNOBS, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_stop_token_ids_end_like_eos_with_finish_reason_stop(url, local_engine):
    p = local_engine.default_params(max_new_tokens=32, seed=5, ignore_eos=True, **KNOBS)
    free = local_engine.generate("the quick", p)
    tok = free.token_ids[6]
    first = free.token_ids.index(tok)
    got = _complete(url, ignore_eos=True, stop_token_ids=[tok])
    assert got["choices"][0]["finish_reason"] == "stop"
    assert got["choices"][0]["text"] == local_engine.tokenizer.decode(free.token_ids[:first])
    assert got["usage"]["completion_tokens"] == first + 1  # the stop token is counted, never shown


def test_min_tokens_holds_off_eos(url, local_engine):
    for seed in range(40):
        free = local_engine.generate("the quick", local_engine.default_params(max_new_tokens=64, seed=seed, **KNOBS))
        if free.finish_reason == "eos" and len(free.token_ids) < 40:
            break
    else:
        pytest.fail("no seed ended with EOS within 40 tokens")
    n = len(free.token_ids) + 10
    got = _complete(url, seed=seed, max_tokens=64, min_tokens=n)
    assert got["usage"]["completion_tokens"] >= n


@pytest.mark.parametrize(
    "field, value, check",
    [
        ("guided_choice", ["yes", "no"], lambda t: t in ("yes", "no")),
        ("guided_regex", "[a-c]{3}", lambda t: len(t) == 3 and set(t) <= set("abc")),
        ("guided_json", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, None),
        ("guided_json", '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}', None),
        ("structured_outputs", {"choice": ["red", "green"]}, lambda t: t in ("red", "green")),
        ("structured_outputs", {"regex": "x[0-9]"}, lambda t: len(t) == 2 and t[0] == "x" and t[1].isdigit()),
        ("structured_outputs", {"json": {"type": "object", "properties": {"a": {"type": "integer"}}}}, None),
        ("structured_outputs", {"json_object": True}, None),
    ],
)
def test_vllm_output_constraints_are_a_response_format(url, field, value, check):
    import json

    # a seed and a limit: the field's mapping is the subject here (the grammar closes the JSON within 64 tokens)
    body = {"messages": [{"role": "user", "content": "pick"}], field: value, "seed": 3, "max_tokens": 64, **KNOBS}
    r = _post(url, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["message"]["content"]
    if check is None:
        assert isinstance(json.loads(text), dict)
    else:
        assert check(text), text


@pytest.mark.parametrize(
    "body, param",
    [
        ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice"),
        ({"response_format": {"type": "json_object"}, "guided_json": {}}, "guided_json"),
        ({"structured_outputs": {"grammar": "root ::= 'a'"}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs"),
        ({"structured_outputs": {"choice": "a"}}, "structured_outputs.choice"),
        ({"structured_outputs": {"frobnicate": 1}}, "structured_outputs.frobnicate"),
        ({"guided_grammar": "root ::= 'a'"}, "guided_grammar"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_regex": 3}, "guided_regex"),
        ({"guided_choice": ["a"], "stop_token_ids": [5]}, "stop_token_ids"),
        ({"min_tokens": 3, "guided_regex": "a+"}, "min_tokens"),
        ({"stop_token_ids": "5"}, "stop_token_ids"),
        ({"stop_token_ids": [10**7]}, "stop_token_ids[0]"),
        ({"min_tokens": 33}, "min_tokens"),
        ({"skip_special_tokens": "no"}, "skip_special_tokens"),
        ({"spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
    ],
)
def test_bad_vllm_fields_are_400_naming_them(url, body, param):
    r = _post(url, "/v1/completions", {"prompt": "x", "max_tokens": 32, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize(
    "field, value, reason",
    [
        ("top_k", 40, "top-k"),
        ("min_p", 0.1, "min-p"),
        ("repetition_penalty", 1.2, "penalise"),
        ("presence_penalty", 0.5, "penalise"),
        ("frequency_penalty", 0.5, "penalise"),
        ("logprobs", True, "log-probabilities"),
        ("top_logprobs", 3, "log-probabilities"),
        ("use_beam_search", True, "beam search"),
        ("service_tier", "flex", "one service tier"),
    ],
)
def test_what_a_diffusion_sampler_cannot_do_is_400_with_the_reason(url, field, value, reason):
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 8, field: value}
    r = _post(url, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and reason in error["message"], error


def test_neutral_fields_are_accepted_and_change_nothing(url):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "seed": 3, **KNOBS}
    plain = _post(url, "/v1/chat/completions", chat).json()["choices"][0]["message"]["content"]
    neutral = {
        "metadata": {"run": "a"},
        "store": True,
        "prompt_cache_key": "k",
        "safety_identifier": "u1",
        "service_tier": "auto",
        "user": "me",
        "top_k": -1,
        "min_p": 0,
        "repetition_penalty": 1,
        "spaces_between_special_tokens": True,
        "skip_special_tokens": True,
    }
    r = _post(url, "/v1/chat/completions", {**chat, **neutral})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == plain, r.text
    assert _post(url, "/v1/chat/completions", {**chat, "service_tier": "default"}).status_code == 200
    for bad, param in (({"metadata": {"a": 1}}, "metadata"), ({"store": "yes"}, "store"), ({"user": 3}, "user")):
        r = _post(url, "/v1/chat/completions", {**chat, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def _prompt_tokens(url, body: dict) -> int:
    r = _post(url, "/v1/chat/completions", {"max_tokens": 8, **KNOBS, **body})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


def test_add_generation_prompt_and_continue_final_message_render_as_asked(url, local_engine):
    user = {"role": "user", "content": "hi"}
    partial = {"role": "assistant", "content": "The quick brown"}
    ids = local_engine.prompt_ids(ChatPrompt((user, partial), False, continue_final_message=True))
    assert local_engine.tokenizer.decode(ids, skip_special_tokens=False).endswith("The quick brown")
    assert _prompt_tokens(url, {"messages": [user, partial], "continue_final_message": True}) == len(ids)
    no_prompt = local_engine.prompt_ids(ChatPrompt((user,), False))
    assert _prompt_tokens(url, {"messages": [user], "add_generation_prompt": False}) == len(no_prompt)
    assert len(no_prompt) < len(local_engine.prompt_ids(ChatPrompt((user,))))
    for body, param in (
        ({"messages": [user, partial], "continue_final_message": True, "add_generation_prompt": True}, None),
        ({"messages": [user], "continue_final_message": True}, None),
        ({"messages": [user], "add_generation_prompt": "yes"}, "add_generation_prompt"),
    ):
        r = _post(url, "/v1/chat/completions", {"max_tokens": 8, **body})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == (param or "continue_final_message"), r.text


TEMPLATE = (
    "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}>{% endif %}"
)


def test_chat_template_is_refused_unless_the_operator_trusts_requests(url):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "chat_template": TEMPLATE}
    r = _post(url, "/v1/chat/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
    assert "--trust-request-chat-template" in r.json()["error"]["message"]


@pytest.fixture(scope="module")
def trusting_url(model_dir):
    """A server of its own that trusts a request's chat_template (--trust-request-chat-template)."""
    with running(base_config(model_dir, trust_request_chat_template=True)) as s:
        yield s.http_url


def test_a_trusted_request_chat_template_renders_the_chat(trusting_url, local_engine):
    messages = [{"role": "user", "content": "hi"}]
    want = len(local_engine.tokenizer.encode("[user] hi\n>"))
    assert _prompt_tokens(trusting_url, {"messages": messages, "chat_template": TEMPLATE}) == want
    bad = _post(trusting_url, "/v1/chat/completions", {"messages": messages, "chat_template": "{% for %}"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template", bad.text


def test_the_trust_flag_and_its_environment_fallback():
    from dgserve.service.__main__ import build_config

    assert not build_config([], {})[0].trust_request_chat_template
    assert build_config(["--trust-request-chat-template"], {})[0].trust_request_chat_template
    assert build_config([], {"DGSERVE_TRUST_REQUEST_CHAT_TEMPLATE": "1"})[0].trust_request_chat_template


def test_grpc_takes_stop_token_ids_and_min_tokens(stub, local_engine):
    p = local_engine.default_params(max_new_tokens=32, seed=5, ignore_eos=True, **KNOBS)
    free = local_engine.generate("the quick", p)
    tok = free.token_ids[6]
    params = pb.SamplingParams(max_new_tokens=32, seed=5, ignore_eos=True, stop_token_ids=[tok], **KNOBS)
    out = list(stub.Generate(pb.GenerateRequest(prompt="the quick", params=params), timeout=60))
    fin = out[-1].finished
    assert fin.finish_reason == pb.FINISH_REASON_STOP
    assert fin.usage.completion_tokens == free.token_ids.index(tok) + 1
    started = out[0].started.params
    assert list(started.stop_token_ids) == [tok] and started.min_tokens == 0 and started.skip_special_tokens
    params = pb.SamplingParams(max_new_tokens=32, seed=5, min_tokens=20, **KNOBS)
    fin = list(stub.Generate(pb.GenerateRequest(prompt="the quick", params=params), timeout=60))[-1].finished
    assert fin.usage.completion_tokens >= 20


# ---------------------------------------------------------------------------------------------- n > 1


def test_n_choices_are_n_seeds_derived_from_the_request_seed(url, openai_client):
    from dgserve.sampling_params import choice_seed

    body = {"prompt": "the quick", "max_tokens": 24, "seed": 5, "ignore_eos": True, **KNOBS}
    many = _post(url, "/v1/completions", {**body, "n": 3}).json()
    assert [c["index"] for c in many["choices"]] == [0, 1, 2]
    alone = [_post(url, "/v1/completions", {**body, "seed": choice_seed(5, i)}).json() for i in range(3)]
    assert choice_seed(5, 0) == 5  # choice 0 is the n = 1 output
    assert [c["text"] for c in many["choices"]] == [a["choices"][0]["text"] for a in alone]
    assert len({c["text"] for c in many["choices"]}) == 3
    usage = many["usage"]
    assert usage["prompt_tokens"] == alone[0]["usage"]["prompt_tokens"]  # the prompt once, as OpenAI counts it
    assert usage["completion_tokens"] == sum(a["usage"]["completion_tokens"] for a in alone) == 72
    ext = many["dgserve"]
    assert ext["seed"] == 5 and [c["seed"] for c in ext["choices"]] == [choice_seed(5, i) for i in range(3)]
    chat = openai_client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=16, seed=2, extra_body=KNOBS
    )
    assert [c.index for c in chat.choices] == [0, 1] and all(c.message.role == "assistant" for c in chat.choices)


def test_n_without_a_seed_draws_one_and_reports_it(url):
    from dgserve.sampling_params import choice_seed

    r = _post(url, "/v1/completions", {"prompt": "x", "max_tokens": 8, "n": 2, **KNOBS}).json()
    seed = r["dgserve"]["seed"]
    assert [c["seed"] for c in r["dgserve"]["choices"]] == [seed, choice_seed(seed, 1)]


def test_n_streams_each_choice_with_its_index(url):
    import json

    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 24, "seed": 4, **KNOBS}
    whole = _post(url, "/v1/chat/completions", {**body, "n": 3}).json()
    stream = {**body, "n": 3, "stream": True, "stream_options": {"include_usage": True}}
    text, finish, roles, usage, ids = {0: "", 1: "", 2: ""}, {}, [], None, set()
    with httpx.stream("POST", url + "/v1/chat/completions", json=stream, timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            ids.add(chunk["id"])
            if not chunk["choices"]:
                usage = chunk["usage"]
                continue
            (c,) = chunk["choices"]
            if c["delta"].get("role"):
                roles.append(c["index"])
            text[c["index"]] += c["delta"].get("content") or ""
            if c["finish_reason"]:
                finish[c["index"]] = c["finish_reason"]
    assert roles == [0, 1, 2] and set(finish) == {0, 1, 2} and len(ids) == 1  # one response id
    assert [text[i] for i in range(3)] == [c["message"]["content"] for c in whole["choices"]]
    assert usage == whole["usage"]


@pytest.mark.parametrize("n", [0, 17, "two", True, 2.5])
def test_bad_n_is_400_naming_it(url, n):
    r = _post(url, "/v1/completions", {"prompt": "x", "max_tokens": 8, "n": n})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    r = _post(url, "/v1/completions", {"prompt": "x", "max_tokens": 8, "n": 2, "stream": True, "drafts": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text


@pytest.mark.parametrize(
    "route, body",
    [
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/completions", {"prompt": "x", "stream": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True}),
    ],
)
def test_n_above_what_the_server_ever_holds_is_400_not_a_429_to_retry_forever(server, url, route, body):
    # the shared server runs 4 requests and queues 4: 9 choices could never be admitted, even idle
    eng = server.engine
    assert (eng.max_num_seqs, eng.max_queue_len) == (4, 4)
    r = _post(url, route, {**body, "max_tokens": 8, "n": 9, **KNOBS})
    assert r.status_code == 400 and "Retry-After" not in r.headers, r.text
    err = r.json()["error"]
    assert err["param"] == "n" and err["type"] == "invalid_request_error"
    assert "n: 9 choices can never be admitted" in err["message"]
    assert "at most 4 requests and queues 4 (--max-num-seqs + --max-queue-len)" in err["message"]


def test_the_admission_bound_on_n_reads_the_engines_limits():
    from types import SimpleNamespace

    from dgserve.service.http.choices import check_admissible

    check_admissible(SimpleNamespace(max_num_seqs=32, max_queue_len=256), 288)  # runs 32, queues 256: fits
    with pytest.raises(ValueError, match=r"^n: 300 choices can never be admitted: .* at most 32 requests and queues"):
        check_admissible(SimpleNamespace(max_num_seqs=32, max_queue_len=256), 300)
    check_admissible(SimpleNamespace(max_num_seqs=1, max_queue_len=None), 16)  # an unbounded queue takes any n


def _client_cancels(server) -> float:
    return server.server.metrics.value("dgserve_request_aborted_total", {"reason": "client_cancelled"})


def test_a_client_going_away_cancels_every_choice(server, url):
    from service_helpers import post_then_hang_up, wait_until

    eng = server.engine
    # the shared server: earlier tests' cancelled streams may still be leaving it (they would take the queue places
    # the three choices need)
    wait_until(lambda: eng.num_running == 0 and eng.num_waiting == 0, timeout=30)
    cancels = _client_cancels(server)
    body = {"prompt": "long", "stream": True, "max_tokens": 16 * 200, "ignore_eos": True, "n": 3, **KNOBS}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", url + "/v1/completions", json=body) as r:
            first = next(line for line in r.iter_lines() if line.startswith("data: "))
            assert eng.num_running + eng.num_waiting == 3, first
    # every choice is cancelled (three aborts counted: each counted once the engine dropped it, so all are gone
    # then), however long that takes on a loaded machine
    wait_until(lambda: _client_cancels(server) == cancels + 3)
    assert eng.num_running == 0 and eng.num_waiting == 0
    in_flight = lambda: eng.num_running + eng.num_waiting == 3  # noqa: E731
    post_then_hang_up(url, "/v1/completions", {**body, "stream": False}, in_flight)
    wait_until(lambda: _client_cancels(server) == cancels + 6)
    assert eng.num_running == 0 and eng.num_waiting == 0


def test_the_responses_api_takes_the_neutral_fields_codex_sends(url):
    body = {"input": "hi", "max_output_tokens": 16, "seed": 1, "store": False, **KNOBS}
    plain = _post(url, "/v1/responses", body).json()["output"][0]["content"]
    neutral = {"prompt_cache_key": "s1", "client_metadata": {"session_id": "s1"}, "service_tier": "auto"}
    r = _post(url, "/v1/responses", {**body, **neutral})
    assert r.status_code == 200 and r.json()["output"][0]["content"] == plain, r.text
    r = _post(url, "/v1/responses", {**body, "service_tier": "flex"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "service_tier", r.text
