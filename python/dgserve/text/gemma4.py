"""Gemma 4's tool and reasoning syntax: the markers, the built-in format's tool pieces, and a reader for Gemma's
native argument syntax (docs/tools.md).

Gemma 4 frames everything about tools with marker pairs: declarations in the system turn
(``<|tool>declaration:NAME{...}<tool|>``), calls in the model's turn (``<|tool_call>call:NAME{...}<tool_call|>``)
and results right after them (``<|tool_response>response:NAME{...}<tool_response|>``); reasoning is a channel
(``<|channel>thought\\n...<channel|>``). The braces hold the body. Gemma's own templates write bodies in its native
key:value syntax (bare keys, strings between ``<|"|>`` delimiters); dgserve's built-in format writes every body as
compact JSON, the syntax the tool grammar makes the model write (so arguments validate against the JSON schema
exactly), and reads either back (``read_native``).

Pure Python, no imports from the rest of dgserve: the tokenizer, the tool grammar and the output parsers share
these names.
"""

from __future__ import annotations

import json
import re
from typing import Any

TOOL_CALL_BEGIN, TOOL_CALL_END = "<|tool_call>", "<tool_call|>"
TOOL_RESPONSE_BEGIN, TOOL_RESPONSE_END = "<|tool_response>", "<tool_response|>"
TOOL_BEGIN, TOOL_END = "<|tool>", "<tool|>"
CHANNEL_BEGIN, CHANNEL_END = "<|channel>", "<channel|>"
THOUGHT = "thought\n"  # the reasoning channel's name line, right after CHANNEL_BEGIN
CALL_PREFIX = "call:"  # a call body: CALL_PREFIX + name + {arguments}
NATIVE_QUOTE = '<|"|>'  # Gemma's native string delimiter (both ends; no escapes inside)
MAX_NATIVE_DEPTH = 64  # nesting of a native-syntax value read back (objects and arrays)


def compact_json(value: Any) -> str:
    """``value`` as compact JSON (no whitespace, non-ASCII kept): how the built-in format writes bodies."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def declaration(tool: dict) -> str:
    """One tool declaration of the system turn, for an OpenAI-shaped tool ``{"type": "function", "function":
    {"name", "description", "parameters"}}``: ``<|tool>declaration:NAME{"description":…,"parameters":…}<tool|>``."""
    fn = tool["function"]
    body = {"description": fn.get("description") or "", "parameters": fn.get("parameters") or {}}
    return f"{TOOL_BEGIN}declaration:{fn['name']}{compact_json(body)}{TOOL_END}"


def tool_call(call: dict) -> str:
    """One call of an assistant message, for a validated ``{"id", "type", "function": {"name", "arguments"}}``
    (arguments a dict, or text that is not a JSON object, written as it came): ``<|tool_call>call:NAME{…}<tool_call|>``,
    the text the model writes for it."""
    fn = call["function"]
    args = fn["arguments"]
    body = args if isinstance(args, str) else compact_json(args)
    return f"{TOOL_CALL_BEGIN}{CALL_PREFIX}{fn['name']}{body}{TOOL_CALL_END}"


def tool_response(name: str, text: str) -> str:
    """One tool result: ``<|tool_response>response:NAME{"value":TEXT}<tool_response|>`` (TEXT as a JSON string)."""
    return f"{TOOL_RESPONSE_BEGIN}response:{name}{compact_json({'value': text})}{TOOL_RESPONSE_END}"


def thought(text: str) -> str:
    """A reasoning channel holding ``text`` (how an assistant message's reasoning_content is written back)."""
    return f"{CHANNEL_BEGIN}{THOUGHT}{text}\n{CHANNEL_END}"


def partial_marker(text: str, marker: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``marker`` (0 if none): how much of
    a streamed text to hold back because it may still grow into the marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


# ---------------------------------------------------------------------- reading the native syntax

_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_KEY = re.compile(r"[^\s:{}\[\],]+")
_WORDS = {"true": True, "false": False, "null": None}


def read_native(body: str) -> Any:
    """The value of a call body written in Gemma's native syntax (or JSON, or a mix), e.g.
    ``{location:<|"|>Paris<|"|>,days:3,tags:[<|"|>a<|"|>]}`` → ``{"location": "Paris", "days": 3, "tags": ["a"]}``.

    Keys are bare (up to the ``:``) or quoted (``<|"|>k<|"|>`` or JSON ``"k"``); strings are ``<|"|>…<|"|>``
    (taken verbatim) or JSON strings; numbers, true, false and null as in JSON; objects and arrays nest up to
    MAX_NATIVE_DEPTH levels. Whitespace between items is skipped. ValueError on anything else or on trailing text.
    """
    reader = _NativeReader(body)
    value = reader.value(0)
    reader.skip_space()
    if reader.pos != len(body):
        raise ValueError(f"unexpected text at character {reader.pos}")
    return value


class _NativeReader:
    def __init__(self, text: str):
        self.text, self.pos = text, 0

    def skip_space(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1

    def fail(self, what: str) -> ValueError:
        return ValueError(f"{what} at character {self.pos}")

    def value(self, depth: int) -> Any:
        self.skip_space()
        t, p = self.text, self.pos
        if p >= len(t):
            raise self.fail("a value is missing")
        if t.startswith(NATIVE_QUOTE, p) or t[p] == '"':
            return self.string()
        if t[p] in "{[":
            if depth >= MAX_NATIVE_DEPTH:
                raise self.fail(f"nesting deeper than {MAX_NATIVE_DEPTH} levels")
            return self.object(depth) if t[p] == "{" else self.array(depth)
        m = _NUMBER.match(t, p)
        if m:
            self.pos = m.end()
            return json.loads(m.group())
        for word, v in _WORDS.items():
            if t.startswith(word, p):
                self.pos += len(word)
                return v
        raise self.fail("not a value")

    def string(self) -> str:
        t, p = self.text, self.pos
        if t.startswith(NATIVE_QUOTE, p):
            end = t.find(NATIVE_QUOTE, p + len(NATIVE_QUOTE))
            if end < 0:
                raise self.fail("an unterminated string")
            self.pos = end + len(NATIVE_QUOTE)
            return t[p + len(NATIVE_QUOTE) : end]
        try:
            s, self.pos = json.JSONDecoder().raw_decode(t, p)
        except ValueError:
            raise self.fail("a bad JSON string") from None
        return s

    def key(self) -> str:
        self.skip_space()
        t, p = self.text, self.pos
        if t.startswith(NATIVE_QUOTE, p) or (p < len(t) and t[p] == '"'):
            return self.string()
        m = _KEY.match(t, p)
        if not m:
            raise self.fail("a key is missing")
        self.pos = m.end()
        return m.group()

    def expect(self, ch: str) -> bool:
        """Skip whitespace; consume ``ch`` when it is next (True), else leave the position (False)."""
        self.skip_space()
        if self.pos < len(self.text) and self.text[self.pos] == ch:
            self.pos += 1
            return True
        return False

    def object(self, depth: int) -> dict:
        self.pos += 1  # {
        out: dict = {}
        if self.expect("}"):
            return out
        while True:
            k = self.key()
            if not self.expect(":"):
                raise self.fail("':' is missing")
            out[k] = self.value(depth + 1)
            if self.expect("}"):
                return out
            if not self.expect(","):
                raise self.fail("',' or '}' is missing")

    def array(self, depth: int) -> list:
        self.pos += 1  # [
        out: list = []
        if self.expect("]"):
            return out
        while True:
            out.append(self.value(depth + 1))
            if self.expect("]"):
                return out
            if not self.expect(","):
                raise self.fail("',' or ']' is missing")
