"""POST /v1/responses body → the engine's one submission (docs/responses-api.md): the Responses API's request side.

``responses_request`` checks a decoded body and returns a ``ResponsesCall``: a ``Call`` (a ``ChatPrompt``,
SamplingParams, options) and what the Responses door keeps besides (store, the conversation to store, the fields a
response echoes). The input items become OpenAI chat messages (``conversation.Conversation``), checked with the
item's field in the message (``input[3].call_id: …``); the knobs, ``temperature``, ``max_output_tokens``, the reasoning
switch, tools (``tools.read_tools``: namespace and hosted tools) and ``text.format`` go through the shared checks
(``knobs``, ``ToolSet``), with their messages renamed to this API's fields; the fields through the one rule
(``fields.check_fields``) with OpenAI's no-op table and this API's. Bounded work as the other routes: the body was
decoded with bounded size and shape, and the items are refused by their count before they are looked at.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from dgserve.engine.prompt import ChatPrompt, Submission
from dgserve.sampling_params import SamplingParams

from ... import events
from ...errors import clip
from ..call import EDIT_FIELDS, Call, edit_fields
from ..fields import body_object, check_fields, known, optional, string
from ..knobs import KNOBS, NEUTRAL, NO_OP, WHY, check_neutral, reasoning_effort, response_format, sampling_params
from .conversation import Conversation
from .store import Stored
from .tools import ResponsesTools, read_tools

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
    *EDIT_FIELDS,
    *KNOBS,
    *NEUTRAL,  # accepted and ignored, as on chat completions (prompt_cache_key: Codex CLI sends one)
    "client_metadata",  # Codex CLI's ids of its session and turn: ignored
}
# Responses fields with no faithful meaning here, accepted only at the value that asks for nothing (besides
# OpenAI's, which chat completions accepts so)
RESPONSES_NO_OP: dict[str, tuple[object, ...]] = {
    "truncation": ("disabled",),
    "background": (False,),
    "top_p": (1, 1.0),
    "service_tier": ("auto", "default"),
}
ALL_NO_OP = NO_OP | RESPONSES_NO_OP
REASONING_SUMMARIES = ("auto", "concise", "detailed")


@dataclass(frozen=True)
class ResponsesCall:
    """One checked Responses request."""

    call: Call  # the ChatPrompt, params and options the submission is made of
    store: bool
    history: tuple[dict, ...]  # the conversation without the instructions: what a later turn continues from
    echo: dict  # the request's fields a response object repeats (instructions, tools, text, reasoning, ...)
    tools: ResponsesTools = field(default_factory=ResponsesTools)  # namespaced names, hosted types left out


def responses_request(
    body, defaults: SamplingParams, max_len: int | None, previous: Callable[[str], Stored | None]
) -> ResponsesCall:
    """POST /v1/responses body → ResponsesCall (module doc). ``previous``: the caller's stored response of an id
    (None: unknown, or another caller's). ValueError / NotImplementedError naming the field."""
    body = body_object(body)
    check_neutral(body)
    check_fields(body, FIELDS, ALL_NO_OP, WHY)
    prior = _previous(body.get("previous_response_id"), previous)
    tools = read_tools(body)
    convo = Conversation(prior, tools.prompt_name)
    convo.add_input(body.get("input"), max_len)
    thinking = _thinking(body.get("reasoning"))
    messages = convo.prompt_messages(_instructions(body))
    if max_len is not None and len(messages) > max_len:
        raise ValueError(f"input: {len(messages)} messages exceed the context window of {max_len} positions")
    prompt = ChatPrompt(tuple(messages), True, thinking, tools=tools.tools)
    params = _params(body, defaults)
    fill = events.fills_context(body.get("max_output_tokens") is not None, params, prompt.calls_tools)
    stream = bool(optional(body, "stream", bool))
    model = optional(body, "model", str) or ""
    salt = optional(body, "cache_salt", str)
    store = optional(body, "store", bool)
    _metadata(body.get("metadata"))
    _include(body.get("include"))
    sub = Submission(
        prompt,
        params,
        fill_context=fill,
        cache_salt=salt,
        limit_field="max_output_tokens",
        **edit_fields(body, max_len),
    )
    call = Call(sub, model, stream)
    echo = _echo(body, params, thinking) | {"tools": list(tools.echo)}
    return ResponsesCall(call, True if store is None else store, tuple(convo.messages), echo, tools)


def _instructions(body: dict) -> str | None:
    value = body.get("instructions")
    return None if value is None else string(value, "instructions")


def _previous(value, previous: Callable[[str], Stored | None]) -> tuple[dict, ...]:
    if value is None:
        return ()
    if not isinstance(value, str) or not value:
        raise ValueError("previous_response_id must be a non-empty string")
    stored = previous(value)
    if stored is None:  # unknown, dropped, or another caller's: the same answer
        raise ValueError(f"previous_response_id: {clip(value)!r} is not a stored response of this caller")
    return stored.messages


# ---------------------------------------------------------------------------------------------- options


def _thinking(reasoning) -> bool:
    """``reasoning.effort`` → the thinking switch (the chat door's ``reasoning_effort`` rule)."""
    if reasoning is None:
        return False
    if not isinstance(reasoning, dict):
        raise ValueError("reasoning must be an object {effort, summary}")
    known(reasoning, {"effort", "summary", "generate_summary"}, "reasoning")
    for key in ("summary", "generate_summary"):
        if reasoning.get(key) is not None and reasoning[key] not in REASONING_SUMMARIES:
            raise ValueError(f"reasoning.{key} must be one of {', '.join(REASONING_SUMMARIES)}")
    try:
        return reasoning_effort(reasoning.get("effort"))
    except ValueError as e:
        raise ValueError(str(e).replace("reasoning_effort", "reasoning.effort", 1)) from None


def _params(body: dict, defaults: SamplingParams) -> SamplingParams:
    """The knobs (the chat door's checks, ``max_output_tokens`` for max_tokens) with ``text.format``."""
    params = sampling_params(body, defaults, "max_output_tokens")
    fmt = _text_format(body.get("text"))
    return params if fmt is None else dataclasses.replace(params, response_format=fmt)


def _text_format(text):
    if text is None:
        return None
    if not isinstance(text, dict):
        raise ValueError("text must be an object {format}")
    known(text, {"format", "verbosity"}, "text")
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
        return response_format(fmt)
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
