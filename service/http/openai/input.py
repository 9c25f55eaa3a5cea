"""POST /v1/completions and /v1/chat/completions bodies → a ``Call`` (docs/generation.md, "HTTP fields"): the
chat and completions API's request side.

``completion_request`` / ``chat_request`` check a decoded JSON body and return a ``Call`` (the engine's
submission: prompt, SamplingParams, options). Every field is checked once, with a ValueError whose message starts
with the OpenAI field name (``max_tokens must be ...``, ``messages[2].role ...``); the diffusion knobs are extra
body fields with the proto's names and SamplingParams' single validation (``knobs``). An OpenAI field that dgserve
cannot honour faithfully is accepted only at its no-op value (``best_of: 1``, ``logprobs: false``, ``top_p: 1``
...); any other value, and any field we do not know, is a ValueError naming it, with the reason — never silently
ignored (``fields.check_fields``). What vLLM's clients send maps onto the same objects: ``structured_outputs`` /
``guided_*`` become the response_format, ``stop_token_ids``, ``min_tokens`` and ``skip_special_tokens`` are
SamplingParams', ``add_generation_prompt`` / ``continue_final_message`` / ``chat_template`` shape the ChatPrompt's
rendering. Neutral fields that ask nothing of the output (``metadata``, ``user``, ``prompt_cache_key``,
``safety_identifier``, chat's ``store``) are accepted, checked for their type, and ignored.

The body was decoded with bounded work and shape (``body.decode_body``), so checking it is O(fields): a list is
refused by its length (token ids, messages) before its items are looked at. The draft options' bounds and the
token-id check are ``service.events``' (the gRPC door uses the same). The answer is ``output`` and ``stream``.
"""

from __future__ import annotations

import json

from dgserve.engine.async_engine import DraftSpec
from dgserve.engine.prompt import ChatPrompt, Prompt, Submission
from dgserve.sampling_params import SamplingParams
from dgserve.structured.tools import ToolSet

from ... import events
from ...errors import clip
from ...images import openai_messages
from ..call import EDIT_FIELDS, Call, edit_fields
from ..fields import body_object, check_fields, optional
from ..knobs import GUIDED, KNOBS, NEUTRAL, NO_OP, WHY, check_neutral, reasoning_effort, sampling_params

MAX_CHOICES = 16  # n: choices per request, each a request in the engine
COMMON = {
    "model",
    "stream",
    "stream_options",
    "max_tokens",
    "stop",
    "drafts",
    "response_format",
    "temperature",
    "cache_salt",
    "stop_token_ids",
    "n",
    "mm_processor_kwargs",  # vLLM's: {"max_soft_tokens": n} for the request's images (docs/images.md, "Per request")
    *KNOBS,
    *GUIDED,
    *NEUTRAL,
}
COMMON |= set(EDIT_FIELDS)  # edit in place (docs/edit-in-place.md)
COMPLETION_FIELDS = COMMON | {"prompt"}
CHAT_FIELDS = COMMON | {
    "messages",
    "max_completion_tokens",
    "chat_template_kwargs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "reasoning_effort",
    "store",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template",
}
CHAT_KWARGS = ("enable_thinking", "add_generation_prompt")


# ---------------------------------------------------------------------------------------------- requests


def completion_request(body, defaults: SamplingParams, vocab_size: int, max_len: int | None = None) -> Call:
    """POST /v1/completions body → Call. ``max_len`` (the context window): more token ids are refused unread."""
    body = body_object(body)
    check_neutral(body)
    check_fields(body, COMPLETION_FIELDS, NO_OP, WHY)
    prompt = _completion_prompt(body.get("prompt"), vocab_size, max_len)
    return _call(body, prompt, defaults, "max_tokens", max_len)


def chat_request(body, defaults: SamplingParams, max_len: int | None = None, trust_chat_template: bool = False) -> Call:
    """POST /v1/chat/completions body → Call (messages through the checkpoint's chat template). ``max_len`` (the
    context window): more messages, or content parts in all, are refused (each renders to at least a token).
    ``trust_chat_template``: the operator lets requests send their own ``chat_template`` (else it is refused)."""
    body = body_object(body)
    check_neutral(body)
    check_fields(body, CHAT_FIELDS, NO_OP, WHY)
    messages = chat_messages(body, max_len)
    kwargs = chat_template_kwargs(body)
    tools = ToolSet.from_openai(body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls"))
    thinking = kwargs.get("enable_thinking", reasoning_effort(body.get("reasoning_effort")))
    optional(body, "store", bool)  # accepted, nothing is stored (docs/generation.md, "HTTP fields")
    rendering = _rendering(body, kwargs, trust_chat_template)
    prompt = ChatPrompt(messages, enable_thinking=thinking, tools=tools, **rendering)
    limit = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    return _call(body, prompt, defaults, limit, max_len)


def _rendering(body: dict, kwargs: dict, trust_chat_template: bool) -> dict:
    """How the chat is rendered: add_generation_prompt (vLLM's top-level field, or chat_template_kwargs'; default
    true, false when continue_final_message is given), continue_final_message and chat_template (only when the
    operator trusts its callers: a template is code the server runs, in a sandbox but with no bound on its work)."""
    if body.get("chat_template") is not None and not trust_chat_template:
        raise ValueError(
            "chat_template: a chat template sent with the request is refused on this server (the operator can "
            "allow it with --trust-request-chat-template)"
        )
    cont = bool(optional(body, "continue_final_message", bool))
    generation_prompt = optional(body, "add_generation_prompt", bool)
    if generation_prompt is None:
        generation_prompt = kwargs.get("add_generation_prompt", not cont)
    if cont and generation_prompt:
        raise ValueError("continue_final_message: cannot be combined with add_generation_prompt true")
    return {
        "add_generation_prompt": generation_prompt,
        "continue_final_message": cont,
        "chat_template": optional(body, "chat_template", str),
    }


def chat_messages(body: dict, max_len: int | None = None) -> tuple:
    """The body's ``messages``, a non-empty list; with ``max_len`` (the context window), more messages or content
    parts in all are refused (each renders to at least a token)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    if max_len is not None:
        _check_chat_size(messages, max_len)
    return openai_messages(messages)


def chat_template_kwargs(body: dict) -> dict:
    """The body's ``chat_template_kwargs`` ({} when absent): the supported switches, booleans."""
    kwargs = optional(body, "chat_template_kwargs", dict) or {}
    for key, value in kwargs.items():
        if key not in CHAT_KWARGS:
            raise ValueError(f"chat_template_kwargs.{clip(key)}: not supported (supported: {', '.join(CHAT_KWARGS)})")
        if not isinstance(value, bool):
            raise ValueError(f"chat_template_kwargs.{key} must be a boolean")
    return kwargs


def _call(body: dict, prompt: Prompt, defaults: SamplingParams, limit_field: str, max_len: int | None = None) -> Call:
    stream = bool(optional(body, "stream", bool))
    options = optional(body, "stream_options", dict)
    include_usage = False
    if options is not None:
        if not stream:
            raise ValueError("stream_options: only allowed when stream is true")
        for key, value in options.items():
            if key != "include_usage":
                raise ValueError(f"stream_options.{clip(key)}: not supported (supported: include_usage)")
            if not isinstance(value, bool):
                raise ValueError("stream_options.include_usage must be a boolean")
        include_usage = options.get("include_usage", False)
    drafts = _drafts(body.get("drafts"), stream)
    n = _choices(body.get("n"), drafts is not None)
    model = optional(body, "model", str) or ""
    params = sampling_params(body, defaults, limit_field)
    calls = isinstance(prompt, ChatPrompt) and prompt.calls_tools
    fill = events.fills_context(body.get(limit_field) is not None, params, calls)
    salt = optional(body, "cache_salt", str)
    edits = edit_fields(body, max_len)
    sub = Submission(
        prompt, params, drafts=drafts, fill_context=fill, cache_salt=salt, limit_field=limit_field, **edits
    )
    return Call(sub, model, stream, include_usage, n)


def _choices(n, drafts: bool) -> int:
    """``n``: an integer in [1, MAX_CHOICES] (absent: 1); drafts (previews of one canvas) only with one choice."""
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
        raise ValueError(f"n must be an integer in [1, {MAX_CHOICES}], got {clip(json.dumps(n))}")
    if n > 1 and drafts:
        raise ValueError("n: drafts are available only with n 1")
    return n


def _completion_prompt(prompt, vocab_size: int, max_len: int | None = None) -> Prompt:
    """A string, a list of token ids, or a one-element list of either (OpenAI's batch form, batch size 1)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must not be empty")
        return prompt
    if isinstance(prompt, list) and prompt:
        too_long = max_len is not None and len(prompt) > max_len  # refused by its length, the items unread
        if too_long or all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return events.token_ids(prompt, vocab_size, "prompt", max_len)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise ValueError(f"prompt: {len(prompt)} prompts in one request are not supported; send one per request")
    raise ValueError("prompt must be a non-empty string or a non-empty list of token ids")


def _check_chat_size(messages: list, max_len: int) -> None:
    if len(messages) > max_len:
        raise ValueError(f"messages: {len(messages)} messages exceed the context window of {max_len} positions")
    parts = sum(len(m["content"]) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list))
    if parts > max_len:
        raise ValueError(f"messages: {parts} content parts exceed the context window of {max_len} positions")


def _drafts(spec, stream: bool) -> DraftSpec | None:
    if spec is None or spec is False:
        return None
    if not stream:
        raise ValueError("drafts: only available with stream: true")
    if spec is True:
        spec = {}
    if not isinstance(spec, dict):
        raise ValueError("drafts must be true or an object {every_n_steps, include_text}")
    for key in spec:
        if key not in ("every_n_steps", "include_text"):
            raise ValueError(f"drafts.{clip(key)}: not supported (supported: every_n_steps, include_text)")
    return events.draft_spec(spec.get("every_n_steps"), spec.get("include_text"))
