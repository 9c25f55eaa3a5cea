"""POST /v1/messages and /v1/messages/count_tokens bodies → the engine's one submission (docs/messages-api.md): the
Messages API's request side.

``messages_request`` checks a decoded body and returns a ``protocol.Call`` (a ``ChatPrompt``, SamplingParams,
options); ``count_request`` returns the ``ChatPrompt`` alone, built by the same function, so a count is the prompt
``create`` submits. Anthropic's conversation becomes OpenAI chat messages (``Conversation``), checked here with the
block's field in the message (``messages[3].content[0].tool_use_id: …``): ``system`` is the system message, a user
message's ``tool_result`` blocks are tool messages (they come first, answering the ``tool_use`` blocks of the
assistant message before), its text the user message after them; an assistant message's ``thinking`` is its
``reasoning_content``, its ``tool_use`` blocks its ``tool_calls``. The knobs, ``temperature``, ``max_tokens``,
tools and the thinking switch go through the chat door's own checks (``protocol``, ``ToolSet``), with their
messages renamed to this API's fields. Bounded work as the other routes: the body was decoded with bounded size and
shape, and messages and blocks are refused by their count before they are read.
"""

from __future__ import annotations

import dataclasses
import json
import re

from dgserve.engine.prompt import ChatPrompt
from dgserve.sampling_params import SamplingParams
from dgserve.structured.tools import ToolSet
from dgserve.text.messages import check_unicode

from ..errors import clip
from ..images import anthropic_image
from . import protocol

COUNT_FIELDS = {"model", "messages", "system", "tools", "tool_choice", "thinking", "mm_processor_kwargs"}
FIELDS = COUNT_FIELDS | {
    "context_management",
    "output_config",
    "max_tokens",
    "metadata",
    "stop_sequences",
    "stream",
    "temperature",
    "cache_salt",
    *protocol.EDIT_FIELDS,
    *protocol.KNOBS,
}
# Messages fields with no faithful meaning here, accepted only at the value that asks for nothing
NO_OP: dict[str, tuple[object, ...]] = {"top_p": (1, 1.0), "service_tier": ("auto", "standard_only")}
WHY = {
    "top_k": "the diffusion sampler has no top-k truncation",
    "top_p": "the diffusion sampler has no nucleus truncation",
}
USER_BLOCKS = ("text", "image", "tool_result")
ASSISTANT_BLOCKS = ("text", "thinking", "redacted_thinking", "tool_use")
MEDIA_BLOCKS = ("document",)  # refused as not supported yet (a 400 naming the block), not as unknown
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
EFFORTS = ("low", "medium", "high", "max")


def messages_request(body, defaults: SamplingParams, max_len: int | None) -> protocol.Call:
    """POST /v1/messages body → Call (module doc). ValueError / NotImplementedError naming the field."""
    body = _checked_fields(body, FIELDS)
    prompt = _prompt(body, max_len)
    if body.get("max_tokens") is None:
        raise ValueError("max_tokens: required (the most output tokens, as Anthropic's API requires it)")
    stops = _stop_sequences(body.get("stop_sequences"))
    if stops and prompt.calls_tools:  # the tool grammar decides where such an output ends
        raise ValueError("stop_sequences: cannot be combined with tools unless tool_choice is none")
    params = _params(body, defaults, stops)
    fmt = _output_config(body.get("output_config"))
    if fmt is not None:
        if prompt.calls_tools:
            raise ValueError("output_config.format: cannot be combined with tools unless tool_choice is none")
        try:
            params = dataclasses.replace(params, response_format=fmt)
        except ValueError as e:
            raise ValueError(f"output_config.format: {e}") from None
    _metadata(body.get("metadata"))
    _context_management(body.get("context_management"))
    stream = bool(protocol._optional(body, "stream", bool))
    model = protocol._optional(body, "model", str) or ""
    salt = protocol._optional(body, "cache_salt", str)
    edit = protocol.edit_fields(body, max_len)
    return protocol.Call(prompt, params, model, stream, cache_salt=salt, **edit)


def count_request(body, max_len: int | None) -> tuple[ChatPrompt, str]:
    """POST /v1/messages/count_tokens body → (the prompt ``create`` would submit, the model asked for)."""
    body = _checked_fields(body, COUNT_FIELDS)
    return _prompt(body, max_len), protocol._optional(body, "model", str) or ""


def _checked_fields(body, known: set[str]) -> dict:
    body = protocol._object(body)
    for name, value in body.items():
        if name in known or value is None or (name in NO_OP and _is(value, NO_OP[name])):
            continue
        why = WHY.get(name, "not supported by this server")
        raise ValueError(f"{clip(name)}: {why} (got {clip(json.dumps(value))})")
    return body


def _is(value, allowed: tuple[object, ...]) -> bool:
    return any(value == v and type(value) is type(v) for v in allowed)


def _prompt(body: dict, max_len: int | None) -> ChatPrompt:
    convo = Conversation()
    convo.add_system(body.get("system"))
    convo.add_messages(body.get("messages"), max_len)
    tools = _tool_set(body.get("tools"), body.get("tool_choice"))
    return ChatPrompt(tuple(convo.messages), True, _thinking(body.get("thinking")), tools=tools)


# ---------------------------------------------------------------------------------------------- the conversation


class Conversation:
    """Anthropic's system and messages as OpenAI chat messages (module doc). ``pending``: the tool_use ids of the
    assistant turn just read, which the next user message's tool_result blocks answer (each once)."""

    def __init__(self):
        self.turns: list[dict] = []  # the chat messages after the system message
        self.system: list[str] = []  # the system texts, joined once by ``messages`` (linear in their size)
        self.tool_uses: set[str] = set()  # every tool_use id of the conversation (they are unique)
        self.pending: set[str] = set()

    @property
    def messages(self) -> list[dict]:
        """The chat messages: the one system message (every system text, joined by a blank line), then the turns."""
        if not self.system:
            return list(self.turns)
        return [{"role": "system", "content": "\n\n".join(self.system)}, *self.turns]

    def add_system(self, value) -> None:
        """``system``: a string or a list of text blocks (joined by a blank line), the one system message."""
        if value is not None:
            self._system(value, "system")

    def _system(self, value, field: str) -> None:
        """System text (a string or text blocks), appended to the one system message, which opens the chat (the
        chat template has one system turn)."""
        if isinstance(value, str):
            check_unicode(value, field)
            text = value
        elif isinstance(value, list):
            text = "\n\n".join(_text_block(b, f"{field}[{i}]") for i, b in enumerate(value))
        else:
            raise ValueError(f"{field} must be a string or a list of text blocks")
        if text:
            self.system.append(text)  # joined once at the end: joining as they come is quadratic in their size

    def add_messages(self, value, max_len: int | None) -> None:
        if not isinstance(value, list) or not value:
            raise ValueError("messages must be a non-empty list of {role, content} objects")
        if max_len is not None:  # refused by their count, unread: each message and block renders to a token or more
            blocks = sum(len(m["content"]) for m in value if isinstance(m, dict) and isinstance(m.get("content"), list))
            if len(value) > max_len or blocks > max_len:
                raise ValueError(
                    f"messages: {len(value)} messages of {blocks} blocks exceed the context window of {max_len} "
                    "positions"
                )
        for i, message in enumerate(value):
            self.add(message, f"messages[{i}]")
        if not self.turns or self.turns[-1]["role"] not in ("user", "tool"):
            raise ValueError(
                f"messages[{len(value) - 1}].role: the last message must be the user's (continuing a final "
                "assistant message, a prefill, is not supported)"
            )

    def add(self, message, field: str) -> None:
        if not isinstance(message, dict):
            raise ValueError(f"{field} must be an object {{role, content}}")
        _known(message, {"role", "content"}, field)
        role = message.get("role")
        content = message.get("content")
        if isinstance(content, list) and not content:
            raise ValueError(f"{field}.content must not be empty")
        if not isinstance(content, (str, list)):
            raise ValueError(f"{field}.content must be a string or a list of content blocks")
        if role == "system":  # Claude Code's mid-conversation system text: joins the one system message
            self._system(content, f"{field}.content")
        elif role == "user":
            self._user(content, f"{field}.content")
        elif role == "assistant":
            self._assistant(content, f"{field}.content")
        else:
            got = clip(str(role))
            raise ValueError(f"{field}.role must be user, assistant or system; got {got!r}")

    def _user(self, content: str | list, field: str) -> None:
        answered: set[str] = set()
        parts: list[dict] = []
        if isinstance(content, str):
            check_unicode(content, field)
            parts.append({"type": "text", "text": content})
            content = []
        for j, block in enumerate(content):
            at = f"{field}[{j}]"
            kind = _block_type(block, at, USER_BLOCKS)
            if kind == "text":
                parts.append({"type": "text", "text": _text_block(block, at)})
                continue
            if kind == "image":
                parts.append(anthropic_image(block, at))
                continue
            if parts:
                raise ValueError(f"{at}: tool_result blocks must come before any other content of the message")
            self.turns.append(self._tool_result(block, at, answered))
        self.pending = set()
        if parts:
            self.turns.append({"role": "user", "content": parts})

    def _tool_result(self, block: dict, at: str, answered: set[str]) -> dict:
        _known(block, {"type", "tool_use_id", "content", "is_error", "cache_control"}, at)
        use_id = _string(block.get("tool_use_id"), f"{at}.tool_use_id")
        if use_id not in self.pending:
            where = "an earlier turn" if use_id in self.tool_uses else "no tool_use of the conversation"
            raise ValueError(
                f"{at}.tool_use_id: {clip(use_id)!r} answers {where}; a tool_result must answer a tool_use block of "
                "the assistant message right before its message"
            )
        if use_id in answered:
            raise ValueError(f"{at}.tool_use_id: {clip(use_id)!r} is answered twice")
        answered.add(use_id)
        error = block.get("is_error")
        if error is not None and not isinstance(error, bool):
            raise ValueError(f"{at}.is_error must be a boolean")
        text = _result_content(block.get("content"), f"{at}.content")
        return {"role": "tool", "tool_call_id": use_id, "content": f"Error: {text}" if error else text}

    def _assistant(self, content: str | list, field: str) -> None:
        if isinstance(content, str):
            check_unicode(content, field)
            content = [{"type": "text", "text": content}]
        texts, thoughts, calls = [], [], []
        for j, block in enumerate(content):
            at = f"{field}[{j}]"
            kind = _block_type(block, at, ASSISTANT_BLOCKS)
            if kind == "text":
                texts.append(_text_block(block, at))
            elif kind == "thinking":
                _known(block, {"type", "thinking", "signature", "cache_control"}, at)
                thoughts.append(_str(block.get("thinking"), f"{at}.thinking"))
            elif kind == "tool_use":
                calls.append(self._tool_use(block, at))
            # redacted_thinking: opaque to us (never made here); dropped
        message: dict = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
        if thoughts:
            message["reasoning_content"] = "\n".join(thoughts)
        if calls:
            message["tool_calls"] = calls
        self.turns.append(message)
        self.pending |= {c["id"] for c in calls}

    def _tool_use(self, block: dict, at: str) -> dict:
        _known(block, {"type", "id", "name", "input", "cache_control"}, at)
        use_id = _string(block.get("id"), f"{at}.id")
        if use_id in self.tool_uses:
            raise ValueError(f"{at}.id: {clip(use_id)!r} is the id of an earlier tool_use block")
        self.tool_uses.add(use_id)
        name = _string(block.get("name"), f"{at}.name")
        args = block.get("input")
        if not isinstance(args, dict):
            raise ValueError(f"{at}.input must be an object (the tool's arguments)")
        arguments = json.dumps(args, ensure_ascii=False, separators=(",", ":"))
        return {"id": use_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _block_type(block, at: str, allowed: tuple[str, ...]) -> str:
    if not isinstance(block, dict):
        raise ValueError(f"{at} must be a content block object")
    kind = block.get("type")
    if kind in MEDIA_BLOCKS:
        raise NotImplementedError(f"{at}.type: {kind} blocks are not supported yet (text only)")
    if kind not in allowed:
        got = clip(str(kind))
        raise ValueError(f"{at}.type: {got!r} is not supported in this message (supported: {', '.join(allowed)})")
    return kind


def _text_block(block, at: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text":
        raise ValueError(f'{at} must be a text block {{"type": "text", "text": string}}')
    _known(block, {"type", "text", "cache_control", "citations"}, at)
    return _str(block.get("text"), f"{at}.text")


def _result_content(value, at: str) -> str:
    """A tool_result's content: absent, a string, or a list of text blocks (joined)."""
    if value is None:
        return ""
    if isinstance(value, str):
        check_unicode(value, at)
        return value
    if not isinstance(value, list):
        raise ValueError(f"{at} must be a string or a list of text blocks")
    texts = []
    for k, block in enumerate(value):
        _block_type(block, f"{at}[{k}]", ("text",))
        texts.append(_text_block(block, f"{at}[{k}]"))
    return "".join(texts)


def _known(item: dict, fields: set[str], field: str) -> None:
    for key, value in item.items():
        if key not in fields and value is not None:
            raise ValueError(f"{field}.{clip(str(key))}: not supported in this object")


def _str(value, field: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{field} must be a string")
    check_unicode(value, field)
    return value


def _string(value, field: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{field} must be a non-empty string")
    check_unicode(value, field)
    return value


# ---------------------------------------------------------------------------------------------- options


def _tool_set(tools, choice) -> ToolSet | None:
    """Anthropic's tools (``input_schema``) and tool_choice → the chat door's ToolSet (its messages renamed)."""
    if tools is not None:
        if not isinstance(tools, list):
            raise ValueError("tools must be a list of tools {name, description, input_schema}")
        tools = [_tool(t, f"tools[{i}]") for i, t in enumerate(tools)]
    openai_choice, parallel = _tool_choice(choice)
    try:
        return ToolSet.from_openai(tools, openai_choice, parallel)
    except ValueError as e:
        message = re.sub(r"^(tools\[\d+\])\.function\.parameters", r"\1.input_schema", str(e))
        message = re.sub(r"^(tools\[\d+\]|tool_choice)\.function\.", r"\1.", message)
        raise ValueError(message.replace("parallel_tool_calls", "tool_choice.disable_parallel_tool_use")) from None


def _tool(tool, field: str) -> dict:
    if not isinstance(tool, dict):
        raise ValueError(f"{field} must be an object {{name, description, input_schema}}")
    if tool.get("type") not in (None, "custom"):
        kind = clip(str(tool.get("type")))
        raise ValueError(f"{field}.type: {kind!r}: only client tools (type custom) are supported, no server tools")
    _known(tool, {"type", "name", "description", "input_schema", "cache_control", "strict"}, field)
    if not isinstance(tool.get("input_schema"), dict):
        raise ValueError(f"{field}.input_schema must be a JSON schema object")
    fn = {"name": tool.get("name"), "parameters": tool["input_schema"]}
    fn |= {k: tool[k] for k in ("description", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def _tool_choice(choice) -> tuple[object, bool | None]:
    """tool_choice → (OpenAI's tool_choice, parallel_tool_calls): auto, any (required), tool (a named function),
    none; ``disable_parallel_tool_use``: at most one call (exactly one with any or tool)."""
    if choice is None:
        return None, None
    if not isinstance(choice, dict) or not isinstance(choice.get("type"), str):
        raise ValueError('tool_choice must be an object {"type": "auto" | "any" | "tool" | "none"}')
    kind = choice["type"]
    _known(choice, {"type", "disable_parallel_tool_use"} | ({"name"} if kind == "tool" else set()), "tool_choice")
    disable = choice.get("disable_parallel_tool_use")
    if disable is not None and not isinstance(disable, bool):
        raise ValueError("tool_choice.disable_parallel_tool_use must be a boolean")
    parallel = None if disable is None else not disable
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError("tool_choice.name must be the name of one of the tools")
        return {"type": "function", "function": {"name": name}}, parallel
    if kind not in TOOL_CHOICES:
        raise ValueError(f"tool_choice.type must be one of auto, any, tool, none; got {clip(kind)!r}")
    return TOOL_CHOICES[kind], parallel


def _thinking(value) -> bool:
    """``thinking`` → the thinking switch (the chat door's ``enable_thinking``): ``{"type": "enabled",
    "budget_tokens": n}`` or ``{"type": "adaptive"}`` on, ``{"type": "disabled"}`` or absent off. The budget is
    checked and does not bound the thought (the model has one level of thinking; max_tokens bounds the output);
    ``display`` (summarized / omitted) is accepted, and the thought is returned whole either way."""
    if value is None:
        return False
    if not isinstance(value, dict) or value.get("type") not in ("enabled", "disabled", "adaptive"):
        raise ValueError('thinking must be {"type": "enabled", "budget_tokens": n}, {"type": "adaptive"} or disabled')
    kind = value["type"]
    _known(value, {"type", "budget_tokens", "display"} if kind != "disabled" else {"type"}, "thinking")
    if value.get("display") not in (None, "summarized", "omitted"):
        raise ValueError("thinking.display must be summarized or omitted")
    if kind == "enabled":
        budget = value.get("budget_tokens")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise ValueError("thinking.budget_tokens must be a positive integer")
    return kind != "disabled"


def _stop_sequences(value) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise ValueError("stop_sequences must be a list of strings")
    return tuple(value)


def _params(body: dict, defaults: SamplingParams, stops: tuple[str, ...]) -> SamplingParams:
    """The knobs through the chat door's checks (``max_tokens``, ``temperature``, the extensions), with the stop
    sequences as its ``stop``."""
    view = {k: v for k, v in body.items() if k in protocol.KNOBS or k in ("max_tokens", "temperature")}
    if stops:
        view["stop"] = list(stops)
    try:
        return protocol.sampling_params(view, defaults, "max_tokens")
    except ValueError as e:
        message = str(e)
        raise ValueError("stop_sequences" + message[4:] if message.startswith("stop") else message) from None


def _metadata(value) -> None:
    """``metadata`` (no effect): ``{"user_id": string}``, as Anthropic's."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise ValueError("metadata must be an object {user_id}")
    _known(value, {"user_id"}, "metadata")
    user = value.get("user_id")
    if user is not None and (not isinstance(user, str) or len(user) > 256):
        raise ValueError("metadata.user_id must be a string of at most 256 characters")


def _context_management(value) -> None:
    """``context_management`` (Anthropic's context editing), accepted only where it edits nothing: edits that
    clear thinking with ``keep: "all"`` (what Claude Code sends). Any edit that would drop context is a 400: the
    conversation is rendered as it came."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise ValueError("context_management must be an object {edits}")
    _known(value, {"edits"}, "context_management")
    edits = value.get("edits") or []
    if not isinstance(edits, list):
        raise ValueError("context_management.edits must be a list")
    for i, edit in enumerate(edits):
        kind = edit.get("type") if isinstance(edit, dict) else None
        if not (isinstance(kind, str) and kind.startswith("clear_thinking_") and edit.get("keep") == "all"):
            raise ValueError(
                f"context_management.edits[{i}]: not supported (only clear_thinking with keep all, which edits "
                "nothing: the conversation is rendered as it came)"
            )


def _output_config(value):
    """``output_config``: ``effort`` (accepted, no effect: the model has one level of effort) and ``format``
    (``{"type": "json_schema", "schema"}``: the chat door's json_schema response_format, every document valid)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("output_config must be an object {effort, format}")
    _known(value, {"effort", "format"}, "output_config")
    if value.get("effort") is not None and value["effort"] not in EFFORTS:
        raise ValueError(f"output_config.effort must be one of {', '.join(EFFORTS)}")
    fmt = value.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise ValueError('output_config.format must be {"type": "json_schema", "schema": {...}}')
    _known(fmt, {"type", "schema"}, "output_config.format")
    try:
        return protocol.response_format({"type": "json_schema", "json_schema": {"schema": fmt.get("schema")}})
    except ValueError as e:
        raise ValueError(str(e).replace("response_format.json_schema", "output_config.format", 1)) from None
