"""OpenAI request JSON → dgserve objects: the HTTP twin of ``service/convert.py``'s request side.

Requests: ``completion_request`` / ``chat_request`` check a decoded JSON body and return a ``Call`` (prompt,
SamplingParams, options). Every field is checked once, with a ValueError whose message starts with the OpenAI
field name (``max_tokens must be ...``, ``messages[2].role ...``); the diffusion knobs are extra body fields with
the proto's names and SamplingParams' single validation. An OpenAI field that dgserve cannot honour faithfully is
accepted only at its no-op value (``best_of: 1``, ``logprobs: false``, ``top_p: 1`` ...); any other value, and any
field we do not know, is a ValueError naming it, with the reason — never silently ignored. What vLLM's clients send
maps onto the same objects: ``structured_outputs`` / ``guided_*`` become the response_format, ``stop_token_ids``,
``min_tokens`` and ``skip_special_tokens`` are SamplingParams', ``add_generation_prompt`` /
``continue_final_message`` / ``chat_template`` shape the ChatPrompt's rendering. Neutral fields that ask nothing of
the output (``metadata``, ``user``, ``prompt_cache_key``, ``safety_identifier``, chat's ``store``) are accepted,
checked for their type, and ignored (docs/generation.md, "HTTP fields").

The body was decoded with bounded work and shape (``body.decode_body``), so checking it is O(fields): a list is
refused by its length (token ids, messages) before its items are looked at. The draft options' bounds and the
token-id check are ``service.events``' (the gRPC door uses the same). Responses are ``responses`` and ``sse``.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from dataclasses import dataclass

from dgserve.engine.async_engine import DraftSpec
from dgserve.engine.prompt import ChatPrompt, Prompt, Submission
from dgserve.engine.request_checks import MAX_REQUEST_ID_LENGTH
from dgserve.sampling_params import SCALAR_KNOBS, SamplingParams, choice_seed, with_temperature
from dgserve.structured import ResponseFormat
from dgserve.structured.response_format import read_schema
from dgserve.structured.tools import ToolSet

from .. import events
from ..errors import clip
from ..images import openai_messages

# vLLM's output constraints, read as a response_format (``output_format``); at most one constraint per request
GUIDED = ("structured_outputs", "guided_json", "guided_regex", "guided_choice")
# fields accepted and ignored: they ask for nothing a server must do to the output (docs/generation.md, "HTTP
# fields"); checked for their type only
NEUTRAL = {"metadata": dict, "prompt_cache_key": str, "safety_identifier": str, "user": str}
MAX_METADATA_PAIRS = 16
MAX_CHOICES = 16  # n: choices per request, each a request in the engine
# the knobs as body fields: SamplingParams' scalar knobs under their own names (the diffusion knobs are extra body
# fields with the proto's names), except max_new_tokens, which OpenAI calls max_tokens / max_completion_tokens; the
# bounds and validation are SamplingParams' own (one table: dgserve.sampling_params.KNOBS)
OPENAI_NAMES = {"max_new_tokens": ("max_tokens", "max_completion_tokens")}
KNOBS = tuple(name for name in SCALAR_KNOBS if name not in OPENAI_NAMES)
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
# edit in place (docs/edit-in-place.md): top-level extension fields of every JSON door
EDIT_FIELDS = ("initial_canvas", "pinned")
COMMON |= set(EDIT_FIELDS)
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
# OpenAI fields with no faithful meaning here, accepted only at the value that asks for nothing
NO_OP: dict[str, tuple[object, ...]] = {
    "best_of": (1,),
    "echo": (False,),
    "logprobs": (False, 0),
    "top_logprobs": (0,),
    "prompt_logprobs": (0,),
    "top_p": (1,),
    "top_k": (0, -1),  # vLLM's "no truncation"
    "min_p": (0,),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "repetition_penalty": (1,),
    "length_penalty": (1,),
    "use_beam_search": (False,),
    "include_stop_str_in_output": (False,),
    "spaces_between_special_tokens": (True,),
    "logit_bias": ({},),
    "suffix": ("",),
    "functions": ([],),
    "service_tier": ("auto", "default"),
}
_LOGPROBS = "log-probabilities are not returned (a canvas position is accepted over several denoising steps, not "
_LOGPROBS += "drawn once from one distribution)"
_PENALTY = "the diffusion sampler writes a whole canvas in parallel: there is no token-by-token history to penalise"
WHY = {
    "best_of": "one completion per request",
    "logprobs": _LOGPROBS,
    "top_logprobs": _LOGPROBS,
    "prompt_logprobs": _LOGPROBS,
    "top_p": "the diffusion sampler has no nucleus truncation",
    "top_k": "the diffusion sampler has no top-k truncation (it draws from the whole distribution at every position)",
    "min_p": "the diffusion sampler has no min-p truncation (it draws from the whole distribution at every position)",
    "presence_penalty": _PENALTY,
    "frequency_penalty": _PENALTY,
    "repetition_penalty": _PENALTY,
    "length_penalty": "no beam search: a diffusion canvas is refined in parallel, not searched token by token",
    "use_beam_search": "no beam search: a diffusion canvas is refined in parallel, not searched token by token",
    "include_stop_str_in_output": "the text is always cut before the stop string",
    "spaces_between_special_tokens": "special tokens are decoded as written, with no spaces put between them",
    "logit_bias": "logit biases are not supported",
    "functions": "the deprecated functions field is not supported: send tools",
    "service_tier": "this server has one service tier: auto or default",
    "guided_grammar": "grammars are not supported (send guided_json, guided_regex or guided_choice)",
}
CHAT_KWARGS = ("enable_thinking", "add_generation_prompt")


@dataclass(frozen=True)
class Call:
    """One checked OpenAI request."""

    prompt: Prompt
    params: SamplingParams
    model: str  # the name asked for ("" = not given)
    stream: bool = False
    include_usage: bool = False
    drafts: DraftSpec | None = None
    fill_context: bool = False  # no token limit given: the room left in the context (events.fills_context)
    cache_salt: str | None = None  # prefix-cache isolation (docs/prefix-caching.md)
    n: int = 1  # choices: n requests, seeds derived from the request's (``submissions``)
    initial_canvas: str | list[int] | None = None  # the starting canvas (docs/edit-in-place.md)
    pinned: bool | list[list[int]] | None = None  # its pinned ranges, or true for all of it

    def submission(self, request_id: str | None, owner: str | None) -> Submission:
        """The request as the engine's one submission (``owner``: the caller, None when auth is off)."""
        return Submission(
            self.prompt,
            self.params,
            request_id,
            drafts=self.drafts,
            owner=owner,
            fill_context=self.fill_context,
            cache_salt=self.cache_salt,
            initial_canvas=self.initial_canvas,
            pinned=self.pinned,
        )

    def submissions(self, request_id: str, owner: str | None) -> list[Submission]:
        """The ``n`` choices as submissions, to be submitted together so they batch. Choice 0 is ``submission``
        with the request's id; choice i > 0 runs as ``<request_id>#<i>`` with seed ``choice_seed(seed, i)``
        (docs/seeded-noise.md, "Several choices"). A request with n > 1 and no seed draws its one seed here."""
        if self.n == 1:
            return [self.submission(request_id, owner)]
        seed = self.params.seed if self.params.seed is not None else secrets.randbits(64)
        return [
            dataclasses.replace(
                self.submission(choice_request_id(request_id, i), owner),
                params=dataclasses.replace(self.params, seed=choice_seed(seed, i)),
            )
            for i in range(self.n)
        ]


def choice_request_id(request_id: str, index: int) -> str:
    """The engine id of choice ``index``: the request's for choice 0, ``<id>#<index>`` after it (the id cut so that
    it stays within the 256 characters an id may have)."""
    if index == 0:
        return request_id
    suffix = f"#{index}"
    return request_id[: MAX_REQUEST_ID_LENGTH - len(suffix)] + suffix


# ---------------------------------------------------------------------------------------------- requests


def completion_request(body, defaults: SamplingParams, vocab_size: int, max_len: int | None = None) -> Call:
    """POST /v1/completions body → Call. ``max_len`` (the context window): more token ids are refused unread."""
    body = _object(body)
    _check_fields(body, COMPLETION_FIELDS)
    prompt = _completion_prompt(body.get("prompt"), vocab_size, max_len)
    return _call(body, prompt, defaults, "max_tokens", max_len)


def chat_request(body, defaults: SamplingParams, max_len: int | None = None, trust_chat_template: bool = False) -> Call:
    """POST /v1/chat/completions body → Call (messages through the checkpoint's chat template). ``max_len`` (the
    context window): more messages, or content parts in all, are refused (each renders to at least a token).
    ``trust_chat_template``: the operator lets requests send their own ``chat_template`` (else it is refused)."""
    body = _object(body)
    _check_fields(body, CHAT_FIELDS)
    messages = chat_messages(body, max_len)
    kwargs = chat_template_kwargs(body)
    tools = ToolSet.from_openai(body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls"))
    thinking = kwargs.get("enable_thinking", _reasoning_effort(body.get("reasoning_effort")))
    _optional(body, "store", bool)  # accepted, nothing is stored (docs/generation.md, "HTTP fields")
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
    cont = bool(_optional(body, "continue_final_message", bool))
    generation_prompt = _optional(body, "add_generation_prompt", bool)
    if generation_prompt is None:
        generation_prompt = kwargs.get("add_generation_prompt", not cont)
    if cont and generation_prompt:
        raise ValueError("continue_final_message: cannot be combined with add_generation_prompt true")
    return {
        "add_generation_prompt": generation_prompt,
        "continue_final_message": cont,
        "chat_template": _optional(body, "chat_template", str),
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
    kwargs = _optional(body, "chat_template_kwargs", dict) or {}
    for key, value in kwargs.items():
        if key not in CHAT_KWARGS:
            raise ValueError(f"chat_template_kwargs.{clip(key)}: not supported (supported: {', '.join(CHAT_KWARGS)})")
        if not isinstance(value, bool):
            raise ValueError(f"chat_template_kwargs.{key} must be a boolean")
    return kwargs


REASONING_EFFORTS = ("minimal", "low", "medium", "high")


def _reasoning_effort(value) -> bool:
    """OpenAI's ``reasoning_effort`` → Gemma 4's thinking switch: any effort but "none" enables the thought
    channel (the model has one level of thinking); absent or "none": no thinking. Explicit
    ``chat_template_kwargs.enable_thinking`` wins."""
    if value is None or value == "none":
        return False
    if value not in REASONING_EFFORTS:
        raise ValueError(
            f"reasoning_effort must be one of none, {', '.join(REASONING_EFFORTS)}; got {clip(str(value))!r}"
        )
    return True


def edit_fields(body: dict, max_len: int | None) -> dict:
    """The body's ``initial_canvas`` and ``pinned`` (docs/edit-in-place.md) as ``Call`` keyword arguments, their
    shape checked with bounded work: lists longer than ``max_len`` (the context window) are refused unread. The
    engine checks the ids against the vocabulary, the ranges against the draft and both against the request's
    canvases (``Engine.canvas_draft``)."""
    canvas, pinned = body.get("initial_canvas"), body.get("pinned")
    if canvas is not None:
        if isinstance(canvas, list):
            if max_len is not None and len(canvas) > max_len:
                raise ValueError(f"initial_canvas: {len(canvas)} token ids exceed the context window of {max_len}")
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in canvas):
                raise ValueError("initial_canvas must be a string or a list of token ids (-1: a blank)")
        elif not isinstance(canvas, str):
            raise ValueError("initial_canvas must be a string or a list of token ids (-1: a blank)")
    if pinned is not None and not isinstance(pinned, bool):
        if not isinstance(pinned, list):
            raise ValueError("pinned must be true, false or a list of [start, end) ranges")
        if max_len is not None and len(pinned) > max_len:
            raise ValueError(f"pinned: {len(pinned)} ranges exceed the context window of {max_len}")
    return {"initial_canvas": canvas, "pinned": pinned}


def _call(body: dict, prompt: Prompt, defaults: SamplingParams, limit_field: str, max_len: int | None = None) -> Call:
    stream = bool(_optional(body, "stream", bool))
    options = _optional(body, "stream_options", dict)
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
    model = _optional(body, "model", str) or ""
    params = sampling_params(body, defaults, limit_field)
    calls = isinstance(prompt, ChatPrompt) and prompt.calls_tools
    fill = events.fills_context(body.get(limit_field) is not None, params, calls)
    salt = _optional(body, "cache_salt", str)
    return Call(prompt, params, model, stream, include_usage, drafts, fill, salt, n, **edit_fields(body, max_len))


def _choices(n, drafts: bool) -> int:
    """``n``: an integer in [1, MAX_CHOICES] (absent: 1); drafts (previews of one canvas) only with one choice."""
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
        raise ValueError(f"n must be an integer in [1, {MAX_CHOICES}], got {clip(json.dumps(n))}")
    if n > 1 and drafts:
        raise ValueError("n: drafts are available only with n 1")
    return n


def sampling_params(body: dict, defaults: SamplingParams, limit_field: str = "max_tokens") -> SamplingParams:
    """The request's knobs over the model defaults; ValueError names the body field."""
    kw, names = {}, {}
    limit = body.get(limit_field)
    if limit is not None:
        kw["max_new_tokens"], names["max_new_tokens"] = limit, limit_field
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list):
            raise ValueError("stop must be a string or a list of strings")
        kw["stop"] = tuple(stop)
    for name in KNOBS:
        if body.get(name) is not None:
            kw[name] = body[name]
    if body.get("stop_token_ids") is not None:
        ids = body["stop_token_ids"]
        if not isinstance(ids, list):
            raise ValueError("stop_token_ids must be a list of token ids")
        kw["stop_token_ids"] = tuple(ids)
    fmt = output_format(body)
    if fmt is not None:
        kw["response_format"] = fmt
    try:
        params = dataclasses.replace(defaults, **kw)
        if body.get("temperature") is not None:  # OpenAI's temperature on the schedule; explicit t_min/t_max win
            params = with_temperature(params, body["temperature"], {k for k in ("t_min", "t_max") if k in kw})
        return params
    except ValueError as e:
        message = str(e)
        for ours, theirs in names.items():
            if message.startswith(ours):
                message = theirs + message[len(ours) :]
        raise ValueError(message) from None


def output_format(body: dict) -> ResponseFormat | None:
    """The request's output constraint: OpenAI's ``response_format`` or one of vLLM's (``structured_outputs``,
    ``guided_json``, ``guided_regex``, ``guided_choice``), at most one of them; ValueError naming the field."""
    given = [name for name in ("response_format", *GUIDED) if body.get(name) is not None]
    if given and given[0] == "response_format" and body["response_format"] == {"type": "text"}:
        given = given[1:]  # {"type": "text"} asks for nothing
    if len(given) > 1:
        raise ValueError(f"{given[1]}: cannot be combined with {given[0]} (one output constraint per request)")
    if not given:
        return response_format(body.get("response_format"))
    name, value = given[0], body[given[0]]
    if name == "response_format":
        return response_format(value)
    if name == "structured_outputs":
        return _structured_outputs(value)
    return _guided(name, value)


# structured_outputs' constraints (exactly one) and its options (accepted at the value that asks for nothing)
STRUCTURED_KINDS = ("json", "regex", "choice", "json_object", "grammar", "structural_tag")
STRUCTURED_OPTIONS = {
    "disable_fallback": False,
    "disable_any_whitespace": False,
    "disable_additional_properties": False,
}


def _structured_outputs(value) -> ResponseFormat:
    """vLLM's ``structured_outputs``: {json | regex | choice | json_object: true} → ResponseFormat."""
    if not isinstance(value, dict):
        raise ValueError("structured_outputs must be an object with one of json, regex, choice, json_object")
    for key, v in value.items():
        if key in STRUCTURED_OPTIONS and v not in (None, STRUCTURED_OPTIONS[key]):
            raise ValueError(f"structured_outputs.{key}: not supported (only {STRUCTURED_OPTIONS[key]})")
        if key not in STRUCTURED_OPTIONS and key not in STRUCTURED_KINDS and v is not None:
            raise ValueError(f"structured_outputs.{clip(key)}: not supported")
    kinds = [k for k in STRUCTURED_KINDS if value.get(k) not in (None, False)]
    if len(kinds) != 1:
        raise ValueError(f"structured_outputs: give exactly one of {', '.join(STRUCTURED_KINDS[:4])}")
    kind = kinds[0]
    field = f"structured_outputs.{kind}"
    if kind in ("grammar", "structural_tag"):
        raise ValueError(f"{field}: not supported (supported: json, regex, choice, json_object)")
    if kind == "json_object":
        if value[kind] is not True:
            raise ValueError(f"{field} must be true")
        return ResponseFormat("json_object")
    return _guided(field, value[kind], {"json": "json", "regex": "regex", "choice": "choice"}[kind])


def _guided(field: str, value, kind: str | None = None) -> ResponseFormat:
    """One of vLLM's constraints (``guided_json`` / ``_regex`` / ``_choice``, or ``structured_outputs``' json /
    regex / choice) → ResponseFormat; ValueError naming ``field``."""
    kind = kind or field.removeprefix("guided_")
    try:
        if kind == "json":
            if isinstance(value, str):  # the one bounded reader of a client's JSON: size, depth, 400 naming the field
                value = read_schema(value, "response_format")
            if not isinstance(value, (dict, bool)):
                raise ValueError("response_format: must be a JSON schema (an object, or its JSON text)")
            return ResponseFormat("json_schema", schema=json.dumps(value))
        if kind == "regex":
            if not isinstance(value, str):
                raise ValueError("response_format: must be a string (a regular expression)")
            return ResponseFormat("regex", regex=value)
        if not isinstance(value, list):
            raise ValueError("response_format: must be a list of strings")
        return ResponseFormat("choice", choices=tuple(value))
    except ValueError as e:
        message = str(e)
        raise ValueError(
            field + message[len("response_format") :] if message.startswith("response_format") else message
        ) from None


def response_format(value) -> ResponseFormat | None:
    """OpenAI's response_format → ResponseFormat (None for absent or {"type": "text"}); ValueError names it.

    OpenAI: {"type": "text"}, {"type": "json_object"}, {"type": "json_schema", "json_schema": {"name", "schema",
    "strict", "description"}}. dgserve extensions (docs/structured-output.md): {"type": "regex", "regex": "..."}
    and {"type": "choice", "choice": ["a", "b"]}."""
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise ValueError('response_format must be an object with a "type" string')
    kind = value["type"]
    fields = {"text": set(), "json_object": set(), "json_schema": {"json_schema"}, "regex": {"regex"}}
    fields["choice"] = {"choice"}
    if kind not in fields:
        raise ValueError(f"response_format.type must be one of {', '.join(fields)}, got {clip(kind)!r}")
    extra = set(value) - fields[kind] - {"type"}
    if extra:
        raise ValueError(f"response_format.{clip(sorted(extra)[0])}: not used by type {kind!r}")
    if kind == "text":
        return None
    if kind == "json_schema":
        return _json_schema(value.get("json_schema"))
    if kind == "regex":
        return ResponseFormat("regex", regex=value.get("regex"))
    if kind == "choice":
        choices = value.get("choice")
        if not isinstance(choices, list):
            raise ValueError("response_format.choice must be a list of strings")
        return ResponseFormat("choice", choices=tuple(choices))
    return ResponseFormat("json_object")


def _json_schema(spec) -> ResponseFormat:
    """response_format.json_schema: {"name", "schema", "strict", "description"} → ResponseFormat."""
    if not isinstance(spec, dict) or "schema" not in spec:
        raise ValueError('response_format.json_schema must be an object with a "schema"')
    unknown = set(spec) - {"name", "schema", "strict", "description"}
    if unknown:
        raise ValueError(f"response_format.json_schema.{clip(sorted(unknown)[0])}: not supported")
    schema = spec["schema"]
    if not isinstance(schema, (dict, bool)):
        raise ValueError("response_format.json_schema.schema must be a JSON object")
    name, strict = spec.get("name") or "", spec.get("strict") or False
    if not isinstance(name, str) or not isinstance(strict, bool):
        raise ValueError("response_format.json_schema: name must be a string and strict a boolean")
    return ResponseFormat("json_schema", schema=json.dumps(schema), name=name, strict=strict)


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


def _object(body) -> dict:
    if not isinstance(body, dict):
        raise ValueError("body: must be a JSON object")
    return body


def _check_fields(body: dict, known: set[str]) -> None:
    _check_neutral(body)
    for name, value in body.items():
        if name in known or value is None:
            continue
        if name in NO_OP and any(
            (value == v and type(value) is type(v)) or _same_number(value, v) for v in NO_OP[name]
        ):
            continue
        why = WHY.get(name, "not supported by this server")
        raise ValueError(f"{clip(name)}: {why} (got {clip(json.dumps(value))})")


def _check_neutral(body: dict) -> None:
    """The fields accepted and ignored (``NEUTRAL``) must still have their type; ``metadata`` is OpenAI's: at most
    16 string pairs."""
    for name, kind in NEUTRAL.items():
        _optional(body, name, kind)
    metadata = body.get("metadata") or {}
    if len(metadata) > MAX_METADATA_PAIRS or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError(f"metadata must be an object of at most {MAX_METADATA_PAIRS} string values")


def _same_number(a, b) -> bool:
    return (
        isinstance(a, (int, float))
        and isinstance(b, (int, float))
        and not isinstance(a, bool)
        and not isinstance(b, bool)
        and a == b
    )


def _optional(body: dict, name: str, kind: type):
    value = body.get(name)
    if value is not None and not isinstance(value, kind):
        raise ValueError(
            f"{name} must be {'a boolean' if kind is bool else 'an object' if kind is dict else 'a string'}"
        )
    return value
