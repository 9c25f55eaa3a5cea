"""Chat messages, validated once before any template sees them (docs/tools.md, "Conversations").

A message is ``{"role": r, "content": c}`` with r in system | developer | user | assistant | model | tool (system
or developer only first: "developer" is OpenAI's current name for the system role, and templates see it as
"system") and c a str or a list of ``{"type": "text", "text": str}`` parts. Tool use adds OpenAI's two shapes:

* an assistant (or model) message may carry ``tool_calls``: a non-empty list of ``{"id": str, "type":
  "function", "function": {"name": str, "arguments": text or an object}}``; its content may then be None, absent
  or empty, and its ``reasoning_content`` (a str) is kept for the template. Arguments are OpenAI's JSON text, but
  a history may carry text that is not a JSON object (another server's cut call, a client's edit): OpenAI accepts
  it, and so do we, rendering it as it came (``call_arguments``);
* a ``tool`` message carries ``tool_call_id`` (a str) and the result as its content. It must answer a call of the
  assistant message it follows (only other tool messages may stand between them): a result that matches no call
  could not be rendered next to it.

Errors are ValueError naming the field as the doors report it (``messages[3].tool_call_id: …``); a non-text
content part is NotImplementedError naming ``messages[i].content[j].type``.
"""

from __future__ import annotations

import json

ROLES = ("system", "developer", "user", "assistant", "model", "tool")
SYSTEM_ROLES = ("system", "developer")
MAX_ARGUMENT_DEPTH = 64  # a history call's arguments nesting deeper are rendered as their text
ASSISTANT_ROLES = ("assistant", "model")


def validate_messages(messages: list[dict]) -> list[dict]:
    """Check chat messages (module doc) and return a plain-JSON deep copy of them, so a template sees only dicts,
    lists, strings and numbers and never the caller's objects. In the copy a tool call's ``arguments`` is an
    object (parsed from its JSON text), as transformers' chat templates expect, or its text as it came when that is
    not a JSON object (``call_arguments``)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ValueError(f"messages[{i}] must be a dict, got {type(msg).__name__}")
        role = msg.get("role")
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(ROLES)}; got {role!r}")
        if role in SYSTEM_ROLES and i != 0:
            raise ValueError(f"messages[{i}].role: a {role} message is only allowed first")
        if role == "tool":
            _check_id(msg.get("tool_call_id"), f"messages[{i}].tool_call_id")
        if msg.get("tool_calls") not in (None, []):  # an empty list is no calls, as some clients send it
            _check_tool_calls(msg, i)
        if msg.get("reasoning_content") is not None:
            if not isinstance(msg["reasoning_content"], str):
                raise ValueError(f"messages[{i}].reasoning_content must be a string")
            check_unicode(msg["reasoning_content"], f"messages[{i}].reasoning_content")
        if not (msg.get("tool_calls") and msg.get("content") is None):
            validate_content(msg.get("content"), f"messages[{i}].content")
    _check_results_follow_calls(messages)
    try:
        plain = json.loads(json.dumps(list(messages)))
    except (TypeError, ValueError) as e:
        raise ValueError(f"messages must hold only JSON data ({e})") from e
    for msg in plain:
        if msg["role"] == "developer":
            msg["role"] = "system"
        for call in msg.get("tool_calls") or ():
            fn = call["function"]
            fn["arguments"] = call_arguments(fn["arguments"])
    return plain


def _check_id(value: object, field: str) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{field} must be a non-empty string")
    check_unicode(value, field)


def _check_tool_calls(msg: dict, i: int) -> None:
    field = f"messages[{i}].tool_calls"
    if msg.get("role") not in ASSISTANT_ROLES:
        raise ValueError(f"{field}: only assistant messages carry tool calls")
    calls = msg["tool_calls"]
    if not isinstance(calls, (list, tuple)) or not calls:
        raise ValueError(f"{field} must be a non-empty list of tool calls")
    seen: set[str] = set()
    for j, call in enumerate(calls):
        at = f"{field}[{j}]"
        if not isinstance(call, dict):
            raise ValueError(f"{at} must be an object")
        _check_id(call.get("id"), f"{at}.id")
        if call["id"] in seen:
            raise ValueError(f"{at}.id: another call of this message has the same id")
        seen.add(call["id"])
        if call.get("type", "function") != "function":
            raise ValueError(f'{at}.type must be "function"')
        fn = call.get("function")
        if not isinstance(fn, dict):
            raise ValueError(f"{at}.function must be an object")
        _check_id(fn.get("name"), f"{at}.function.name")
        _check_arguments(fn.get("arguments"), f"{at}.function.arguments")


def _check_arguments(args: object, field: str) -> None:
    """The arguments of a call in the history: text (OpenAI's form; any text, see ``call_arguments``) or an
    object."""
    if isinstance(args, str):
        check_unicode(args, field)
    elif not isinstance(args, dict):
        raise ValueError(f"{field} must be a string (JSON text) or an object")


def call_arguments(args: str | dict) -> str | dict:
    """A history call's arguments for the template: the object its text holds, or the text as it came when that is
    not a JSON object (invalid or cut JSON, another JSON value) or nests deeper than ``MAX_ARGUMENT_DEPTH`` (the
    reader's work stays bounded; the text's size is the request body's)."""
    if not isinstance(args, str) or _nesting(args) > MAX_ARGUMENT_DEPTH:
        return args
    try:
        value = json.loads(args)
    except (ValueError, RecursionError):
        return args
    return value if isinstance(value, dict) else args


def _nesting(text: str) -> int:
    """The deepest ``{``/``[`` nesting of JSON text (strings skipped), in one pass."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "}]":
            depth -= 1
    return deepest


def _check_results_follow_calls(messages: list[dict]) -> None:
    """Each tool message answers a call of the assistant message before its run of tool messages."""
    calls: set[str] | None = None  # the ids of the assistant message the current run of tool messages follows
    for i, msg in enumerate(messages):
        if msg["role"] != "tool":
            has_calls = msg["role"] in ASSISTANT_ROLES and msg.get("tool_calls")
            calls = {c["id"] for c in msg["tool_calls"]} if has_calls else None
            continue
        if calls is None:
            raise ValueError(
                f"messages[{i}].tool_call_id: a tool message must follow the assistant message whose tool call it "
                "answers (only other tool messages may stand between them)"
            )
        if msg["tool_call_id"] not in calls:
            raise ValueError(
                f"messages[{i}].tool_call_id: matches no tool call of the assistant message it follows; it must be "
                "the id of one of that message's tool_calls"
            )


def check_unicode(text: str, field: str, what: str = "") -> None:
    """ValueError naming `field` when `text` holds a lone surrogate (a str can, e.g. from a JSON "\\ud800"
    escape; it has no UTF-8 form, so a tokenizer, a regex engine or a log line would fail on it). `what` names
    the text within the field when that is not plain (e.g. "field name")."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{field}: {f'{what} is ' if what else ''}not valid Unicode (lone surrogate U+{ord(text[e.start]):04X} "
            f"at character {e.start})"
        ) from None


def validate_content(content, field: str) -> None:
    """A message's content: a str or a list of text parts (ValueError / NotImplementedError naming ``field``)."""
    if isinstance(content, str):
        check_unicode(content, field)
        return
    if not isinstance(content, (list, tuple)):
        raise ValueError(f"{field} must be a string or a list of text parts")
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise ValueError(f"{field}[{j}] must be a dict")
        kind = part.get("type")
        if kind != "text":
            raise NotImplementedError(f"{field}[{j}].type {kind!r} is not supported: v1 accepts text parts only")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{field}[{j}].text must be a string")
        check_unicode(part["text"], f"{field}[{j}].text")


def message_text(content) -> str:
    """The text of validated content: the string itself, the text parts concatenated with no separator, or ""
    for None (an assistant message that only calls tools)."""
    if content is None:
        return ""
    return content if isinstance(content, str) else "".join(part["text"] for part in content)
