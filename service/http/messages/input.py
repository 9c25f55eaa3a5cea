"""POST /v1/messages and /v1/messages/count_tokens bodies → the engine's one submission (docs/messages-api.md): the
Messages API's request side.

``messages_request`` checks a decoded body and returns a ``Call`` (a ``ChatPrompt``, SamplingParams, options);
``count_request`` returns the ``ChatPrompt`` alone, built by the same function, so a count is the prompt ``create``
submits. Anthropic's conversation becomes OpenAI chat messages (``conversation.Conversation``). The knobs,
``temperature``, ``max_tokens``, tools and the thinking switch go through the shared checks (``knobs``,
``ToolSet``), with their messages renamed to this API's fields; the fields through the one rule
(``fields.check_fields``) with this API's no-op table. Bounded work as the other routes: the body was decoded with
bounded size and shape, and messages and blocks are refused by their count before they are read.
"""

from __future__ import annotations

import dataclasses
import re

from dgserve.engine.prompt import ChatPrompt, Submission
from dgserve.sampling_params import SamplingParams
from dgserve.structured.tools import ToolSet

from ...errors import clip
from ..call import EDIT_FIELDS, Call, edit_fields
from ..fields import OBJECT, body_object, check_fields, known, optional
from ..knobs import KNOBS, response_format, sampling_params
from .conversation import Conversation

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
    *EDIT_FIELDS,
    *KNOBS,
}
# Messages fields with no faithful meaning here, accepted only at the value that asks for nothing
NO_OP: dict[str, tuple[object, ...]] = {"top_p": (1, 1.0), "service_tier": ("auto", "standard_only")}
WHY = {
    "top_k": "the diffusion sampler has no top-k truncation",
    "top_p": "the diffusion sampler has no nucleus truncation",
}
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
EFFORTS = ("low", "medium", "high", "max")
# thinking.display: how the thought is shown; Claude Code's stream-json mode sends "updates". Accepted, no effect
DISPLAYS = ("summarized", "omitted", "updates")


def messages_request(body, defaults: SamplingParams, max_len: int | None) -> Call:
    """POST /v1/messages body → Call (module doc). ValueError / NotImplementedError naming the field."""
    body = _checked_fields(body, FIELDS)
    prompt = _prompt(body, max_len)
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
    stream = bool(optional(body, "stream", bool))
    model = optional(body, "model", str) or ""
    salt = optional(body, "cache_salt", str)
    # no max_tokens (Anthropic requires one): the server's default applies, as on every door (docs/generation.md)
    fill = body.get("max_tokens") is None
    edits = edit_fields(body, max_len)
    sub = Submission(prompt, params, fill_context=fill, cache_salt=salt, limit_field="max_tokens", **edits)
    return Call(sub, model, stream)


def count_request(body, max_len: int | None) -> tuple[ChatPrompt, str]:
    """POST /v1/messages/count_tokens body → (the prompt ``create`` would submit, the model asked for)."""
    body = _checked_fields(body, COUNT_FIELDS)
    return _prompt(body, max_len), optional(body, "model", str) or ""


def _checked_fields(body, names: set[str]) -> dict:
    body = body_object(body)
    check_fields(body, names, NO_OP, WHY)
    return body


def _prompt(body: dict, max_len: int | None) -> ChatPrompt:
    convo = Conversation()
    convo.add_system(body.get("system"))
    convo.add_messages(body.get("messages"), max_len)
    tools = _tool_set(body.get("tools"), body.get("tool_choice"))
    return ChatPrompt(tuple(convo.messages), True, _thinking(body.get("thinking")), tools=tools)


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
    known(
        tool, {"type", "name", "description", "input_schema", "cache_control", "strict", "defer_loading"}, field, OBJECT
    )
    # defer_loading (Claude Code sends one such tool by default): declared up front like any other tool, since this
    # server has no tool-search tool to load it later (docs/messages-api.md, "The request")
    if tool.get("defer_loading") is not None and not isinstance(tool["defer_loading"], bool):
        raise ValueError(f"{field}.defer_loading must be a boolean")
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
    names = {"type", "disable_parallel_tool_use"} | ({"name"} if kind == "tool" else set())
    known(choice, names, "tool_choice", OBJECT)
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
    ``display`` (any of ``DISPLAYS``) is accepted, and the thought is returned whole either way."""
    if value is None:
        return False
    if not isinstance(value, dict) or value.get("type") not in ("enabled", "disabled", "adaptive"):
        raise ValueError('thinking must be {"type": "enabled", "budget_tokens": n}, {"type": "adaptive"} or disabled')
    kind = value["type"]
    known(value, {"type", "budget_tokens", "display"} if kind != "disabled" else {"type"}, "thinking", OBJECT)
    if value.get("display") is not None and value["display"] not in DISPLAYS:
        raise ValueError(f"thinking.display must be one of {', '.join(DISPLAYS)}")
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
    view = {k: v for k, v in body.items() if k in KNOBS or k in ("max_tokens", "temperature")}
    if stops:
        view["stop"] = list(stops)
    try:
        return sampling_params(view, defaults, "max_tokens")
    except ValueError as e:
        message = str(e)
        raise ValueError("stop_sequences" + message[4:] if message.startswith("stop") else message) from None


def _metadata(value) -> None:
    """``metadata`` (no effect): ``{"user_id": string}``, as Anthropic's."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise ValueError("metadata must be an object {user_id}")
    known(value, {"user_id"}, "metadata", OBJECT)
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
    known(value, {"edits"}, "context_management", OBJECT)
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
    known(value, {"effort", "format"}, "output_config", OBJECT)
    if value.get("effort") is not None and value["effort"] not in EFFORTS:
        raise ValueError(f"output_config.effort must be one of {', '.join(EFFORTS)}")
    fmt = value.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise ValueError('output_config.format must be {"type": "json_schema", "schema": {...}}')
    known(fmt, {"type", "schema"}, "output_config.format", OBJECT)
    try:
        return response_format({"type": "json_schema", "json_schema": {"schema": fmt.get("schema")}})
    except ValueError as e:
        raise ValueError(str(e).replace("response_format.json_schema", "output_config.format", 1)) from None
