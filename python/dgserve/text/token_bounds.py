"""How many tokens a text can have, bounded without tokenizing it whole (without it, a 15 MB prompt took 9.5 s
and 1.6 GB to tokenize before its length was checked).

`max_token_bytes(tokenizer)`: the most input bytes one token of a `tokenizers.Tokenizer` can cover, so a text of
B bytes has at least B / max_token_bytes tokens; None for pipelines with no such bound. `chunks` cuts a long text
into pieces whose token counts add up to (nearly) the whole's. `Tokenizer.encode(..., max_tokens=n)` uses both.
"""

from __future__ import annotations

import json

import tokenizers

COUNT_CHUNK_CHARS = 1 << 16  # texts longer than this are counted chunk by chunk before being encoded whole


class ContextLengthError(ValueError):
    """A prompt that does not fit the context: ``tokens`` prompt tokens (a lower bound when ``at_least``: bounded
    counting stopped early) against ``maximum``, the most prompt tokens that fit. Each door says it in its API's
    recognisable shape, with both numbers (docs/messages-api.md, "Errors"; docs/architecture.md, "Failures")."""

    def __init__(self, message: str, tokens: int, maximum: int, at_least: bool = False):
        super().__init__(message)
        self.tokens, self.maximum, self.lower_bound = tokens, maximum, at_least


class PromptTooLongError(ContextLengthError):
    """The text has more than `limit` tokens; `at_least` is a lower bound on how many it has."""

    def __init__(self, at_least: int, limit: int, how: str):
        super().__init__(
            f"prompt: at least {at_least} tokens ({how}), more than the {limit} that fit", at_least, limit, True
        )
        self.at_least, self.limit = at_least, limit


def chunks(text: str, size: int):
    """Pieces of about `size` characters, cut before a space where one is near (a token boundary for the usual
    pre-tokenizers, so the counts of the pieces add up to the count of the whole, or nearly)."""
    start = 0
    while start < len(text):
        end = min(len(text), start + size)
        if end < len(text):
            space = text.rfind(" ", start + size // 2, end)
            end = space if space > start else end
        yield text[start:end]
        start = end


# how much each normalizer can shrink text, in bytes (None: without bound, e.g. by deleting characters)
_UNICODE_FORMS = {"NFC", "NFD", "NFKC", "NFKD"}


def _normalizer_shrink(spec: dict | None) -> float | None:
    if spec is None:
        return 1.0
    kind = spec.get("type")
    if kind == "Sequence":
        factor = 1.0
        for part in spec.get("normalizers", []):
            f = _normalizer_shrink(part)
            if f is None:
                return None
            factor *= f
        return factor
    if kind == "Prepend":
        return 1.0
    if kind in _UNICODE_FORMS or kind == "Lowercase":
        return 4.0  # a code point of up to 4 bytes becomes at least one byte (e.g. fullwidth forms)
    if kind == "Replace" and "String" in spec.get("pattern", {}) and spec.get("content"):
        return max(1.0, len(spec["pattern"]["String"].encode()) / len(spec["content"].encode()))
    return None  # Strip, StripAccents, Bert's clean_text, regex replacements: may delete any amount


_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts", "Split"}


def _pre_tokenizer_keeps(spec: dict | None) -> bool:
    if spec is None:
        return True
    if spec.get("type") == "Sequence":
        return all(_pre_tokenizer_keeps(p) for p in spec.get("pretokenizers", []))
    return spec.get("type") in _KEEPING_PRE_TOKENIZERS and spec.get("behavior") != "Removed"


def max_token_bytes(tok: tokenizers.Tokenizer) -> int | None:
    """The most bytes of input text one token can cover, or None when this tokenizer has no such bound.

    A BPE token covers at most the bytes of its vocabulary entry (byte-level and SentencePiece entries spell one
    input byte with one or more bytes, so the entry's UTF-8 length is an upper bound); an added token covers its
    content; an unknown character is one token of at most 4 bytes. A normalizer may shrink text before that
    (by the factor `_normalizer_shrink` allows); pre-tokenizers that drop text (whitespace splitting), fused
    unknowns and the other models (a WordLevel [UNK] covers any word) have no bound, so they get None.
    """
    model = tok.model
    if type(model).__name__ != "BPE" or (model.unk_token and model.fuse_unk):
        return None
    shrink = _normalizer_shrink(None if tok.normalizer is None else json.loads(tok.normalizer.__getstate__()))
    keeps = _pre_tokenizer_keeps(None if tok.pre_tokenizer is None else json.loads(tok.pre_tokenizer.__getstate__()))
    if shrink is None or not keeps:
        return None
    longest = max((len(t.encode()) for t in tok.get_vocab(with_added_tokens=True)), default=1)
    return int(max(longest, 4) * shrink + 0.999)
