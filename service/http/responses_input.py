"""POST /v1/responses body → the engine's one submission (docs/responses-api.md): the Responses API's request side.

``responses_request`` checks a decoded body and returns a ``ResponsesCall``: a ``protocol.Call`` (a ``ChatPrompt``,
SamplingParams, options) and what the Responses door keeps besides (store, the conversation to store, the fields a
response echoes). The input items become OpenAI chat messages (``Conversation``), checked here with the item's
field in the message (``input[3].call_id: …``); the knobs, ``temperature``, ``max_output_tokens``, the reasoning
switch, tools and ``text.format`` go through the chat door's own checks (``protocol``, ``ToolSet``), with their
messages renamed to this API's fields. Bounded work as the other routes: the body was decoded with bounded size
and shape, and the items are refused by their count before they are looked at.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass

from dgserve.engine.prompt import ChatPrompt
from dgserve.sampling_params import SamplingParams
from dgserve.structured.tools import ToolSet
from dgserve.text.messages import check_unicode

from .. import events
from ..errors import clip
from ..images import openai_image
from . import protocol
from .response_store import Stored

FIELDS = {
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "text",
    "reasoning",
    "max_output_tokens",
    "temperature",
    "stream",
    "store",
    "previous_response_id",
    "user",
    "metadata",
    "include",
    "cache_salt",
    "mm_processor_kwargs",  # {"max_soft_tokens": n} (docs/images.md, "Per request")
    *protocol.EDIT_FIELDS,
    *protocol.KNOBS,
    *protocol.NEUTRAL,  # accepted and ignored, as on chat completions (prompt_cache_key: Codex CLI sends one)
    "client_metadata",  # Codex CLI's ids of its session and turn: ignored
}
# Responses fields with no faithful meaning here, accepted only at the value that asks for nothing
NO_OP: dict[str, tuple[object, ...]] = {
    "truncation": ("disabled",),
    "background": (False,),
    "top_p": (1, 1.0),
    "service_tier": ("auto", "default"),
}
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
INPUT_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
REASONING_SUMMARIES = ("auto", "concise", "detailed")


@dataclass(frozen=True)
class ResponsesCall:
    """One checked Responses request."""

    call: protocol.Call  # the ChatPrompt, params and options the submission is made of
    store: bool
    history: tuple[dict, ...]  # the conversation without the instructions: what a later turn continues from
    echo: dict  # the request's fields a response object repeats (instructions, tools, text, reasoning, ...)


def responses_request(
    body, defaults: SamplingParams, max_len: int | None, previous: Callable[[str], Stored | None]
) -> ResponsesCall:
    """POST /v1/responses body → ResponsesCall (module doc). ``previous``: the caller's stored response of an id
    (None: unknown, or another caller's). ValueError / NotImplementedError naming the field."""
    body = protocol._object(body)
    protocol._check_fields({k: v for k, v in body.items() if k not in NO_OP or not _is(v, NO_OP[k])}, FIELDS)
    prior = _previous(body.get("previous_response_id"), previous)
    convo = Conversation(prior)
    convo.add_input(body.get("input"), max_len)
    tools = _tool_set(body)
    thinking = _thinking(body.get("reasoning"))
    messages = convo.prompt_messages(_instructions(body.get("instructions")))
    if max_len is not None and len(messages) > max_len:
        raise ValueError(f"input: {len(messages)} messages exceed the context window of {max_len} positions")
    prompt = ChatPrompt(tuple(messages), True, thinking, tools=tools)
    params = _params(body, defaults)
    fill = events.fills_context(body.get("max_output_tokens") is not None, params, prompt.calls_tools)
    stream = bool(protocol._optional(body, "stream", bool))
    model = protocol._optional(body, "model", str) or ""
    salt = protocol._optional(body, "cache_salt", str)
    store = protocol._optional(body, "store", bool)
    _metadata(body.get("metadata"))
    _include(body.get("include"))
    edit = protocol.edit_fields(body, max_len)
    call = protocol.Call(prompt, params, model, stream, fill_context=fill, cache_salt=salt, **edit)
    return ResponsesCall(call, True if store is None else store, tuple(convo.messages), _echo(body, params, thinking))


def _is(value, allowed: tuple[object, ...]) -> bool:
    return any(value == v and type(value) is type(v) for v in allowed)


# ---------------------------------------------------------------------------------------------- input items


class Conversation:
    """Input items as OpenAI chat messages, after a stored conversation (``prior``). A ``function_call`` joins the
    assistant message before it (or opens one), a ``function_call_output`` is a tool message that must answer a
    call of the turn it follows, a ``reasoning`` item is the next assistant message's ``reasoning_content``; system
    and developer messages only open the conversation (the chat template has one system turn)."""

    def __init__(self, prior: tuple[dict, ...] = ()):
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
        _known(item, {"type", "role", "content", "id", "status"}, field)
        content = _content(item.get("content"), f"{field}.content")
        if role in ("system", "developer"):
            # system messages only open the conversation, so it has begun when its last message is not one
            if self.messages and self.messages[-1]["role"] != "system":
                raise ValueError(f"{field}.role: a {role} message is only allowed before the conversation's turns")
            role = "system"
        self._append({"role": role, "content": content})

    def _function_call(self, item: dict, field: str) -> None:
        _known(item, {"type", "call_id", "name", "arguments", "id", "status"}, field)
        call_id = _string(item.get("call_id"), f"{field}.call_id")
        name = _string(item.get("name"), f"{field}.name")
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
        _known(item, {"type", "call_id", "output", "id", "status"}, field)
        call_id = _string(item.get("call_id"), f"{field}.call_id")
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
    if isinstance(value, str):
        check_unicode(value, field)
        return value
    if not isinstance(value, list):
        raise ValueError(f"{field} must be a string or a list of input_text parts")
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
    _known(item, {"type", "id", "summary", "content", "encrypted_content", "status"}, field)
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


def _known(item: dict, fields: set[str], field: str) -> None:
    for key, value in item.items():
        if key not in fields and value is not None:
            raise ValueError(f"{field}.{clip(str(key))}: not supported in this item")


def _string(value, field: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{field} must be a non-empty string")
    check_unicode(value, field)
    return value


def _previous(value, previous: Callable[[str], Stored | None]) -> tuple[dict, ...]:
    if value is None:
        return ()
    if not isinstance(value, str) or not value:
        raise ValueError("previous_response_id must be a non-empty string")
    stored = previous(value)
    if stored is None:  # unknown, dropped, or another caller's: the same answer
        raise ValueError(f"previous_response_id: {clip(value)!r} is not a stored response of this caller")
    return stored.messages


def _instructions(value) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError("instructions must be a string")
    check_unicode(value, "instructions")
    return value


# ---------------------------------------------------------------------------------------------- options


def _tool_set(body: dict) -> ToolSet | None:
    """Responses' flat function tools and tool_choice → the chat door's ToolSet (its messages renamed)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is not None:
        if not isinstance(tools, list):
            raise ValueError("tools must be a list of function tools")
        tools = [_tool(t, f"tools[{i}]") for i, t in enumerate(tools)]
    if isinstance(choice, dict):
        _known(choice, {"type", "name"}, "tool_choice")
        if choice.get("type") != "function":
            raise ValueError(f'tool_choice.type must be "function", got {clip(str(choice.get("type")))!r}')
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    try:
        return ToolSet.from_openai(tools, choice, body.get("parallel_tool_calls"))
    except ValueError as e:
        raise ValueError(re.sub(r"^(tools\[\d+\]|tool_choice)\.function\.", r"\1.", str(e))) from None


def _tool(tool, field: str) -> dict:
    if not isinstance(tool, dict):
        raise ValueError(f'{field} must be an object {{"type": "function", "name": ...}}')
    if tool.get("type") != "function":
        raise ValueError(f'{field}.type: only "function" tools are supported, got {clip(str(tool.get("type")))!r}')
    _known(tool, {"type", "name", "description", "parameters", "strict"}, field)
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": fn}


def _thinking(reasoning) -> bool:
    """``reasoning.effort`` → the thinking switch (the chat door's ``reasoning_effort`` rule)."""
    if reasoning is None:
        return False
    if not isinstance(reasoning, dict):
        raise ValueError("reasoning must be an object {effort, summary}")
    _known(reasoning, {"effort", "summary", "generate_summary"}, "reasoning")
    for key in ("summary", "generate_summary"):
        if reasoning.get(key) is not None and reasoning[key] not in REASONING_SUMMARIES:
            raise ValueError(f"reasoning.{key} must be one of {', '.join(REASONING_SUMMARIES)}")
    try:
        return protocol._reasoning_effort(reasoning.get("effort"))
    except ValueError as e:
        raise ValueError(str(e).replace("reasoning_effort", "reasoning.effort", 1)) from None


def _params(body: dict, defaults: SamplingParams) -> SamplingParams:
    """The knobs (the chat door's checks, ``max_output_tokens`` for max_tokens) with ``text.format``."""
    params = protocol.sampling_params(body, defaults, "max_output_tokens")
    fmt = _text_format(body.get("text"))
    return params if fmt is None else dataclasses.replace(params, response_format=fmt)


def _text_format(text):
    if text is None:
        return None
    if not isinstance(text, dict):
        raise ValueError("text must be an object {format}")
    _known(text, {"format", "verbosity"}, "text")
    if text.get("verbosity") not in (None, "medium"):
        raise ValueError("text.verbosity: only medium is supported (the model has one verbosity)")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise ValueError('text.format must be an object with a "type"')
    if fmt.get("type") == "json_schema":
        inner = {k: v for k, v in fmt.items() if k != "type"}
        fmt = {"type": "json_schema", "json_schema": inner}
    try:
        return protocol.response_format(fmt)
    except ValueError as e:
        message = str(e).replace("response_format.json_schema", "text.format")
        raise ValueError(message.replace("response_format", "text.format")) from None


def _metadata(value) -> None:
    """``metadata`` (echoed, no effect): at most 16 string pairs, as OpenAI's."""
    if value is None:
        return
    if not isinstance(value, dict) or len(value) > 16:
        raise ValueError("metadata must be an object of at most 16 string values")
    for key, v in value.items():
        if not isinstance(v, str) or len(key) > 64 or len(v) > 512:
            raise ValueError(f"metadata.{clip(key)}: keys are at most 64 characters and values strings of 512")


def _include(value) -> None:
    """``include`` (no effect: reasoning is returned as text): a list of strings."""
    if value is not None and (not isinstance(value, list) or not all(isinstance(v, str) for v in value)):
        raise ValueError("include must be a list of strings")


def _echo(body: dict, params: SamplingParams, thinking: bool) -> dict:
    """What a response object repeats of its request."""
    fmt = (body.get("text") or {}).get("format") or {"type": "text"}
    return {
        "instructions": body.get("instructions"),
        "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice") or "auto",
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "temperature": body.get("temperature"),
        "top_p": 1.0,
        "max_output_tokens": body.get("max_output_tokens"),
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": {"effort": (body.get("reasoning") or {}).get("effort") if thinking else None, "summary": None},
        "text": {"format": fmt},
        "truncation": "disabled",
        "metadata": body.get("metadata") or {},
        "user": body.get("user"),
        "store": body.get("store", True),
    }
