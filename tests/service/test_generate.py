"""Generate over a real server: stream = Engine.generate for the same seed; inputs; output rules (docs/architecture.md,
"Service behaviours"
rows 21-24, 27); drafts; Tokenize; GetModelInfo."""

from __future__ import annotations

import concurrent.futures as cf

import pytest
from service_helpers import params

from dgserve import SamplingParams
from dgserve.engine.prompt import ChatPrompt
from dgserve.v1 import text_generation_pb2 as pb


def collect(stub, request, **kw):
    events = list(stub.Generate(request, **kw))
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds[0] == "started" and kinds[-1] == "finished" and kinds.count("started") == 1
    assert all(k in ("block", "draft") for k in kinds[1:-1])
    blocks = [e.block for e in events if e.HasField("block")]
    assert [b.index for b in blocks] == list(range(len(blocks)))
    assert len({e.request_id for e in events}) == 1
    return events[0].started, blocks, events[-1].finished


def local(engine, prompt, p: pb.SamplingParams, **extra):
    kw = {f.name: v for f, v in p.ListFields() if f.name != "stop"}
    return engine.generate(prompt, SamplingParams(**kw, stop=tuple(p.stop), **extra))


@pytest.mark.parametrize("prompt", ["the quick brown fox", "A"])
def test_stream_equals_engine_generate(stub, local_engine, prompt):
    p = params(max_new_tokens=45, seed=123)
    started, blocks, fin = collect(stub, pb.GenerateRequest(prompt=prompt, params=p))
    ref = local(local_engine, prompt, p)
    assert [list(b.token_ids) for b in blocks] == [b.token_ids for b in ref.blocks]
    assert "".join(b.text for b in blocks) == ref.text
    assert [b.stats.denoising_steps for b in blocks] == [b.stats.denoising_steps for b in ref.blocks]
    assert pb.FinishReason.Name(fin.finish_reason) == f"FINISH_REASON_{ref.finish_reason.upper()}"
    assert started.seed == 123 and started.prompt_tokens == ref.prompt_tokens


def test_token_ids_and_chat_inputs_equal_engine(stub, local_engine):
    p = params(seed=5)
    _, blocks, _ = collect(stub, pb.GenerateRequest(token_ids=pb.TokenIds(ids=[2, 50, 60, 70]), params=p))
    assert [t for b in blocks for t in b.token_ids] == local(local_engine, [2, 50, 60, 70], p).token_ids
    chat = pb.Chat(
        messages=[
            pb.ChatMessage(role="user", content="Hello there"),
            pb.ChatMessage(role="assistant", parts=[pb.ContentPart(text="Hi")]),
            pb.ChatMessage(role="user", content="How are you?"),
        ]
    )
    _, blocks, _ = collect(stub, pb.GenerateRequest(chat=chat, params=p))
    messages = (
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": [{"type": "text", "text": "Hi"}]},
        {"role": "user", "content": "How are you?"},
    )
    assert [t for b in blocks for t in b.token_ids] == local(local_engine, ChatPrompt(messages), p).token_ids


def test_same_seed_twice_identical_and_random_seed_echoed(stub):
    """docs/architecture.md, "Service behaviours", row 24: same seed → identical tokens; an unset seed is drawn, echoed
    in Started, and reproduces."""
    req = pb.GenerateRequest(prompt="seeds", params=params(seed=99))
    a, b = collect(stub, req), collect(stub, req)
    assert [list(x.token_ids) for x in a[1]] == [list(x.token_ids) for x in b[1]] and a[0].seed == 99
    p = params()
    p.ClearField("seed")
    started, blocks, _ = collect(stub, pb.GenerateRequest(prompt="seeds", params=p))
    again = collect(stub, pb.GenerateRequest(prompt="seeds", params=params(seed=started.seed)))
    assert [list(x.token_ids) for x in again[1]] == [list(x.token_ids) for x in blocks]


def test_concurrent_streams_equal_alone(stub, local_engine):
    """More streams than running slots (4): batched and queued, each equals its solo run (docs/architecture.md, "Service
    behaviours", row 18 in small)."""
    reqs = [
        pb.GenerateRequest(prompt=f"request number {i}", params=params(seed=i, max_new_tokens=20 + 7 * i))
        for i in range(7)
    ]
    with cf.ThreadPoolExecutor(7) as pool:
        results = list(pool.map(lambda r: collect(stub, r), reqs))
    for req, (_, blocks, fin) in zip(reqs, results, strict=True):
        ref = local(local_engine, req.prompt, req.params)
        assert [t for b in blocks for t in b.token_ids] == ref.token_ids
        assert pb.FinishReason.Name(fin.finish_reason) == f"FINISH_REASON_{ref.finish_reason.upper()}"


def test_stop_string_across_block_boundary(stub, local_engine):
    """docs/architecture.md, "Service behaviours", row 21: the match spans blocks 0 and 1; text is cut before it,
    nothing after it leaks, STOP."""
    p = params(max_new_tokens=48, ignore_eos=True, seed=5)
    free = local(local_engine, "stop test", p)
    cut = len(local_engine.tokenizer.decode(free.blocks[0].token_ids))
    stop = free.text[cut - 2 : cut + 2]
    start = free.text.find(stop)
    assert len(stop) == 4 and 0 <= start < cut
    p.stop.append(stop)
    _, blocks, fin = collect(stub, pb.GenerateRequest(prompt="stop test", params=p))
    text = "".join(b.text for b in blocks)
    assert fin.finish_reason == pb.FINISH_REASON_STOP and text == free.text[:start] and stop not in text
    assert len(blocks) == 2
    toks = [t for b in blocks for t in b.token_ids]
    assert toks == free.token_ids[: len(toks)] and fin.usage.completion_tokens == len(toks)


def test_max_new_tokens_not_multiple_of_canvas(stub):
    """docs/architecture.md, "Service behaviours", row 22: the last block is cut; LENGTH; completion_tokens ==
    max_new_tokens."""
    _, blocks, fin = collect(stub, pb.GenerateRequest(prompt="x", params=params(max_new_tokens=37, ignore_eos=True)))
    assert [len(b.token_ids) for b in blocks] == [16, 16, 5]
    assert fin.finish_reason == pb.FINISH_REASON_LENGTH and fin.usage.completion_tokens == 37


def test_eos_inside_block(stub):
    """docs/architecture.md, "Service behaviours", row 23: the block is cut just after EOS, EOS is the last token, never
    in text; EOS reason."""
    for seed in range(60):
        _, blocks, fin = collect(stub, pb.GenerateRequest(prompt="eos", params=params(seed=seed, max_new_tokens=64)))
        if fin.finish_reason == pb.FINISH_REASON_EOS:
            break
    else:
        pytest.fail("no seed produced EOS")
    toks = [t for b in blocks for t in b.token_ids]
    assert toks[-1] == 1 and 1 not in toks[:-1] and len(toks) < 64


def test_usage_accounting_and_metrics(stub, server):
    """docs/architecture.md, "Service behaviours", row 27: prompt + completion = total; completion = sum of block
    lengths; metrics counters match."""
    m = server.server.metrics
    before = (
        m.value("dgserve_generation_tokens_total"),
        m.value("dgserve_prompt_tokens_total"),
        m.value("dgserve_request_finish_total", {"reason": "length"}),
    )
    started, blocks, fin = collect(stub, pb.GenerateRequest(prompt="count me", params=params(ignore_eos=True)))
    u = fin.usage
    assert u.prompt_tokens + u.completion_tokens == u.total_tokens
    assert u.completion_tokens == sum(len(b.token_ids) for b in blocks) == 40
    assert u.prompt_tokens == started.prompt_tokens and u.blocks == len(blocks)
    assert u.denoising_steps == sum(b.stats.denoising_steps for b in blocks)
    assert fin.timing.total_ms >= fin.timing.first_block_ms > 0
    after = (
        m.value("dgserve_generation_tokens_total"),
        m.value("dgserve_prompt_tokens_total"),
        m.value("dgserve_request_finish_total", {"reason": "length"}),
    )
    assert after[0] - before[0] >= 40 and after[1] - before[1] >= u.prompt_tokens and after[2] > before[2]


def test_drafts_precede_their_block(stub):
    req = pb.GenerateRequest(
        prompt="drafts",
        params=params(max_new_tokens=32, max_denoising_steps=5),
        drafts=pb.DraftOptions(enabled=True, include_text=True),
    )
    events = list(stub.Generate(req))
    current = 0
    drafts = 0
    for e in events:
        if e.HasField("draft"):
            drafts += 1
            assert e.draft.block_index == current and 1 <= e.draft.step < 5 and len(e.draft.token_ids) == 16
        elif e.HasField("block"):
            current = e.block.index + 1
    assert drafts >= 1


def test_tokenize_matches_generate(stub):
    ids = stub.Tokenize(pb.TokenizeRequest(prompt="the lazy dog")).token_ids
    started, _, _ = collect(stub, pb.GenerateRequest(prompt="the lazy dog", params=params(max_new_tokens=1)))
    assert started.prompt_tokens == len(ids) and ids[0] == 2  # BOS
    chat = stub.Tokenize(pb.TokenizeRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="hi")])))
    assert len(chat.token_ids) > 1 and chat.max_model_len == 4096


def test_model_info(stub):
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert (info.model, list(info.aliases)) == ("tiny", ["tiny-alias"])
    assert (info.canvas_length, info.vocab_size, info.max_model_len, info.precision) == (16, 300, 4096, "float32")
    assert info.has_tokenizer and info.deterministic and list(info.eos_token_ids) == [1]
    assert info.defaults.max_denoising_steps == 48 and info.defaults.t_min == pytest.approx(0.4)
    names = {b.name for b in info.bounds}
    assert names == {
        "max_new_tokens",
        "max_denoising_steps",
        "t_min",
        "t_max",
        "entropy_bound",
        "stability_threshold",
        "confidence_threshold",
        "seed",
        "min_tokens",
    }
    assert info.max_num_seqs == 4 and info.max_queue_len == 4 and info.max_stop_strings == 16
    alias = list(stub.Generate(pb.GenerateRequest(model="tiny-alias", prompt="a", params=params(max_new_tokens=1))))
    assert alias[-1].HasField("finished")
