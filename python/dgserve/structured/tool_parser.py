"""Tool calls out of the model's text (docs/tools.md, "The output"): Gemma 4's
``<|tool_call>call:NAME{...}<tool_call|>`` to OpenAI's tool calls, all at once (``parse_tool_calls``) or block by
block (``ToolCallParser``).

The incremental parser is fed the committed text in pieces of any size and returns what became final: content text
and tool-call deltas in OpenAI's streaming shape (``ToolCallDelta``: the first delta of a call has its index, id and
name, the next one its arguments). Feeding the text in any split gives the same content and calls as feeding it
whole (tested at every split point).

**Valid to the last token** (docs/tools.md): a call is returned, streamed or whole, only once its body has closed
and its arguments read as a JSON object (of a function the request may call, when ``names`` is given): its two
deltas are sent then, together. A call the output ends inside (cut by the token budget or the context) is never a
call, and nothing of it was sent. Content never holds a piece of a marker: a tail that could still grow into
``<|tool_call>`` is held back until it cannot; at the end of the output it is content when the output ended on its
own (EOS), and dropped when the output was cut (``finish(cut=True)``), as is a cut ``<tool_call|>``.

A call's body is read in either syntax: JSON (what the tool grammar makes the model write; the arguments are that
text) or Gemma's native key:value syntax (converted to compact JSON). A closed body that does not read as a JSON
object is not a call (dropped). What is not a call stays content: ``<|tool_call>`` not followed by ``call:NAME{``
(NAME of letters, digits, ``_``, ``-``, ``.``) is text.

Ids: ``call_`` and 24 hex digits, from ``call_id(id_seed, index)``: a request gives ``call_id_seed(seed,
prompt_ids)``, so the same seeded request gets the same ids while another conversation (another prompt) gets
others; without a seed they are random.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from dgserve.text.gemma4 import (
    CALL_PREFIX,
    NATIVE_QUOTE,
    TOOL_CALL_BEGIN,
    TOOL_CALL_END,
    compact_json,
    partial_marker,
    read_native,
)

_NAME = re.compile(r"[A-Za-z0-9_.\-]*")
MAX_NAME_LENGTH = 256  # a longer run of name characters after "call:" is not a call


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: OpenAI's ``{"id", "type": "function", "function": {"name", "arguments"}}``,
    arguments being the JSON text of an object."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of a streamed call: the first one of call ``index`` has its ``id`` and ``name`` (and usually
    arguments ""); the ``arguments`` of all of them, in order, make the call's arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict:
        """OpenAI's ``choices[0].delta.tool_calls[k]`` item."""
        fn: dict = {"arguments": self.arguments}
        if self.name is not None:
            fn = {"name": self.name, **fn}
        out: dict = {"index": self.index}
        if self.id is not None:
            out |= {"id": self.id, "type": "function"}
        return out | {"function": fn}


def call_id_seed(seed: int, prompt_ids: Sequence[int]) -> bytes:
    """The id seed of a request: its noise seed and its prompt's tokens (module doc)."""
    h = hashlib.sha256(f"{seed}|".encode())
    h.update(",".join(map(str, prompt_ids)).encode())
    return h.digest()


def call_id(id_seed: bytes, index: int) -> str:
    """The id of call ``index`` of a request with ``id_seed``: ``call_`` and 24 hex digits."""
    return "call_" + hashlib.sha256(id_seed + index.to_bytes(8, "little")).hexdigest()[:24]


@dataclass
class _Call:
    """The call being read: its name and the body text read so far (from its ``{``)."""

    name: str
    body: str = ""
    native: bool | None = None  # the body's syntax, once its first character after "{" is known


class ToolCallParser:
    """Content and tool calls of a text fed piece by piece (module doc). ``push`` returns (content, deltas) that
    became final; ``finish`` returns the rest at the end of the output. After it, ``content`` is all the content
    and ``calls`` every call, in order. ``names``: the functions the request may call (None: any name)."""

    def __init__(self, id_seed: bytes | None = None, names: Collection[str] | None = None):
        self._id_seed = id_seed if id_seed is not None else secrets.token_bytes(16)
        self._names = None if names is None else frozenset(names)
        self._buf = ""  # text not decided yet
        self._state = "text"  # text | head (after <|tool_call>) | body | tail (before <tool_call|>)
        self._call: _Call | None = None
        self._cut = False  # set by finish: the output did not end on its own
        self.content = ""
        self.calls: list[ToolCall] = []

    def push(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """Feed the next piece of text; returns the content and call deltas that became final."""
        self._buf += text
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while self._step(content, deltas, final=False):
            pass
        return self._out(content), deltas

    def finish(self, cut: bool = False) -> tuple[str, list[ToolCallDelta]]:
        """The end of the output: everything held back is decided (module doc). ``cut``: the output did not end on
        its own (the token budget, the context, a stop string or a cancel ended it), so a held piece of a marker is
        dropped rather than made content."""
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        self._cut = cut
        while self._step(content, deltas, final=True):
            pass
        return self._out(content), deltas

    def _out(self, content: list[str]) -> str:
        text = "".join(content)
        self.content += text
        return text

    def _step(self, content: list[str], deltas: list[ToolCallDelta], final: bool) -> bool:
        """Advance the state machine once; False when it needs more text (or, when ``final``, is done)."""
        if self._state == "text":
            return self._text(content, final)
        if self._state == "head":
            return self._head(content, final)
        if self._state == "body":
            return self._body(deltas, final)
        return self._tail(final)

    def _text(self, content: list[str], final: bool) -> bool:
        buf = self._buf
        k = buf.find(TOOL_CALL_BEGIN)
        if k >= 0:
            content.append(buf[:k])
            self._buf, self._state = buf[k + len(TOOL_CALL_BEGIN) :], "head"
            return True
        hold = partial_marker(buf, TOOL_CALL_BEGIN)
        content.append(buf[: len(buf) - hold])
        self._buf = buf[len(buf) - hold :]
        if final:  # the held piece of a marker: text when the output ended on its own, dropped when it was cut
            content.append("" if self._cut else self._buf)
            self._buf = ""
        return False

    def _head(self, content: list[str], final: bool) -> bool:
        """After <|tool_call>: ``call:NAME{`` starts a call; anything else makes the marker text."""
        buf, p = self._buf, len(CALL_PREFIX)
        if len(buf) < p and CALL_PREFIX.startswith(buf) and not final:
            return False
        if buf.startswith(CALL_PREFIX):
            m = _NAME.match(buf, p)
            end = m.end() if m else p
            if end - p > MAX_NAME_LENGTH:
                pass  # not a name: text
            elif end == len(buf) and not final:
                return False  # the name may go on
            elif end < len(buf) and buf[end] == "{" and end > p:
                self._call = _Call(buf[p:end])
                self._buf, self._state = buf[end:], "body"
                return True
        if final and _call_head_prefix(buf):
            self._buf, self._state = "", "text"  # a call the output ends in before its "{": dropped
            return True
        content.append(TOOL_CALL_BEGIN)  # not a call: the marker is text, and what follows is read again
        self._state = "text"
        return True

    def _body(self, deltas: list[ToolCallDelta], final: bool) -> bool:
        """The arguments, up to the brace that closes them; a body the output ends inside is dropped."""
        call = self._call
        assert call is not None
        call.body, self._buf = call.body + self._buf, ""
        if call.native is None:
            rest = call.body[1:].lstrip()
            if not rest and not final:
                return False
            call.native = bool(rest) and rest[0] not in '"}'
        end = _body_end(call.body, call.native)
        if end < 0:  # not closed yet; at the end of the output a cut call, never a call
            if final:
                self._call, self._state = None, "text"
            return final
        self._buf, self._state, self._call = call.body[end + 1 :], "tail", None
        self._close(call.name, call.body[: end + 1], call.native, deltas)
        return True

    def _tail(self, final: bool) -> bool:
        """After the body: <tool_call|> ends the call; other text is read as text. A piece of <tool_call|> that
        the output was cut in is dropped."""
        buf = self._buf
        if buf.startswith(TOOL_CALL_END):
            self._buf = buf[len(TOOL_CALL_END) :]
        elif TOOL_CALL_END.startswith(buf):
            if not final:
                return False
            if self._cut:
                self._buf = ""
        self._state = "text"
        return True

    def _close(self, name: str, body: str, native: bool, deltas: list[ToolCallDelta]) -> None:
        """A call whose body closed: returned (its two deltas) when its arguments read as a JSON object and it
        calls a function the request may call; else not a call (dropped)."""
        arguments = _arguments(body, native)
        if arguments is None or (self._names is not None and name not in self._names):
            return
        index = len(self.calls)
        call = ToolCall(call_id(self._id_seed, index), name, arguments)
        self.calls.append(call)
        deltas += [ToolCallDelta(index, call.id, name, ""), ToolCallDelta(index, arguments=arguments)]


def parse_tool_calls(text: str, id_seed: bytes | None = None, cut: bool = False) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole output: the same as feeding ``ToolCallParser`` the text in any pieces."""
    parser = ToolCallParser(id_seed)
    parser.push(text)
    parser.finish(cut)
    return parser.content, parser.calls


def _arguments(body: str, native: bool) -> str | None:
    """A closed body's arguments: JSON text as written (the grammar's compact form), a native body converted to
    compact JSON; None when it is not a JSON object. Bounded: ``read_native`` caps its nesting, and a JSON body
    too deep for the reader is not one."""
    try:
        value = read_native(body) if native else json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict):
        return None
    return compact_json(value) if native else body


def _call_head_prefix(text: str) -> bool:
    """Whether ``text`` (after ``<|tool_call>``) could still grow into ``call:NAME{``."""
    if len(text) <= len(CALL_PREFIX):
        return CALL_PREFIX.startswith(text)
    m = _NAME.match(text, len(CALL_PREFIX))
    return text.startswith(CALL_PREFIX) and m is not None and m.end() == len(text)


def _body_end(body: str, native: bool) -> int:
    """The index of the ``}`` that closes the object ``body`` starts with, or -1 when it is not closed yet.
    Strings are skipped: JSON ones (with escapes), and in the native syntax also ``<|"|>…<|"|>``."""
    depth, i, n = 0, 0, len(body)
    while i < n:
        if native and body.startswith(NATIVE_QUOTE, i):
            j = body.find(NATIVE_QUOTE, i + len(NATIVE_QUOTE))
            if j < 0:
                return -1
            i = j + len(NATIVE_QUOTE)
            continue
        ch = body[i]
        if ch == '"':
            i += 1
            while i < n and body[i] != '"':
                i += 2 if body[i] == "\\" else 1
            if i >= n:
                return -1
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return -1
