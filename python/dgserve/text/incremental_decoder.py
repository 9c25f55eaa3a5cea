"""Streaming detokenization: text deltas of a token stream, fed block by block (docs/architecture.md, "The life of
a request").

Contract: `IncrementalDecoder(tokenizer).push(ids)` returns the text that became final; the deltas never end inside
a multi-byte character, and after `flush()` their concatenation equals ``tokenizer.decode(all_ids)``. The
tokenizer needs only ``decode(ids, skip_special_tokens=...)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class IncrementalDecoder:
    """Text deltas of a token stream, fed block by block.

    `push(ids)` returns the text that became final; the concatenation of all deltas is `text`. A delta never ends
    inside a multi-byte UTF-8 character: text whose last character is U+FFFD (an incomplete sequence so far) is
    held back until later tokens complete it, looking back at most `MAX_HOLD` tokens. `flush()` releases what is
    held, U+FFFD included when the bytes never complete, so that after it `text == tokenizer.decode(all_ids,
    skip_special_tokens)`. Each push decodes only a window from the previous block on (vLLM's prefix/read offsets),
    which also keeps decoders that treat the first token specially consistent. `text_with(ids)` is the full text
    the stream would have with `ids` appended, from the same window, without pushing them.

    `tokenizer` needs only `decode(ids, skip_special_tokens=...)`.
    """

    MAX_HOLD = 8  # tokens; a UTF-8 character has at most 4 bytes, each token at least one

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # ids[_prefix:_read] is the context already emitted, re-decoded for continuity
        self._read = 0  # ids[:_read] are emitted
        self._seen = ""  # decode(ids[_prefix:_read])
        self._text = ""

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return self._text

    @property
    def token_ids(self) -> list[int]:
        """All ids pushed so far."""
        return list(self._ids)

    def push(self, ids: Iterable[int]) -> str:
        """Append `ids`; return the newly final text ("" when nothing is final yet)."""
        self._ids.extend(int(i) for i in ids)
        for end in range(len(self._ids), max(self._read, len(self._ids) - self.MAX_HOLD), -1):
            new = self._decode(self._prefix, end)
            if len(new) > len(self._seen) and not new.endswith("\ufffd"):
                return self._emit(new, end)
        return ""

    def flush(self) -> str:
        """Emit everything still held (end of stream) and return it."""
        if self._read == len(self._ids):
            return ""
        return self._emit(self._decode(self._prefix, len(self._ids)), len(self._ids))

    def text_with(self, ids: Sequence[int]) -> str:
        """decode(pushed ids + `ids`), held-back bytes included (U+FFFD where still incomplete); pushes nothing.
        Costs one decode of the window from the previous emit on, not of the whole stream."""
        window = self._ids[self._prefix :] + [int(i) for i in ids]
        decoded = self._tokenizer.decode(window, skip_special_tokens=self._skip)
        return self._text + decoded[len(self._seen) :]

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip)

    def _emit(self, window_text: str, end: int) -> str:
        """Emit decode(ids[_prefix:end]) beyond what was seen; the emitted span becomes the next context."""
        delta = window_text[len(self._seen) :]
        self._prefix, self._read = self._read, end
        self._seen = self._decode(self._prefix, self._read)
        self._text += delta
        return delta
