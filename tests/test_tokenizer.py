"""dgserve.text.tokenizer: encode/decode, special tokens, chat templates (fallback, checkpoint, sandbox), streaming.

The tokenizer is a tiny byte-level BPE trained here on inline text, saved as tokenizer.json (with and without a
tokenizer_config.json), so the tests need no download.
"""

from __future__ import annotations

import json
import pathlib
import random

import pytest

from dgserve.outputs import OutputTracker
from dgserve.text.tokenizer import IncrementalDecoder, Tokenizer

SPECIALS = ["<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "<|think|>", "<|channel>", "<channel|>"]

CORPUS = [
    (
        "The quick brown fox jumps over the lazy dog. A diffusion model writes a whole canvas of tokens at once, "
        "starting from noise and refining every position in parallel until the confident tokens are kept."
    ),
    (
        "Once upon a time there was a little model that wanted to speak. It read many books about the sea, the "
        "mountains and the rivers, and it learned that words follow each other in patterns."
    ),
    (
        "The user asked a question and the model answered politely. Then the user asked another question, and the "
        "model thought about it for a while before it wrote its answer in the reply."
    ),
    (
        "Servers stream each committed block to the caller as soon as it is final. Requests are batched together, "
        "and every active canvas advances one denoising step per iteration of the engine loop."
    ),
]

TEXTS = [
    "Hello world, this is a test of the tokenizer.",
    "Café naïve façade — Øresund, Zürich, São Paulo, Ελληνικά.",
    "Emoji: I ❤️ 🦊 and 👩‍👩‍👧 (family), 🇫🇷 flags!",
    "日本語のテキストと한국어 텍스트",
    "tabs\tand\nnewlines\r\n  and   spaces ",
    "",
]

SYSTEM_CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": [{"type": "text", "text": "How "}, {"type": "text", "text": "are you?"}]},
]


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory) -> pathlib.Path:
    """A trained byte-level BPE tokenizer (~400 ids; specials get ids 0..7 in SPECIALS order) whose post-processor
    prepends <bos>, as the shipped model's does."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from dgserve.model.default_model import add_bos_post_processor

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    add_bos_post_processor(tok)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture
def make_dir(tmp_path, tokenizer_json):
    """make_dir(config=None, jinja=None) -> checkpoint dir with tokenizer.json and the optional files."""

    def make(config: dict | None = None, jinja: str | None = None) -> pathlib.Path:
        d = tmp_path / f"ckpt{len(list(tmp_path.iterdir()))}"
        d.mkdir()
        (d / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
        if config is not None:
            (d / "tokenizer_config.json").write_text(json.dumps(config))
        if jinja is not None:
            (d / "chat_template.jinja").write_text(jinja)
        return d

    return make


@pytest.fixture
def tok(make_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(make_dir())


# ---------------------------------------------------------------------- loading, ids


def test_special_ids_and_vocab(tok, tokenizer_json):
    from tokenizers import Tokenizer as HFTokenizer

    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (0, 1, 2)
    assert tok.bos_token == "<bos>"
    assert tok.vocab_size == HFTokenizer.from_file(str(tokenizer_json)).get_vocab_size(with_added_tokens=True)
    assert 300 <= tok.vocab_size <= 500
    assert tok.token_to_id("<|turn>") == 3
    assert tok.token_to_id("<no such token>") is None
    assert tok.chat_template is None


def test_config_special_tokens_as_dicts(make_dir):
    tok = Tokenizer.from_pretrained(
        make_dir(
            {
                "bos_token": {"content": "<bos>"},
                "eos_token": "<turn|>",
                "pad_token": {"content": "<pad>", "lstrip": False},
            }
        )
    )
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (2, 4, 0)


@pytest.mark.parametrize("post_bos", [True, False])
@pytest.mark.parametrize("config_bos", [True, False, None])
def test_post_processor_decides_bos_and_disagreement_warns_once(tmp_path, tokenizer_json, caplog, post_bos, config_bos):
    """transformers 5.23 ignores tokenizer_config.json's add_bos_token when tokenizer.json exists: the
    post-processor alone adds BOS. dgserve does the same, and warns once at load when the two files disagree."""
    data = json.loads(tokenizer_json.read_text())
    if not post_bos:
        data["post_processor"] = None
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    if config_bos is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": config_bos}))
    with caplog.at_level("WARNING", logger="dgserve"):
        tok = Tokenizer.from_pretrained(tmp_path)
        tok.encode("hi", add_special_tokens=True)
    assert tok.add_bos_token is post_bos
    assert tok.encode("hi", add_special_tokens=True) == [2] * post_bos + tok.encode("hi")
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    if config_bos is None or config_bos == post_bos:
        assert warnings == []
    else:
        assert len(warnings) == 1 and "tokenizer_config.json" in warnings[0] and "tokenizer.json" in warnings[0]
        assert f"add_bos_token is {str(config_bos).lower()}" in warnings[0]


def test_bad_add_bos_token_is_an_error(make_dir):
    with pytest.raises(ValueError, match="add_bos_token must be a boolean"):
        Tokenizer.from_pretrained(make_dir({"add_bos_token": "yes"}))


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_bos_handling(tok):
    ids = tok.encode("the model")
    assert ids[0] != tok.bos_token_id
    assert tok.encode("the model", add_special_tokens=True) == [tok.bos_token_id] + ids
    # as transformers and tokenizers do: the post-processor adds BOS even before a literal "<bos>"
    assert tok.encode("<bos>the model", add_special_tokens=True) == [tok.bos_token_id] * 2 + ids
    assert tok.decode([tok.bos_token_id] + ids) == "the model"
    assert tok.decode([tok.bos_token_id] + ids, skip_special_tokens=False) == "<bos>the model"


def test_decode_accepts_tensor_and_rejects_negative(tok):
    import torch

    ids = tok.encode("the sea")
    assert tok.decode(torch.tensor(ids)) == "the sea"
    with pytest.raises(ValueError, match="non-negative"):
        tok.decode([1, -3])


def test_matches_transformers(tok, tokenizer_json):
    from transformers import PreTrainedTokenizerFast

    ref = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json))
    for text in TEXTS + [" ".join(CORPUS)]:
        ids = tok.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)


# ---------------------------------------------------------------------- built-in Gemma 4 template


def test_fallback_exact(tok):
    assert tok.apply_chat_template(SYSTEM_CHAT) == (
        "<bos><|turn>system\nYou are terse.<turn|>\n<|turn>user\nHi!<turn|>\n<|turn>model\nHello.<turn|>\n"
        "<|turn>user\nHow are you?<turn|>\n<|turn>model\n<|channel>thought\n<channel|>"
    )
    assert tok.apply_chat_template(SYSTEM_CHAT, add_generation_prompt=False) == (
        "<bos><|turn>system\nYou are terse.<turn|>\n<|turn>user\nHi!<turn|>\n<|turn>model\nHello.<turn|>\n"
        "<|turn>user\nHow are you?<turn|>\n"
    )
    model_role = [dict(m, role="model") if m["role"] == "assistant" else m for m in SYSTEM_CHAT]
    assert tok.apply_chat_template(model_role) == tok.apply_chat_template(SYSTEM_CHAT)


def test_fallback_thinking(tok):
    assert tok.apply_chat_template(SYSTEM_CHAT[:2], enable_thinking=True) == (
        "<bos><|turn>system\n<|think|>You are terse.<turn|>\n<|turn>user\nHi!<turn|>\n<|turn>model\n"
    )
    # no system message: a system turn holding only <|think|> is created
    assert tok.apply_chat_template([{"role": "user", "content": "Hi!"}], enable_thinking=True) == (
        "<bos><|turn>system\n<|think|><turn|>\n<|turn>user\nHi!<turn|>\n<|turn>model\n"
    )
    assert tok.apply_chat_template([{"role": "user", "content": "Hi!"}]) == (
        "<bos><|turn>user\nHi!<turn|>\n<|turn>model\n<|channel>thought\n<channel|>"
    )


def test_fallback_uses_config_bos(make_dir):
    tok = Tokenizer.from_pretrained(make_dir({"bos_token": "<|channel>"}))
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]).startswith("<|channel><|turn>user\n")


def test_encode_chat_special_tokens_are_single_ids(tok):
    text = tok.apply_chat_template(SYSTEM_CHAT)
    ids = tok.encode_chat(SYSTEM_CHAT)
    specials = {s: tok.token_to_id(s) for s in SPECIALS}
    assert ids[0] == specials["<bos>"] and ids.count(specials["<bos>"]) == 1
    assert ids.count(specials["<|turn>"]) == 5 and ids.count(specials["<turn|>"]) == 4
    assert ids[-3:] == tok.encode("<|channel>thought\n<channel|>")[-3:]
    assert ids.count(specials["<|channel>"]) == 1 and ids.count(specials["<channel|>"]) == 1
    assert tok.encode("<|think|>") == [specials["<|think|>"]]
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == text.replace("<bos>", "").replace("<|turn>", "").replace("<turn|>", "").replace(
        "<|channel>", ""
    ).replace("<channel|>", "")


# ---------------------------------------------------------------------- checkpoint templates

CUSTOM = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' and not loop.first %}{{ raise_exception('system must come first') }}{% endif %}"
    "[{{ m['role'] }}]{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endif %}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}[model]{% if enable_thinking %}<|think|>{% endif %}{% endif %}"
)


def test_custom_template_from_config(make_dir):
    tok = Tokenizer.from_pretrained(make_dir({"chat_template": CUSTOM, "eos_token": "<eos>"}))
    assert tok.chat_template == CUSTOM
    assert tok.apply_chat_template(SYSTEM_CHAT[:2]) == "<bos>[system]You are terse.<eos>\n[user]Hi!<eos>\n[model]"
    assert (
        tok.apply_chat_template(SYSTEM_CHAT[3:], enable_thinking=True)
        == "<bos>[user]How are you?<eos>\n[model]<|think|>"
    )
    assert tok.apply_chat_template(SYSTEM_CHAT[1:2], add_generation_prompt=False) == "<bos>[user]Hi!<eos>\n"
    ids = tok.encode_chat(SYSTEM_CHAT[1:2], enable_thinking=True)
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.token_to_id("<|think|>")


def test_trim_blocks_and_helpers(make_dir):
    template = (
        "{% for m in messages %}\n  {% if loop.index > 1 %}{% break %}{% endif %}\n"
        "{{ m | tojson }}|{{ strftime_now('%Y') | length }}\n{% endfor %}\n"
        "{% set ns = namespace(n=0) %}{% set ns.n = ns.n + 1 %}{{ ns.n }}"
    )
    tok = Tokenizer.from_pretrained(make_dir(jinja=template))
    out = tok.apply_chat_template([{"role": "user", "content": "é"}, {"role": "user", "content": "2"}])
    assert out == '{"role": "user", "content": "é"}|4\n1'


# The built-in format written as a Gemma 4 style template: the sandboxed path must render it identically.
GEMMA4_JINJA = r"""{{- bos_token -}}
{% if enable_thinking or messages[0]['role'] == 'system' %}
{{- '<|turn>system\n' -}}{% if enable_thinking %}{{- '<|think|>' -}}{% endif %}
{% if messages[0]['role'] == 'system' %}{{- messages[0]['content'] -}}{% endif %}
{{- '<turn|>\n' -}}
{% endif %}
{% for message in messages %}
{% if message['role'] != 'system' %}
{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}
{{- '<|turn>' + role + '\n' -}}
{% if message['content'] is string %}{{- message['content'] -}}{% else %}
{% for part in message['content'] %}{{- part['text'] -}}{% endfor %}
{% endif %}
{{- '<turn|>\n' -}}
{% endif %}
{% endfor %}
{% if add_generation_prompt %}
{{- '<|turn>model\n' -}}{% if not enable_thinking %}{{- '<|channel>thought\n<channel|>' -}}{% endif %}
{% endif %}
"""


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("gen", [False, True])
@pytest.mark.parametrize("chat", [SYSTEM_CHAT, SYSTEM_CHAT[1:]])
def test_gemma4_style_template_equals_fallback(tok, make_dir, chat, gen, thinking):
    templated = Tokenizer.from_pretrained(make_dir(jinja=GEMMA4_JINJA))
    assert templated.apply_chat_template(chat, gen, thinking) == tok.apply_chat_template(chat, gen, thinking)


def test_jinja_file_takes_precedence(make_dir):
    tok = Tokenizer.from_pretrained(make_dir({"chat_template": CUSTOM}, jinja="JINJA{{ messages | length }}"))
    assert tok.apply_chat_template(SYSTEM_CHAT) == "JINJA4"


def test_config_template_list(make_dir):
    tok = Tokenizer.from_pretrained(
        make_dir({"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]})
    )
    assert tok.apply_chat_template(SYSTEM_CHAT) == "D"
    with pytest.raises(ValueError, match="default"):
        Tokenizer.from_pretrained(make_dir({"chat_template": [{"name": "x", "template": "T"}]}))


def test_raise_exception_is_value_error(make_dir):
    tok = Tokenizer.from_pretrained(make_dir({"chat_template": CUSTOM}))
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert tok.apply_chat_template(bad)  # fine
    tok2 = Tokenizer.from_pretrained(make_dir(jinja="{{ raise_exception('roles must alternate') }}"))
    with pytest.raises(ValueError, match="roles must alternate"):
        tok2.apply_chat_template(bad)


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ cycler.__init__.__globals__ }}",
        "{{ raise_exception.__globals__['os'] }}",
        "{% set _ = messages.append({'role': 'user', 'content': 'x'}) %}ok",
        "{{ messages[0].update({'role': 'hacked'}) }}",
        "{% set _ = messages[0]['content'].clear() %}ok",
        "{% set ns = namespace() %}{% set ns._x = 1 %}",
    ],
)
def test_sandbox_blocks_escapes_and_mutation(make_dir, template):
    tok = Tokenizer.from_pretrained(make_dir(jinja=template))
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    with pytest.raises(ValueError, match="chat template"):
        tok.apply_chat_template(messages)
    assert messages == [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]


def test_template_cannot_touch_callers_objects(make_dir):
    # even with a sandbox, the template only ever sees a plain JSON copy of the messages
    tok = Tokenizer.from_pretrained(make_dir(jinja="{{ messages[0]['extra'] }}"))
    assert tok.apply_chat_template([{"role": "user", "content": "x", "extra": {"a": [1]}}]) == "{'a': [1]}"
    with pytest.raises(ValueError, match="JSON"):
        tok.apply_chat_template([{"role": "user", "content": "x", "extra": object()}])


def test_template_syntax_error_names_file(make_dir):
    with pytest.raises(ValueError, match=r"chat_template\.jinja"):
        Tokenizer.from_pretrained(make_dir(jinja="{% for m in messages %}"))
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: chat_template"):
        Tokenizer.from_pretrained(make_dir({"chat_template": "{{ x "}))


# ---------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "messages, exc, match",
    [
        ([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}], ValueError, r"messages\[1\]\.role"),
        ([{"content": "a"}], ValueError, r"messages\[0\]\.role"),
        ([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}], ValueError, r"messages\[1\]\.role"),
        (
            [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image", "url": "x.png"}]}],
            NotImplementedError,
            r"messages\[0\]\.content\[1\]\.type",
        ),
        ([{"role": "user"}], ValueError, r"messages\[0\]\.content"),
        ([{"role": "user", "content": 3}], ValueError, r"messages\[0\]\.content"),
        (
            [{"role": "user", "content": [{"type": "text", "text": None}]}],
            ValueError,
            r"messages\[0\]\.content\[0\]\.text",
        ),
        ([{"role": "user", "content": ["a"]}], ValueError, r"messages\[0\]\.content\[0\]"),
        (["hello"], ValueError, r"messages\[0\]"),
        ([], ValueError, "messages"),
    ],
)
def test_message_validation(tok, make_dir, messages, exc, match):
    templated = Tokenizer.from_pretrained(make_dir({"chat_template": CUSTOM}))
    for t in (tok, templated):
        with pytest.raises(exc, match=match):
            t.apply_chat_template(messages)
        with pytest.raises(exc, match=match):
            t.encode_chat(messages)


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        Tokenizer.from_pretrained(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        Tokenizer.from_pretrained(tmp_path)


def test_garbled_files(make_dir, tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        Tokenizer.from_pretrained(tmp_path)
    d = make_dir()
    (d / "tokenizer_config.json").write_text("{bos_token: <bos>")
    with pytest.raises(ValueError, match=r"tokenizer_config\.json"):
        Tokenizer.from_pretrained(d)
    with pytest.raises(ValueError, match="bos_token"):
        Tokenizer.from_pretrained(make_dir({"bos_token": "<s>"}))
    with pytest.raises(ValueError, match="eos_token"):
        Tokenizer.from_pretrained(make_dir({"eos_token": 5}))
    with pytest.raises(ValueError, match="add_bos_token"):
        Tokenizer.from_pretrained(make_dir({"add_bos_token": "yes"}))


# ---------------------------------------------------------------------- streaming

STREAM_TEXT = "Grüße 🦊🇫🇷 — naïve 日本語 done ✓ 👩‍👩‍👧!"


def _splits(n: int, rng: random.Random):
    yield [1] * n
    yield [2] * (n // 2 + 1)
    yield [3] * (n // 3 + 1)
    for _ in range(20):
        yield [rng.randint(1, 5) for _ in range(n)]


def test_incremental_decoder_matches_full_decode(tok):
    ids = tok.encode(STREAM_TEXT)
    # the test is only meaningful if some characters span several tokens
    assert any("\ufffd" in tok.decode(ids[:k]) for k in range(1, len(ids)))
    rng = random.Random(0)
    for sizes in _splits(len(ids), rng):
        dec, pos = IncrementalDecoder(tok), 0
        for size in sizes:
            if pos >= len(ids):
                break
            delta = dec.push(ids[pos : pos + size])
            pos += size
            assert "\ufffd" not in delta
            assert STREAM_TEXT.startswith(dec.text)
        assert "\ufffd" not in dec.flush()
        assert dec.text == STREAM_TEXT == tok.decode(ids)
        assert dec.token_ids == ids


def test_incremental_decoder_special_tokens(tok):
    ids = tok.encode_chat([{"role": "user", "content": STREAM_TEXT}])
    for skip in (True, False):
        dec = IncrementalDecoder(tok, skip_special_tokens=skip)
        deltas = [dec.push([i]) for i in ids] + [dec.flush()]
        assert "".join(deltas) == dec.text == tok.decode(ids, skip_special_tokens=skip)
        assert not any("\ufffd" in d for d in deltas)


def test_incremental_decoder_incomplete_tail(tok):
    ids = tok.encode("ok 🦊")
    fox_bytes = len(tok.encode("🦊"))
    assert fox_bytes >= 2  # the fox is split into byte tokens by this small vocabulary
    dec = IncrementalDecoder(tok)
    assert dec.push(ids[:-1]) == "ok "  # the fox's bytes are held back
    assert dec.push([]) == ""
    assert dec.flush() == "\ufffd"  # never completed: released at end of stream, as a full decode gives
    assert dec.text == tok.decode(ids[:-1])
    dec = IncrementalDecoder(tok)
    assert dec.push(ids[:-1]) + dec.push(ids[-1:]) + dec.flush() == "ok 🦊"


class _CountingTokenizer:
    """Wraps a tokenizer and records the longest id list it was asked to decode."""

    def __init__(self, tok):
        self.tok, self.longest = tok, 0

    def decode(self, ids, skip_special_tokens=True):
        self.longest = max(self.longest, len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


class _FullDecodeTracker(OutputTracker):
    """The reference: the output rules over a full decode of everything so far at every question."""

    def _text_with(self, toks):
        return self.tokenizer.decode(self._text_ids(self.token_ids + toks), skip_special_tokens=True)


@pytest.mark.parametrize("stop", [(), ("🦊",), ("日本", "xyz"), ("e d", "✓ 👩")])
def test_output_tracker_windowed_text_equals_full_decode(tok, stop):
    """OutputTracker's windowed decoding gives the same tokens, deltas, text and finish reason as full decodes,
    for every block split, with stop strings that span tokens, blocks and multi-byte characters, and EOS ids
    (1) that are excluded from the text; its decodes stay the size of a window."""
    ids = tok.encode(STREAM_TEXT * 3)
    rng = random.Random(1)
    for sizes in _splits(len(ids), rng):
        stream = list(ids)
        for _ in range(2):  # an EOS inside the stream, ignored (ignore_eos) so that generation goes on
            stream.insert(rng.randrange(len(stream)), 1)
        counting = _CountingTokenizer(tok)
        fast = OutputTracker(10_000, frozenset({1}), True, stop, counting)
        ref = _FullDecodeTracker(10_000, frozenset({1}), True, stop, tok)
        pos = 0
        for size in sizes:
            if pos >= len(stream) or ref.finish_reason is not None:
                break
            block = stream[pos : pos + size]
            pos += size
            assert fast.add_block(block) == ref.add_block(block)
            assert (fast.text, fast.token_ids, fast.finish_reason) == (ref.text, ref.token_ids, ref.finish_reason)
        assert counting.longest <= 2 * max(sizes) + 2 * IncrementalDecoder.MAX_HOLD


# ---------------------------------------------------------------------- bounded work


def test_max_token_bytes_bounds_every_token(tok, tokenizer_json):
    """The bound is the longest vocabulary entry (in UTF-8 bytes, at least 4), and no token of real text covers
    more input bytes than it."""
    from tokenizers import Tokenizer as HFTokenizer

    vocab = HFTokenizer.from_file(str(tokenizer_json)).get_vocab(with_added_tokens=True)
    assert tok.max_token_bytes == max(4, max(len(t.encode()) for t in vocab))
    text = " ".join(TEXTS + CORPUS)
    enc = tok._tok.encode(text, add_special_tokens=False)
    assert max(len(text[a:b].encode()) for a, b in enc.offsets) <= tok.max_token_bytes


def test_no_byte_bound_where_text_can_vanish(tokenizer_json):
    """Pipelines that may delete input (whitespace splitting, Strip) or fold any word into one token (WordLevel)
    have no bound per token."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, normalizers, pre_tokenizers

    from dgserve.text.token_bounds import max_token_bytes

    split = HFTokenizer.from_file(str(tokenizer_json))
    split.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    strip = HFTokenizer.from_file(str(tokenizer_json))
    strip.normalizer = normalizers.Strip()
    word = HFTokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    assert [max_token_bytes(t) for t in (split, strip, word)] == [None, None, None]
    spaced = HFTokenizer.from_file(str(tokenizer_json))
    spaced.normalizer = normalizers.Sequence([normalizers.Replace(" ", "\u2581"), normalizers.NFC()])
    assert max_token_bytes(spaced) == 4 * max_token_bytes(HFTokenizer.from_file(str(tokenizer_json)))


def test_encode_with_max_tokens_is_exact_at_the_limit(tok):
    text = CORPUS[0]
    n = len(tok.encode(text, add_special_tokens=True))
    assert tok.encode(text, add_special_tokens=True, max_tokens=n) == tok.encode(text, add_special_tokens=True)
    with pytest.raises(ValueError, match=rf"^prompt: at least {n} tokens \(counted\), more than the {n - 1}"):
        tok.encode(text, add_special_tokens=True, max_tokens=n - 1)


def test_huge_text_is_rejected_by_its_length_without_tokenizing(tok, monkeypatch):
    calls = []
    monkeypatch.setattr(tok, "_tok", _Spy(tok._tok, calls))
    text = "word " * 3_000_000  # 15 MB
    with pytest.raises(ValueError, match=r"^prompt: at least \d+ tokens \(15000000 bytes, a token covers at most"):
        tok.encode(text, max_tokens=4096)
    with pytest.raises(ValueError, match=r"^prompt: at least \d+ tokens \(150000\d\d bytes"):
        tok.encode_chat([{"role": "user", "content": text}], max_tokens=4096)
    assert calls == []


def test_long_text_without_byte_bound_is_counted_in_bounded_chunks(tok, monkeypatch):
    """With no byte bound (here: forced), a text over the limit is counted chunk by chunk and rejected after the
    first chunks: the tokenizer never sees it whole."""
    from dgserve.text.token_bounds import COUNT_CHUNK_CHARS

    calls = []
    monkeypatch.setattr(tok, "_tok", _Spy(tok._tok, calls))
    tok.max_token_bytes = None
    text = " ".join(CORPUS) * 2000  # ~1.5 MB
    with pytest.raises(ValueError, match=r"counted in the first 1 chunks"):
        tok.encode(text, max_tokens=1000)
    assert len(calls) == 1 and max(calls) <= COUNT_CHUNK_CHARS
    fits = " ".join(CORPUS) * 300  # ~100 k characters: counted, then encoded whole
    calls.clear()
    assert tok.encode(fits, max_tokens=10**6) == tok._tok.encode(fits, add_special_tokens=False).ids
    assert calls[-2:] == [len(fits)] * 2 and max(calls[:-2]) <= COUNT_CHUNK_CHARS  # chunks, whole, reference


class _Spy:
    """A tokenizers.Tokenizer stand-in recording the length of every text encoded."""

    def __init__(self, tok, calls: list):
        self._tok, self._calls = tok, calls

    def encode(self, text, **kw):
        self._calls.append(len(text))
        return self._tok.encode(text, **kw)

    def __getattr__(self, name):
        return getattr(self._tok, name)


def test_a_templates_image_token_is_where_the_image_goes():
    """A checkpoint's template writes the image token's text (``<|image|>``) for an image part, as Gemma 4's do;
    encode_chat splices the image's run there, as transformers' processor expands it. The same text typed by the
    caller stays text: it is no image place (a count mismatch, a 400)."""
    small = pathlib.Path(__file__).resolve().parents[1] / "python" / "dgserve" / "models" / "small"
    tok = Tokenizer.from_pretrained(small)
    run = [190] + [191] * 5 + [192]
    chat = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "see"}, {"type": "image"}, {"type": "text", "text": "ok"}],
        }
    ]
    ids = tok.encode_chat(chat, image_runs=[run])
    at = ids.index(190)
    assert ids[at : at + len(run)] == run and ids.count(191) == 5
    plain = tok.encode_chat([{"role": "user", "content": "see ok"}])
    assert len(ids) > len(plain)
    typed = [{"role": "user", "content": [{"type": "text", "text": "see <|image|>"}, {"type": "image"}]}]
    assert tok.encode_chat(typed, image_runs=[run]).count(191) == 5
    with pytest.raises(ValueError, match="image"):
        tok.encode_chat([{"role": "user", "content": "see <|image|>"}], image_runs=[run])
