"""Chat messages, validated once before any template sees them (docs/tools.md, "Conversations").

A message is ``{"role": r, "content": c}`` with r in system | developer | user | assistant | model | tool (system
or developer only first: "developer" is OpenAI's current name for the system role, and templates see it as
"system") and c a str or a list of ``{"type": "text", "text": str}`` parts. Tool use adds OpenAI's two shapes:

* an assistant (or model) message may carry ``tool_calls``: a non-empty list of ``{"id": str, "type":
  "function", "function": {"name": str, "arguments": text or an object}}``; its content may then be None, absent
  or empty, and its ``reasoning_content`` (a str) is kept for the template. Arguments are OpenAI's JSON text, but
  a history may carry text that is not a JSON object (another server's cut call, a client's edit): OpenAI accepts
  it, and so do we, rendering it as it came (``_read_arguments``);
* a ``tool`` message carries ``tool_call_id`` (a str) and the result as its content. It must answer a call of the
  assistant message it follows (only other tool messages may stand between them): a result that matches no call
  could not be rendered next to it.

Errors are ValueError naming the field as the doors report it (``messages[3].tool_call_id: …``); a non-text
content part is NotImplementedError naming ``messages[i].content[j].type``.
"""

from __future__ import annotations

import json

from dgserve.text import client_json
from dgserve.text.client_json import check_unicode

ROLES = ("system", "developer", "user", "assistant", "model", "tool")
SYSTEM_ROLES = ("system", "developer")
ASSISTANT_ROLES = ("assistant", "model")
MAX_ARGUMENTS_BYTES = 1 << 20  # a tool call's arguments text in the history: more than a context window holds


def validate_messages(messages: list[dict]) -> list[dict]:
    """Check chat messages (module doc) and return a plain-JSON deep copy of them, so a template sees only dicts,
    lists, strings and numbers and never the caller's objects. In the copy every tool call's ``arguments`` is an
    object (parsed from its JSON text by the one reader of a client's JSON: at most MAX_ARGUMENTS_BYTES and
    ``client_json.MAX_DEPTH`` levels), as transformers' chat templates expect, or its text as it came when that
    text is not a JSON object (invalid or cut JSON, another JSON value: OpenAI accepts such a history)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list")
    # (message, call) -> arguments given as text, read once: the object it holds, or the text kept as it came
    arguments: dict[tuple[int, int], dict | str] = {}
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
            arguments.update(((i, j), args) for j, args in _check_tool_calls(msg, i))
        if msg.get("reasoning_content") is not None:
            if not isinstance(msg["reasoning_content"], str):
                raise ValueError(f"messages[{i}].reasoning_content must be a string")
            check_unicode(msg["reasoning_content"], f"messages[{i}].reasoning_content")
        if not (msg.get("tool_calls") and msg.get("content") is None):
            validate_content(msg.get("content"), f"messages[{i}].content")
    _check_results_follow_calls(messages)
    # the copy: the arguments read from text are left out of the round trip (they are ours already: the reader made
    # them, nobody else holds them) and put in afterwards, so their text is walked once, by the reader
    try:
        plain = json.loads(json.dumps([_without(msg, i, arguments) for i, msg in enumerate(messages)]))
    except RecursionError:  # (a request's JSON is bounded before it gets here; an API caller's objects are not)
        raise ValueError(f"messages: nest too deep; at most {client_json.MAX_DEPTH} levels are allowed") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"messages must hold only JSON data ({e})") from e
    for (i, j), args in arguments.items():
        plain[i]["tool_calls"][j]["function"]["arguments"] = args
    for msg in plain:
        if msg["role"] == "developer":
            msg["role"] = "system"
    return plain


def _without(msg: dict, i: int, arguments: dict[tuple[int, int], dict | str]) -> dict:
    """``msg`` with the text arguments of its calls (those in ``arguments``) set to None: a shallow copy of the
    parts that change (the message, its call list, those calls and their functions), the caller's own untouched."""
    calls = msg.get("tool_calls")
    if not calls or not any((i, j) in arguments for j in range(len(calls))):
        return msg
    out = dict(msg)
    out["tool_calls"] = [
        {**call, "function": {**call["function"], "arguments": None}} if (i, j) in arguments else call
        for j, call in enumerate(calls)
    ]
    return out


def _check_id(value: object, field: str) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{field} must be a non-empty string")
    check_unicode(value, field)


def _check_tool_calls(msg: dict, i: int) -> list[tuple[int, dict | str]]:
    """(call index, its arguments read from text: an object or the kept text) for each call whose arguments came
    as text, in order; a call whose arguments came as an object is checked and left to the copy (ValueError
    naming the field of a bad call)."""
    field = f"messages[{i}].tool_calls"
    if msg.get("role") not in ASSISTANT_ROLES:
        raise ValueError(f"{field}: only assistant messages carry tool calls")
    calls = msg["tool_calls"]
    if not isinstance(calls, (list, tuple)) or not calls:
        raise ValueError(f"{field} must be a non-empty list of tool calls")
    seen: set[str] = set()
    arguments = []
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
        args = fn.get("arguments")
        if isinstance(args, str):
            arguments.append((j, _read_arguments(args, f"{at}.function.arguments")))
        elif not isinstance(args, dict):
            raise ValueError(f"{at}.function.arguments must be a string (JSON text) or an object")
    return arguments


def _read_arguments(args: str, field: str) -> dict | str:
    """The arguments text of a call in the history (OpenAI's form), read once by the one reader of a client's JSON:
    text holding a JSON object gives that object; other text (invalid or cut JSON, another server's call, a
    client's edit, another JSON value) is kept as it came, to be rendered verbatim. ValueError naming ``field``
    for text over MAX_ARGUMENTS_BYTES, JSON nesting deeper than the reader allows, or text that is not valid
    Unicode."""
    try:
        value = client_json.loads(args, field, max_bytes=MAX_ARGUMENTS_BYTES)
    except client_json.InvalidJSONError:
        return args
    return value if isinstance(value, dict) else args


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
        if kind == "image" and set(part) == {"type"}:
            continue  # an image's place (media/chat.py decoded it): the placeholders go here
        if kind != "text":
            raise NotImplementedError(f"{field}[{j}].type {kind!r} is not supported: text and image_url parts only")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{field}[{j}].text must be a string")
        check_unicode(part["text"], f"{field}[{j}].text")


def message_text(content) -> str:
    """The text of validated content: the string itself, the text parts concatenated with no separator, or ""
    for None (an assistant message that only calls tools)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part["text"] if part["type"] == "text" else IMAGE_MARK for part in content)


# Where an image part stands in rendered chat text (``Tokenizer.encode_chat`` splits on it): noncharacters no
# real text holds; a client that sends them anyway gets a count mismatch (a 400), never a placeholder.
IMAGE_MARK = "\U0010fffd\U0010fffeimage\U0010fffd"
