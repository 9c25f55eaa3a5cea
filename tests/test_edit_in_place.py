"""Edit in place (docs/edit-in-place.md): a starting canvas, pinned positions, blanks, the output rules around
pins, the checks on bad input, and exactness (a pinned request batched with others, through the prefix cache or
the reference ops, gives its solo tokens). On the shipped small model (it has a tokenizer; fp32 on the CPU)."""

from __future__ import annotations

import pathlib

import pytest
import torch

from dgserve import Engine, SamplingParams, ops
from dgserve.engine.block import BlockState, InitialCanvas
from dgserve.engine.prompt import Submission
from dgserve.structured.response_format import ResponseFormat

SMALL = pathlib.Path(__file__).resolve().parents[1] / "python" / "dgserve" / "models" / "small"
PROMPT = "The setup script is the centre of all activity in building,"


@pytest.fixture(scope="module")
def engine():
    return Engine.from_pretrained(SMALL)


def _run(engine, subs):
    reqs = [engine.add(engine.make_request(s)) for s in subs]
    while not all(r.finished for r in reqs):
        engine.step()
    return [r.result() for r in reqs]


def _params(**kw):
    base = dict(max_new_tokens=32, max_denoising_steps=6, seed=7)
    return SamplingParams(**{**base, **kw})


def _fim(engine, n_blank=6, suffix=" distributing, and installing modules"):
    """(draft, pinned): ``n_blank`` blanks then the suffix's tokens, pinned."""
    ids = engine.tokenizer.encode_content(suffix)
    return [-1] * n_blank + ids, [[n_blank, n_blank + len(ids)]]


def test_block_start_lays_the_draft_over_the_noise():
    draft = InitialCanvas((5, -1, 7) + (9,) * 14 + (11, -1), ((0, 1), (16, 17)))  # two canvases of 16
    noise0 = BlockState.start(3, 0, 16, 300, torch.device("cpu")).canvas
    b0 = BlockState.start(3, 0, 16, 300, torch.device("cpu"), draft, frozenset({1}))
    assert b0.canvas.tolist() == [5, noise0[1].item(), 7] + [9] * 13
    assert b0.pinned == 1 and b0.pins is not None
    assert b0.pins[0].tolist().count(0) == b0.pins.shape[1] - 1  # position 0: one word with one bit, for id 5
    assert b0.pins[0, 0].item() == 1 << 5
    assert b0.pins[1, 0].item() == ~(1 << 1)  # before the last pin: every id but EOS
    noise1 = BlockState.start(3, 1, 16, 300, torch.device("cpu")).canvas
    b1 = BlockState.start(3, 1, 16, 300, torch.device("cpu"), draft, frozenset({1}))
    assert b1.canvas.tolist() == [9, 11, noise1[2].item()] + noise1[3:].tolist()
    assert b1.pins is not None and b1.pins[2].tolist() == [-1] * b1.pins.shape[1]  # after the last pin: free
    assert BlockState.start(3, 2, 16, 300, torch.device("cpu"), draft).pins is None


def test_pinned_tokens_stay_at_their_positions(engine):
    draft, pinned = _fim(engine)
    res = _run(engine, [Submission(PROMPT, _params(), initial_canvas=draft, pinned=pinned)])[0]
    a, b = pinned[0]
    assert res.token_ids[a:b] == draft[a:b]
    assert len(res.token_ids) == 32 and res.finish_reason in ("length", "eos")
    assert sum(blk.stats.pinned_tokens for blk in res.blocks) == b - a
    # pinned: true pins the whole draft; a draft of every position gives back exactly the draft
    ids = engine.tokenizer.encode_content(" and installing modules in the standard library")
    res = _run(engine, [Submission(PROMPT, _params(max_new_tokens=len(ids)), initial_canvas=ids, pinned=True)])[0]
    assert res.token_ids == ids


def test_pinned_request_batched_cached_and_reference_equals_alone(engine):
    draft, pinned = _fim(engine)
    sub = Submission(PROMPT, _params(), initial_canvas=draft, pinned=pinned)
    alone = _run(engine, [sub])[0].token_ids
    others = [Submission(PROMPT + " x", _params(seed=s)) for s in range(3)]
    batched = _run(engine, [others[0], sub, others[1], Submission(PROMPT, _params(seed=9), initial_canvas=draft)])
    assert batched[1].token_ids == alone
    assert batched[0].token_ids == _run(engine, [others[0]])[0].token_ids  # pins change no other row
    again = _run(engine, [sub])[0]  # a second run (the prefix cache: the test below)
    assert again.token_ids == alone
    with ops.native_disabled():
        assert _run(engine, [sub])[0].token_ids == alone


def test_eos_cannot_end_the_output_before_the_last_pin(engine):
    eos = sorted(engine.eos_ids)[0]
    tail = engine.tokenizer.encode_content(" modules")
    for seed in range(2):
        draft = [eos] * 20 + tail  # the unpinned start is all EOS: the sampler must replace every one
        res = _run(
            engine,
            [Submission(PROMPT, _params(seed=seed, max_new_tokens=21), initial_canvas=draft, pinned=[[20, 21]])],
        )[0]
        assert not set(res.token_ids[:20]) & engine.eos_ids
        assert res.token_ids[20] == tail[0]


def test_stop_strings_count_only_after_the_pins(engine):
    ids = engine.tokenizer.encode_content(" distributing, and installing")
    sub = Submission(PROMPT, _params(stop=(",",), max_new_tokens=40), initial_canvas=ids, pinned=True)
    res = _run(engine, [sub])[0]
    assert res.token_ids[: len(ids)] == ids
    assert res.text.startswith(" distributing, and installing")
    if res.finish_reason == "stop":
        assert "," not in res.text[len(" distributing, and installing") :]


def test_text_canvas_is_content(engine):
    tok = engine.tokenizer
    text = "<bos>a <|turn> b"
    sub = Submission(PROMPT, _params(max_new_tokens=64), initial_canvas=text, pinned=True)
    req = engine.make_request(sub)
    assert req.initial_canvas is not None and list(req.initial_canvas.ids) == tok.encode_content(text)
    assert tok.bos_token_id not in req.initial_canvas.ids  # neither a BOS nor the "<bos>" text as its token


def test_eos_pinned_last_ends_the_output_there(engine):
    eos = sorted(engine.eos_ids)[0]
    ids = engine.tokenizer.encode_content(" modules") + [eos]
    res = _run(engine, [Submission(PROMPT, _params(), initial_canvas=[-1] * 4 + ids, pinned=[[4, 4 + len(ids)]])])[0]
    assert res.finish_reason == "eos" and res.token_ids[4:] == ids


@pytest.mark.parametrize(
    "canvas, pinned, params, field",
    [
        ([5, 6, 70000], None, {}, "initial_canvas: token id 70000"),
        ([5, -2], None, {}, "initial_canvas: token id -2"),
        ([5] * 33, None, {}, "initial_canvas: 33 tokens, more than the request's 2 canvases"),
        ("word " * 200, None, {}, "initial_canvas: at least"),
        ([], None, {}, "initial_canvas: must hold"),
        ([5, "6"], None, {}, "initial_canvas: token ids must be integers"),
        (None, True, {}, "pinned: needs an initial_canvas"),
        ([5, 6, 7], [[1, 2], [0, 1]], {}, "pinned[1]: [0, 1) starts before"),
        ([5, 6, 7], [[1, 4]], {}, "pinned[0]: [1, 4) must be a non-empty range inside"),
        ([5, 6, 7], [[2, 2]], {}, "pinned[0]"),
        ([5, 6, 7], [[1]], {}, "pinned[0]: must be a [start, end) pair"),
        ([5, 6, 7], "all", {}, "pinned: must be true"),
        ([5, -1, 7], True, {}, "pinned[0]: position 1 is a blank"),
        ([5] * 20, True, {"max_new_tokens": 18}, "pinned: the last pinned range ends at position 20, past"),
        ([1, 5], True, {}, "pinned: position 0 pins EOS id 1"),
        ([5, 6], True, {"response_format": ResponseFormat("json_object")}, "pinned: cannot be combined"),
    ],
)
def test_bad_input_names_the_field(engine, canvas, pinned, params, field):
    with pytest.raises(ValueError) as e:
        engine.make_request(Submission(PROMPT, _params(**params), initial_canvas=canvas, pinned=pinned))
    assert field in str(e.value)


def test_eos_pinned_anywhere_with_ignore_eos(engine):
    req = engine.make_request(Submission(PROMPT, _params(ignore_eos=True), initial_canvas=[1, 5], pinned=True))
    assert req.initial_canvas is not None and req.initial_canvas.pinned == ((0, 2),)


def test_pinned_request_through_the_prefix_cache_equals_without_it():
    """A prompt of several prefill chunks: the second request reuses the first's cached chunks and gives the same
    tokens as an engine without prefix caching."""
    from dgserve.engine.scheduler import SchedulerConfig

    sched = SchedulerConfig(max_num_seqs=4, prefill_chunk=8, max_prefill_tokens=8)
    on = Engine.from_pretrained(SMALL, scheduler_config=sched)
    off = Engine.from_pretrained(SMALL, scheduler_config=sched, prefix_caching=False)
    prompt = PROMPT + " distributing, and installing modules. " * 3
    draft, pinned = _fim(on)
    sub = Submission(prompt, _params(max_new_tokens=16), initial_canvas=draft, pinned=pinned)
    first, second = _run(on, [sub])[0], _run(on, [sub])[0]
    assert second.cached_tokens > 0 and first.cached_tokens == 0
    assert first.token_ids == second.token_ids == _run(off, [sub])[0].token_ids
