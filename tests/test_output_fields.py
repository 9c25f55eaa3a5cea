"""The per-request output fields vLLM clients send: ``stop_token_ids`` (end as EOS does, finish reason "stop"),
``min_tokens`` (EOS and stops count only after that many tokens; the sampler never draws EOS or a stop token
there) and ``skip_special_tokens``, on the tracker alone and through the engine."""

from __future__ import annotations

import dataclasses

import pytest

from dgserve import Engine, SamplingParams
from dgserve.model.default_model import train_tokenizer
from dgserve.model.tiny import make_random_checkpoint
from dgserve.outputs import OutputTracker

CORPUS = [
    "The quick brown fox jumps over the lazy dog, and the dog sleeps in the sun all day long.",
    "A diffusion model writes a whole canvas of tokens at once and refines it over a few steps.",
]
EOS = 1


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """The tiny random model with a 300-id byte-level BPE tokenizer (specials 0, 1, 2 = pad, eos, bos)."""
    path = make_random_checkpoint(tmp_path_factory.mktemp("tiny-tok"), "tiny", seed=3)
    train_tokenizer(300, CORPUS).save(f"{path}/tokenizer.json")
    return Engine.from_pretrained(path)


def _params(**kw) -> SamplingParams:
    return SamplingParams(**{"max_new_tokens": 40, "max_denoising_steps": 6, "seed": 11, **kw})


class _Chars:
    """id i ↔ chr(ord('a') + i - 10) for i ≥ 10; ids < 10 decode to nothing (specials)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i - 10) for i in ids if i >= 10)


def _ids(s: str) -> list[int]:
    return [ord(c) - ord("a") + 10 for c in s]


# ---------------------------------------------------------------------------------------------- the tracker


def test_stop_token_ends_like_eos_with_reason_stop_and_stays_out_of_the_text():
    t = OutputTracker(100, frozenset({EOS}), False, (), _Chars(), stop_token_ids=(_ids("q")[0],))
    toks, delta = t.add_block(_ids("abqcd"))
    assert toks == _ids("abq") and delta == "ab" and t.text == "ab" and t.finish_reason == "stop"
    assert t.stop_sequence is None  # a token, not a stop string


def test_min_tokens_ignores_eos_stop_tokens_and_stop_strings_before_it():
    q = _ids("q")[0]
    t = OutputTracker(100, frozenset({EOS}), False, ("xy",), _Chars(), stop_token_ids=(q,), min_tokens=6)
    toks, delta = t.add_block([*_ids("ab"), EOS, q, *_ids("xy")])  # all within the first 6 tokens
    assert toks == [*_ids("ab"), EOS, q, *_ids("xy")] and t.finish_reason is None
    assert delta == "abxy"  # the match "xy" ends within the first 6 tokens: it is text
    toks, delta = t.add_block(_ids("cxyz"))  # a match completed by token 9: it counts
    assert toks == _ids("cxy") and t.finish_reason == "stop" and t.text == "abxyc"
    straddle = OutputTracker(100, frozenset({EOS}), False, ("bc",), _Chars(), min_tokens=2)
    straddle.add_block(_ids("abcd"))  # "bc" ends with token 3, after the first 2: it counts
    assert straddle.finish_reason == "stop" and straddle.text == "a"
    eos = OutputTracker(100, frozenset({EOS}), False, (), _Chars(), min_tokens=2)
    assert eos.add_block([EOS, *_ids("a"), EOS, *_ids("b")])[0] == [EOS, *_ids("a"), EOS]
    assert eos.finish_reason == "eos" and eos.banned_positions() == 0


def test_banned_ids_are_eos_unless_ignored_and_stop_tokens():
    t = OutputTracker(100, frozenset({EOS, 3}), False, (), None, stop_token_ids=(7,), min_tokens=5)
    assert t.banned_ids == {EOS, 3, 7} and t.banned_positions() == 5
    assert OutputTracker(100, frozenset({EOS}), True, (), None, True, (7,), 5).banned_ids == {7}


# ---------------------------------------------------------------------------------------------- the engine


def _early_eos(engine) -> tuple[int, object]:
    for seed in range(60):
        res = engine.generate([5, 6, 7], _params(seed=seed, max_new_tokens=64))
        if res.finish_reason == "eos" and len(res.token_ids) < 48:
            return seed, res
    pytest.fail("no seed ended with EOS within 48 tokens in 60 tries")


def test_min_tokens_keeps_eos_out_of_the_first_tokens(engine):
    seed, res = _early_eos(engine)
    n = len(res.token_ids) + 8
    longer = engine.generate([5, 6, 7], _params(seed=seed, max_new_tokens=64, min_tokens=n))
    assert len(longer.token_ids) >= n and EOS not in longer.token_ids[:n]
    assert longer.finish_reason in ("eos", "length")
    # the same request without min_tokens, batched with it, is unchanged (the ban is per row)
    both = engine.generate_batch([[5, 6, 7]] * 2, [_params(seed=seed, max_new_tokens=64), longer_params(seed, n)])
    assert both[0].token_ids == res.token_ids and both[1].token_ids == longer.token_ids


def longer_params(seed: int, n: int) -> SamplingParams:
    return _params(seed=seed, max_new_tokens=64, min_tokens=n)


def test_stop_token_ids_end_generation_with_reason_stop(engine):
    free = engine.generate([5, 6, 7], _params(ignore_eos=True, seed=4))
    k = 10
    tok = free.token_ids[k]
    first = free.token_ids.index(tok)
    res = engine.generate([5, 6, 7], _params(ignore_eos=True, seed=4, stop_token_ids=(tok,)))
    assert res.finish_reason == "stop" and res.token_ids == free.token_ids[: first + 1]
    assert res.text == engine.tokenizer.decode(free.token_ids[:first])


def test_min_tokens_bans_stop_token_ids_too(engine):
    free = engine.generate([5, 6, 7], _params(ignore_eos=True, seed=4))
    tok = free.token_ids[2]
    res = engine.generate([5, 6, 7], _params(ignore_eos=True, seed=4, stop_token_ids=(tok,), min_tokens=20))
    assert tok not in res.token_ids[:20] and len(res.token_ids) >= 20


def test_skip_special_tokens_false_keeps_them_in_the_text(engine):
    seed, res = _early_eos(engine)
    p = _params(seed=seed, max_new_tokens=64, ignore_eos=True)
    kept = engine.generate([5, 6, 7], dataclasses.replace(p, skip_special_tokens=False))
    plain = engine.generate([5, 6, 7], p)
    assert kept.token_ids == plain.token_ids
    specials = [t for t in plain.token_ids if t in (0, 2)]  # pad / bos in the output: written when kept
    assert kept.text == engine.tokenizer.decode([t for t in plain.token_ids if t != EOS], skip_special_tokens=False)
    assert (kept.text != plain.text) == bool(specials)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"stop_token_ids": (10**6,)}, r"stop_token_ids\[0\]: token id 1000000 is outside the vocabulary"),
        ({"stop_token_ids": (-1,)}, r"stop_token_ids\[0\] must be a non-negative integer"),
        ({"stop_token_ids": tuple(range(65))}, r"stop_token_ids has 65 ids; at most 64"),
        ({"min_tokens": 41}, r"min_tokens must be <= max_new_tokens \(40\)"),
        ({"min_tokens": -1}, r"min_tokens must be in \[0, "),
    ],
)
def test_bad_values_name_the_field(engine, kw, match):
    with pytest.raises(ValueError, match=match):
        engine.generate([5, 6, 7], _params(**kw))
