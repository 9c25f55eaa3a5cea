"""The tool grammar (docs/tools.md, "The grammar"): a ``ToolCallFormat`` as an llguidance lark grammar.

A call is the marker pair around ``call:NAME`` and the arguments, a JSON object the function's parameters schema
accepts (an embedded ``%json``, compiled compact like every JSON output, docs/structured-output.md):
``<|tool_call>call:get_weather{"city":"Paris"}<tool_call|>``. The JSON object's braces are the call's braces.

* required (tool_choice "required" or a named function): the output is calls only: one or more
  (``parallel``), else exactly one; a named function admits only its own calls. EOS follows the last call.
* auto: any text, or text then calls. The text is free until it writes ``<|tool_call>``; from there on it is a
  call, and after a call only another call (``parallel``) or EOS. Text alone may end anywhere.
* thinking (with required): a thought channel ``<|channel>…<channel|>`` may come first (with auto the free text
  holds it).

A marker is written as the special token when the vocabulary has it as one (Gemma 4's tokenizer: ``<|tool_call>``
is one token), else as its text, which the model spells in ordinary tokens (the shipped small model). Text is
lexed lazily up to the marker (llguidance's lazy lexemes), so the first ``<|tool_call>`` written starts a call.
"""

from __future__ import annotations

import json
from collections.abc import Container, Mapping

from dgserve.structured.response_format import ToolCallFormat
from dgserve.text.gemma4 import CALL_PREFIX, CHANNEL_BEGIN, CHANNEL_END, TOOL_CALL_BEGIN, TOOL_CALL_END

_REGEX_META = set("\\.+*?()|[]{}^$/")


def tool_lark(fmt: ToolCallFormat, schemas: Mapping[str, dict], special: Container[str]) -> str:
    """The lark grammar of ``fmt``. ``schemas``: function name → the JSON schema its arguments follow (with the
    compile options in its ``x-guidance``); ``special``: the marker texts that are single special tokens."""
    names = [f.name for f in fmt.functions if fmt.only is None or f.name == fmt.only]
    lines = ["%llguidance {}"]
    begin, end = _mark(TOOL_CALL_BEGIN, special), _mark(TOOL_CALL_END, special)
    framed = f"{begin} call {end}"
    more = " framed*" if fmt.parallel else ""
    if fmt.required:
        first = "thought? " if fmt.thinking else ""
        lines.append(f"start: {first}framed{'+' if fmt.parallel else ''}")
        if fmt.thinking:
            lines += _thought(special)
    elif TOOL_CALL_BEGIN in special:
        lines.append(f"start: TEXT | TEXT {begin} call {end}{more}")
        lines.append("TEXT: /(?s:.*)/")
    else:  # text up to and with the first marker, as one lazy lexeme
        lines.append(f"start: TEXT | head call {end}{more}")
        lines.append("TEXT: /(?s:.*)/")
        lines.append(f"head[lazy]: /(?s:.*){_escape(TOOL_CALL_BEGIN)}/")
    lines.append(f"framed: {framed}")
    lines.append("call: " + " | ".join(f"fn_{k}" for k in range(len(names))))
    for k, name in enumerate(names):
        lines.append(f"fn_{k}: {json.dumps(CALL_PREFIX + name)} %json {json.dumps(schemas[name])}")
    return "\n".join(lines) + "\n"


def _thought(special: Container[str]) -> list[str]:
    """A thought channel: its begin marker, then any text up to its end marker."""
    if CHANNEL_BEGIN in special and CHANNEL_END in special:
        return [f"thought: {_mark(CHANNEL_BEGIN, special)} TEXT {_mark(CHANNEL_END, special)}", "TEXT: /(?s:.*)/"]
    return [
        f"thought: {_mark(CHANNEL_BEGIN, special)} thought_text",
        f"thought_text[lazy]: /(?s:.*){_escape(CHANNEL_END)}/",
    ]


def _mark(text: str, special: Container[str]) -> str:
    """A marker in lark: the special token ``<…>`` when the vocabulary has one, else the string literal."""
    return text if text in special else json.dumps(text)


def _escape(text: str) -> str:
    """``text`` as a literal inside a lark ``/…/`` regex."""
    return "".join("\\" + c if c in _REGEX_META else c for c in text)
