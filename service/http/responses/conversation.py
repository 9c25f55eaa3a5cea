"""The Responses API's input items → OpenAI chat messages (docs/responses-api.md, "The request"), checked with the
item's field in each message (``input[3].call_id: …``). Bounded work: the items are refused by their count before
they are looked at.
"""

from __future__ import annotations

from collections.abc import Callable

from dgserve.text.messages import check_unicode

from ...errors import clip
from ...images import openai_image
from ..fields import known, nonempty, string_or_list

ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
INPUT_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")


class Conversation:
    """Input items as OpenAI chat messages, after a stored conversation (``prior``). A ``function_call`` joins the
    assistant message before it (or opens one), a ``function_call_output`` is a tool message that must answer a
    call of the turn it follows, a ``reasoning`` item is the next assistant message's ``reasoning_content``; system
    and developer messages open the conversation as its system turn (the chat template has one), and one after the
    turns began is a user turn. ``names``: the name
    the prompt knows a call of a ``namespace`` and a ``name`` by (``tools.ResponsesTools.prompt_name``)."""

    def __init__(self, prior: tuple[dict, ...] = (), names: Callable[[str, str], str] | None = None):
        self.names = names or (lambda namespace, name: name)
        self.messages: list[dict] = [dict(m) for m in prior]
        self.calls = {c["id"] for m in prior for c in m.get("tool_calls") or ()}
        # the reasoning texts the next assistant message takes (joined once: joining as they come is quadratic)
        self._reasoning: list[str] | None = None
        # the call ids of the turn a function_call_output answers: the last message that is not a tool output's
        # (kept as messages are added, so that a run of outputs is checked in linear time)
        turn = next((m for m in reversed(self.messages) if m["role"] != "tool"), None)
        self._turn_calls = _call_ids(turn)

    def add_input(self, value, max_len: int | None) -> None:
        """The body's ``input``: a string (one user message) or a list of items."""
        if isinstance(value, str):
            check_unicode(value, "input")
            self._append({"role": "user", "content": value})
            return
        if not isinstance(value, list) or (not value and not self.messages):
            raise ValueError("input must be a non-empty string or a non-empty list of items")
        if max_len is not None and len(value) > max_len:  # refused by its length, the items unread
            raise ValueError(f"input: {len(value)} items exceed the context window of {max_len} positions")
        for i, item in enumerate(value):
            self.add(item, f"input[{i}]")

    def add(self, item, field: str) -> None:
        if not isinstance(item, dict):
            raise ValueError(f"{field} must be an object (an input item)")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            self._message(item, field)
        elif kind == "function_call":
            self._function_call(item, field)
        elif kind == "function_call_output":
            self._function_call_output(item, field)
        elif kind == "reasoning":
            self._reasoning = [*(self._reasoning or ()), _reasoning_text(item, field)]
        else:
            got = clip(str(kind)) if isinstance(kind, str) else kind
            raise ValueError(f"{field}.type: {got!r} is not supported (supported: {', '.join(ITEM_TYPES)})")

    def prompt_messages(self, instructions: str | None) -> list[dict]:
        """The prompt's messages: the instructions and the conversation's opening system / developer messages as
        one system message, then the rest."""
        system = [] if instructions is None else [instructions]
        start = 0
        while start < len(self.messages) and self.messages[start]["role"] == "system":
            system.append(_text(self.messages[start]["content"]))
            start += 1
        rest = self.messages[start:]
        if not rest:
            raise ValueError("input: the conversation has no user or assistant turn")
        return ([{"role": "system", "content": "\n\n".join(system)}] if system else []) + rest

    def _append(self, message: dict) -> None:
        """Add a message that is not a tool output (it opens a turn)."""
        if message["role"] == "assistant" and self._reasoning is not None:
            message["reasoning_content"], self._reasoning = "".join(self._reasoning), None
        self.messages.append(message)
        self._turn_calls = _call_ids(message)

    def _message(self, item: dict, field: str) -> None:
        role = item.get("role")
        if role not in INPUT_ROLES:
            raise ValueError(f"{field}.role must be one of {', '.join(INPUT_ROLES)}; got {clip(str(role))!r}")
        known(item, {"type", "role", "content", "id", "status"}, field)
        content = _content(item.get("content"), f"{field}.content")
        if role in ("system", "developer"):
            # the chat template's one system turn opens the conversation; one that comes after the conversation's
            # turns (Codex CLI's instructions after it compacts) is a user turn with the same text
            # (docs/responses-api.md, "The request")
            role = "system" if not self.messages or self.messages[-1]["role"] == "system" else "user"
        self._append({"role": role, "content": content})

    def _function_call(self, item: dict, field: str) -> None:
        known(item, {"type", "call_id", "name", "namespace", "arguments", "id", "status"}, field)
        call_id = nonempty(item.get("call_id"), f"{field}.call_id")
        name = nonempty(item.get("name"), f"{field}.name")
        if item.get("namespace") is not None:  # a call of a namespace's tool (docs/responses-api.md, "Tools")
            name = self.names(nonempty(item["namespace"], f"{field}.namespace"), name)
        args = item.get("arguments")
        if not isinstance(args, str):
            raise ValueError(f"{field}.arguments must be a string (the call's JSON arguments)")
        if call_id in self.calls:
            raise ValueError(f"{field}.call_id: {clip(call_id)!r} is the call_id of an earlier function_call")
        self.calls.add(call_id)
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
        last = self.messages[-1] if self.messages else None
        if last is not None and last["role"] == "assistant" and self._reasoning is None:
            last.setdefault("tool_calls", []).append(call)  # the calls of one turn share its assistant message
            self._turn_calls.add(call_id)
            return
        self._append({"role": "assistant", "content": None, "tool_calls": [call]})

    def _function_call_output(self, item: dict, field: str) -> None:
        known(item, {"type", "call_id", "output", "id", "status"}, field)
        call_id = nonempty(item.get("call_id"), f"{field}.call_id")
        if call_id not in self.calls:
            raise ValueError(f"{field}.call_id: {clip(call_id)!r} matches no function_call of the conversation")
        if call_id not in self._turn_calls:
            raise ValueError(
                f"{field}.call_id: a function_call_output must follow the function_call items of its turn (only "
                "other outputs may stand between them)"
            )
        output = item.get("output")
        output = output if isinstance(output, str) else _text(_content(output, f"{field}.output"))
        check_unicode(output, f"{field}.output")
        self.messages.append({"role": "tool", "tool_call_id": call_id, "content": output})


def _call_ids(message: dict | None) -> set[str]:
    return {c["id"] for c in (message or {}).get("tool_calls") or ()}


def _content(value, field: str) -> str | list[dict]:
    """A message's content: a string, or a list of text parts (input_text / output_text) as chat text parts."""
    value = string_or_list(value, field, "input_text parts")
    if isinstance(value, str):
        return value
    parts = []
    for j, part in enumerate(value):
        at = f"{field}[{j}]"
        if not isinstance(part, dict):
            raise ValueError(f"{at} must be an object")
        kind = part.get("type")
        if kind == "input_image":
            parts.append(openai_image(part, at))
            continue
        if kind not in TEXT_PARTS:
            raise NotImplementedError(f"{at}.type {clip(str(kind))!r} is not supported: text parts only")
        text = part.get("text")
        if not isinstance(text, str):
            raise ValueError(f"{at}.text must be a string")
        check_unicode(text, f"{at}.text")
        parts.append({"type": "text", "text": text})
    return parts


def _text(content: str | list[dict]) -> str:
    if isinstance(content, str):
        return content
    if any(p["type"] != "text" for p in content):
        raise ValueError("input: images are read in user messages only (not in instructions or tool outputs)")
    return "".join(p["text"] for p in content)


def _reasoning_text(item: dict, field: str) -> str:
    """A reasoning item's text: its reasoning_text content, else its summary texts."""
    known(item, {"type", "id", "summary", "content", "encrypted_content", "status"}, field)
    texts = []
    for key, part_type in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key)
        if parts is None:
            continue
        if not isinstance(parts, list):
            raise ValueError(f"{field}.{key} must be a list of {part_type} parts")
        for j, part in enumerate(parts):
            if not isinstance(part, dict) or part.get("type") != part_type or not isinstance(part.get("text"), str):
                raise ValueError(f'{field}.{key}[{j}] must be {{"type": "{part_type}", "text": string}}')
            check_unicode(part["text"], f"{field}.{key}[{j}].text")
            texts.append(part["text"])
        if texts:
            break
    return "\n".join(texts)
