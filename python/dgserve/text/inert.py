"""Content stays content: a chat's text never becomes control tokens (docs/architecture.md, "Content is content").

A chat prompt is one string rendered by the chat template, and tokenizing it the usual way turns every special-token
text in it into that token: `<|turn>` typed by a user, or returned inside a tool result's JSON, would open a real
turn. Here only the template writes control tokens. Every string the caller supplied (message content, reasoning,
tool call names, ids and arguments, tool declarations: keys and values alike) is *defanged* before rendering: each
character that begins or ends a special token's text (``<`` and ``>`` for Gemma's markers) is swapped for a private
use character, a sentinel that occurs in no caller string. No special token's text can then overlap caller text in
the rendered prompt, so the special tokens the tokenizer finds there are the template's. Between two of them, a run
that holds sentinels is put back (sentinels → the original characters) and encoded with special-token parsing off;
every other run keeps the ids the tokenizer gave it.

Exactness: ``tokenizers`` splits a text at its added tokens first and encodes each piece between them on its own,
so a run encoded alone gets the ids it gets inside the whole prompt: a conversation with no special-token text in its
content gets exactly the ids of the plain path, and one with such text differs only inside the runs holding it (where
the marker is now ordinary text, BPE merges across it included). A template that inspects content for markers (say,
to strip thinking from history) no longer sees them: they are text.

Control tokens are the tokenizer's added tokens marked ``special``; added tokens that are not (ordinary vocabulary
additions) are matched in content as before.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import tokenizers

_PRIVATE_USE = range(0xE000, 0xF900)  # Unicode's private use area: sentinels are picked from here


class SpecialTokens:
    """The special tokens of one tokenizer, and a copy of it that encodes their texts as ordinary text."""

    def __init__(self, tok: tokenizers.Tokenizer):
        added = tok.get_added_tokens_decoder()
        self.ids = frozenset(i for i, t in added.items() if t.special)
        self.texts = tuple(sorted({t.content for t in added.values() if t.special and t.content}))
        self.edges = frozenset(c for t in self.texts for c in (t[0], t[-1]))  # the characters to defang
        self.plain = tokenizers.Tokenizer.from_str(tok.to_str())
        self.plain.encode_special_tokens = True

    def needs_defang(self, strings: Iterable[str]) -> bool:
        """Whether any caller string holds a character that could be part of a special token's edge."""
        return bool(self.edges) and any(c in s for s in strings for c in self.edges)

    def sentinels(self, strings: list[str]) -> dict[str, str]:
        """{edge character: sentinel}: private use characters that occur in none of ``strings`` (the caller's
        strings and the template's source) and in no special token's text."""
        used = set().union(*map(set, strings), *map(set, self.texts)) if strings else set()
        free = (chr(c) for c in _PRIVATE_USE if chr(c) not in used)
        out = {}
        for edge in sorted(self.edges):
            sentinel = next(free, None)
            if sentinel is None:  # 6,400 distinct private use characters in one prompt
                raise ValueError("messages: too many distinct private use characters in the conversation")
            out[edge] = sentinel
        return out

    def encode(self, tok: tokenizers.Tokenizer, text: str, restore: dict[str, str]) -> list[int]:
        """Ids of a prompt rendered from defanged strings (module docstring): ``tok``'s ids, except the runs
        between special tokens that hold a sentinel, which are put back and encoded as ordinary text."""
        enc = tok.encode(text, add_special_tokens=False)
        table = str.maketrans(restore)
        sentinels = set(restore)
        out: list[int] = []
        run: list[int] = []  # ids of the current run between special tokens
        start = 0  # where the current run starts in text

        def close(end: int) -> None:
            piece = text[start:end]
            if any(c in piece for c in sentinels):
                out.extend(self.plain.encode(piece.translate(table), add_special_tokens=False).ids)
            else:
                out.extend(run)
            run.clear()

        for tid, (s, e) in zip(enc.ids, enc.offsets, strict=True):
            if tid in self.ids:
                close(s)
                out.append(tid)
                start = e
            else:
                run.append(tid)
        close(len(text))
        return out


def caller_strings(value: Any) -> list[str]:
    """Every string in plain JSON data (dict keys included)."""
    out: list[str] = []
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            out.append(v)
        elif isinstance(v, dict):
            out.extend(k for k in v if isinstance(k, str))
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return out


def defang(value: Any, swap: dict[str, str]) -> Any:
    """A copy of plain JSON data with the characters of ``swap`` replaced in every string (dict keys included).
    Iterative: nesting as deep as the caller's JSON may be costs no stack."""
    table = str.maketrans(swap)

    def copy(v: Any) -> Any:
        if isinstance(v, str):
            return v.translate(table)
        if isinstance(v, dict):
            out: Any = {}
            todo.append((v, out))
            return out
        if isinstance(v, list):
            out = []
            todo.append((v, out))
            return out
        return v

    todo: list[tuple[Any, Any]] = []
    root = copy(value)
    while todo:
        src, dst = todo.pop()
        if isinstance(src, dict):
            for k, v in src.items():
                dst[k.translate(table) if isinstance(k, str) else k] = copy(v)
        else:
            dst.extend(copy(v) for v in src)
    return root
