"""Engine behaviour: batch invariance, streaming, output rules (EOS, length, stop strings), seeds, validation."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from dgserve import Engine, SamplingParams
from dgserve.config import ConfigError
from dgserve.engine.prompt import Submission
from dgserve.model.default_model import SHIPPED, train_tokenizer
from dgserve.model.tiny import make_random_checkpoint, preset
from dgserve.outputs import OutputTracker

CORPUS = [
    "The quick brown fox jumps over the lazy dog, and the dog sleeps in the sun all day long.",
    "A diffusion model writes a whole canvas of tokens at once and refines it over a few steps.",
]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """The tiny random model with a 300-id byte-level BPE tokenizer (specials 0, 1, 2 = pad, eos, bos)."""
    path = make_random_checkpoint(tmp_path_factory.mktemp("tiny-tok"), "tiny", seed=3)
    tok = train_tokenizer(300, CORPUS)
    assert tok.get_vocab_size() <= 300
    tok.save(f"{path}/tokenizer.json")
    return Engine.from_pretrained(path)


def _params(**kw):
    base = dict(max_new_tokens=40, max_denoising_steps=6, seed=11)
    base.update(kw)
    return SamplingParams(**base)


def test_batch_equals_alone(engine):
    """generate_batch gives exactly what each request gives alone (different lengths, knobs, seeds)."""
    prompts = [[5, 6, 7], list(range(3, 40)), [9], "the dog"]
    params = [
        _params(seed=1),
        _params(seed=2, max_new_tokens=70, t_min=0.1),
        _params(seed=3, max_denoising_steps=9, entropy_bound=1.0),
        _params(seed=4, ignore_eos=True),
    ]
    together = engine.generate_batch(prompts, params)
    for prompt, p, res in zip(prompts, params, together, strict=True):
        alone = engine.generate(prompt, p)
        assert res.token_ids == alone.token_ids and res.finish_reason == alone.finish_reason
        assert [b.stats.denoising_steps for b in res.blocks] == [b.stats.denoising_steps for b in alone.blocks]


@pytest.fixture(scope="module", params=["shipped", "moe16"])
def stream_engine(request, tmp_path_factory):
    """The shipped model (fp32), or a tiny random MoE of 16 experts top-3, for up to 32 requests at once."""
    if request.param == "shipped":
        return Engine.from_pretrained(SHIPPED, max_model_len=256)
    config = preset("tiny", num_experts=16, top_k_experts=3)
    path = make_random_checkpoint(tmp_path_factory.mktemp("tiny-moe16"), config, seed=5)
    train_tokenizer(300, CORPUS).save(f"{path}/tokenizer.json")
    return Engine.from_pretrained(path, max_model_len=256)


def test_batch_equals_alone_at_every_stream_count(stream_engine):
    """1, 2, 7, 16 and 32 requests at once (mixed prompt lengths, one or two blocks, seeds) each get exactly their
    tokens alone: the CPU decoder stacks the running canvases (docs/exactness.md, "Batch invariance")."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 250, (1 + (7 * i) % 23,), generator=g).tolist() for i in range(32)]
    params = [
        _params(seed=100 + i, max_new_tokens=16 if i % 3 else 24, max_denoising_steps=2 + i % 3, ignore_eos=i % 2 == 0)
        for i in range(32)
    ]
    alone = [stream_engine.generate(p, q).token_ids for p, q in zip(prompts, params, strict=True)]
    for n in (1, 2, 7, 16, 32):
        together = stream_engine.generate_batch(prompts[:n], params[:n])
        assert [r.token_ids for r in together] == alone[:n], n


def test_stream_blocks_partition_result(engine):
    p = _params(max_new_tokens=45, ignore_eos=True)
    blocks = list(engine.stream([5, 6, 7], p))
    res = engine.generate([5, 6, 7], p)
    assert [t for b in blocks for t in b.token_ids] == res.token_ids
    assert [len(b.token_ids) for b in blocks] == [16, 16, 13]  # 45 is not a multiple of C = 16
    assert [b.finish_reason for b in blocks] == [None, None, "length"]
    assert "".join(b.text for b in blocks) == res.text
    for b in blocks:
        assert b.denoising_steps == b.stats.denoising_steps == 6
        assert b.stats.tokens_per_forward == pytest.approx(len(b.token_ids) / 6)
        assert b.stats.denoise_seconds > 0 and b.stats.encode_seconds > 0


def test_random_seed_is_reported_and_reproduces(engine):
    first = engine.generate([5, 6, 7], _params(seed=None))
    assert 0 <= first.seed < 2**64
    again = engine.generate([5, 6, 7], _params(seed=first.seed))
    assert again.token_ids == first.token_ids


def test_different_seeds_differ(engine):
    a = engine.generate([5, 6, 7], _params(seed=1, ignore_eos=True))
    b = engine.generate([5, 6, 7], _params(seed=2, ignore_eos=True))
    assert a.token_ids != b.token_ids


def test_eos_cuts_output_and_text_excludes_it(engine):
    for seed in range(40):
        res = engine.generate([5, 6, 7], _params(seed=seed, max_new_tokens=64))
        if res.finish_reason == "eos":
            break
    else:
        pytest.fail("no seed produced EOS in 40 tries")
    assert res.token_ids[-1] == 1 and 1 not in res.token_ids[:-1]
    assert res.text == engine.tokenizer.decode(res.token_ids[:-1])
    ignored = engine.generate([5, 6, 7], _params(seed=seed, max_new_tokens=64, ignore_eos=True))
    assert len(ignored.token_ids) == 64 and ignored.token_ids[: len(res.token_ids)] == res.token_ids


def test_stop_string_spanning_blocks(engine):
    p = _params(max_new_tokens=48, ignore_eos=True, seed=5)
    free = engine.generate([5, 6, 7], p)
    first_block_text = engine.tokenizer.decode(free.blocks[0].token_ids)
    full = free.text
    # a stop string that starts in block 0 and ends in block 1
    cut = len(first_block_text)
    stop = full[cut - 2 : cut + 2]
    assert len(stop) == 4 and full.find(stop) >= 0
    start = full.find(stop)
    res = engine.generate([5, 6, 7], SamplingParams(**{**p.__dict__, "stop": (stop,)}))
    assert res.finish_reason == "stop"
    assert res.text == full[:start]
    n = len(res.token_ids)
    assert res.token_ids == free.token_ids[:n]
    assert stop in engine.tokenizer.decode(res.token_ids) and stop not in engine.tokenizer.decode(res.token_ids[:-1])
    streamed = list(engine.stream([5, 6, 7], SamplingParams(**{**p.__dict__, "stop": (stop,)})))
    assert "".join(b.text for b in streamed) == full[:start]
    assert streamed[-1].finish_reason == "stop"


def test_max_new_tokens_smaller_than_canvas(engine):
    res = engine.generate([5], _params(max_new_tokens=3, ignore_eos=True))
    assert len(res.token_ids) == 3 and res.finish_reason == "length" and len(res.blocks) == 1


def test_abort_frees_request(engine):
    rid = engine.add_request([5, 6], _params())
    assert engine.has_unfinished()
    assert engine.abort(rid) and not engine.has_unfinished()
    assert not engine.abort(rid)


@pytest.mark.parametrize(
    "prompt, match",
    [
        ([], "prompt: must contain"),
        ([5, 300], "prompt: token id 300"),
        ([-1], "prompt: token id -1"),
        (list(range(3, 300)) * 14, "context window"),
    ],
)
def test_bad_prompts(engine, prompt, match):
    with pytest.raises(ValueError, match=match):
        engine.generate(prompt, _params())
    assert not engine.has_unfinished()


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=1.5), "max_new_tokens"),
        (dict(max_denoising_steps=0), "max_denoising_steps"),
        (dict(max_denoising_steps=True), "max_denoising_steps"),
        (dict(t_min=-0.1), "t_min"),
        (dict(t_min=0.8, t_max=0.8), "t_max"),
        (dict(t_max=float("nan")), "t_max"),
        (dict(entropy_bound=0.0), "entropy_bound"),
        (dict(stability_threshold=-1), "stability_threshold"),
        (dict(confidence_threshold=0), "confidence_threshold"),
        (dict(seed=-1), "seed"),
        (dict(seed=2**64), "seed"),
        (dict(ignore_eos="yes"), "ignore_eos"),
        (dict(stop=("",)), r"stop\[0\]"),
        (dict(stop=("a",) * 17), "stop"),
    ],
)
def test_sampling_params_validation_names_field(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_stop_without_tokenizer_is_rejected(tiny_checkpoint):
    eng = Engine.from_pretrained(tiny_checkpoint("base"))
    with pytest.raises(ValueError, match="stop"):
        eng.generate([5, 6], _params(stop=("x",)))
    with pytest.raises(ValueError, match="tokenizer"):
        eng.generate("text", _params())


def test_checkpoint_defaults_outside_request_limits_fail_at_load(tiny_checkpoint, tmp_path):
    """A generation_config.json default that no request may use (here 2,000 denoising steps, above SamplingParams'
    1,024) is refused when the engine is built, naming the field and the file."""
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint("base"), path)
    gen = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**gen, "max_denoising_steps": 2000}))
    with pytest.raises(ConfigError, match=r"generation_config\.max_denoising_steps: must be in \[1, 1024\].*json"):
        Engine.from_pretrained(path)


def test_engine_defaults_are_the_checkpoints(tiny_checkpoint, tmp_path):
    """from_pretrained reads the knobs and the EOS ids of generation_config.json; default_params overrides them."""
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint("base"), path)
    gen = json.loads((path / "generation_config.json").read_text())
    gen.update(max_denoising_steps=7, t_min=0.2, eos_token_id=[1, 3], sampler_config={"entropy_bound": 0.5})
    (path / "generation_config.json").write_text(json.dumps(gen))
    eng = Engine.from_pretrained(path)
    assert eng.default_params() == SamplingParams(max_denoising_steps=7, t_min=0.2, entropy_bound=0.5)
    assert eng.default_params(seed=3, t_min=0.0) == SamplingParams(
        max_denoising_steps=7, t_min=0.0, entropy_bound=0.5, seed=3
    )
    assert eng.eos_ids == {1, 3}
    with pytest.raises(ValueError, match="t_max"):
        eng.default_params(t_min=0.9)


class _CharTokenizer:
    """id i ↔ chr(ord('a') + i - 10) for i ≥ 10; ids < 10 decode to nothing (specials)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i - 10) for i in ids if i >= 10)


def _ids(s):
    return [ord(c) - ord("a") + 10 for c in s]


def test_tracker_holds_back_partial_stop_and_cuts():
    t = OutputTracker(100, frozenset({1}), False, ("xyz",), _CharTokenizer())
    toks, delta = t.add_block(_ids("abcx"))
    assert delta == "abc" and t.finish_reason is None  # "x" may start the stop string
    toks, delta = t.add_block(_ids("yzqq"))
    assert toks == _ids("yz") and delta == "" and t.text == "abc" and t.finish_reason == "stop"
    assert t.token_ids == _ids("abcxyz")


def test_tracker_released_partial_match_and_eos_first():
    t = OutputTracker(100, frozenset({1}), False, ("xyz",), _CharTokenizer())
    assert t.add_block(_ids("abx"))[1] == "ab"
    assert t.add_block(_ids("yq"))[1] == "xyq"  # not a match after all: released
    toks, delta = t.add_block([*_ids("c"), 1, *_ids("xyz")])
    assert toks == [*_ids("c"), 1] and delta == "c" and t.finish_reason == "eos"


def test_tracker_length_cut():
    t = OutputTracker(5, frozenset({1}), False, (), _CharTokenizer())
    assert t.add_block(_ids("abc"))[0] == _ids("abc") and t.finish_reason is None
    assert t.add_block(_ids("defg"))[0] == _ids("de") and t.finish_reason == "length"


def test_bf16_engine_is_batch_invariant(tiny_checkpoint):
    """bf16 on the CPU: each request's tokens are the same alone and batched, bit for bit (the decoder's GEMMs are
    the batch-invariant ``linear``). Against transformers, bf16 compares logits (tests/test_model_parity.py, within
    2 bf16 ulps): a one-ulp difference from torch's GEMM rounding flips bf16 tokens, so tokens are not compared
    (docs/exactness.md, "Why the forward pass has a tolerance")."""
    eng = Engine.from_pretrained(tiny_checkpoint("base"), dtype=torch.bfloat16)
    prompts = [[4, 5, 6, 7], list(range(3, 30)), [9]]
    params = [SamplingParams(max_new_tokens=32, max_denoising_steps=6, seed=seed) for seed in range(3)]
    alone = [eng.generate(p, q).token_ids for p, q in zip(prompts, params, strict=True)]
    assert [r.token_ids for r in eng.generate_batch(prompts, params)] == alone


def test_fill_context_uses_the_room_left(tiny_checkpoint):
    """A request that set no token limit (``fill_context``) takes the default limit, at most the whole canvases
    left in its context (max_request_steps bounds the steps it runs, not its limit; tests/test_output_limits.py
    has the grammar and default cases); a prompt that leaves no canvas is refused as before."""
    eng = Engine.from_pretrained(tiny_checkpoint("base"), max_model_len=200, max_request_steps=40)
    C = eng.model.config.canvas_length
    p = SamplingParams(max_new_tokens=1024, max_denoising_steps=4, seed=1)
    req = eng.make_request(Submission([5, 6, 7], p, fill_context=True))
    assert req.params.max_new_tokens == (200 - 3) // C * C and req.step_limit == 40
    assert req.tracker.max_new_tokens == req.params.max_new_tokens
    roomy = Engine.from_pretrained(tiny_checkpoint("base"), max_model_len=200)
    small = SamplingParams(max_new_tokens=32, max_denoising_steps=4, seed=1)
    assert roomy.make_request(Submission([5, 6, 7], small)).params.max_new_tokens == 32  # the params' own
    assert roomy.make_request(Submission([5] * 50, p, fill_context=True)).params.max_new_tokens == (200 - 50) // C * C
    with pytest.raises(ValueError, match="prompt"):
        roomy.make_request(Submission([5] * (200 - C + 1), p, fill_context=True))
