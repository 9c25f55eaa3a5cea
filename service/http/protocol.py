"""OpenAI JSON ↔ dgserve objects: the HTTP twin of ``service/convert.py``.

Requests: ``completion_request`` / ``chat_request`` check a decoded JSON body and return a ``Call`` (prompt,
SamplingParams, options). Every field is checked once, with a ValueError whose message starts with the OpenAI
field name (``max_tokens must be ...``, ``messages[2].role ...``); the diffusion knobs are extra body fields with
the proto's names and SamplingParams' single validation. An OpenAI field that dgserve cannot honour faithfully is
accepted only at its no-op value (``n: 1``, ``logprobs: false``, ``top_p: 1`` ...); any other value, and any
field we do not know, is a ValueError naming it — never silently ignored.

Bodies: ``decode_body`` turns the raw bytes into JSON with bounded work and bounded shape (at most
MAX_JSON_VALUES values, MAX_JSON_DEPTH levels) and refuses text that is not valid Unicode (a JSON ``"\ud800"``
escape decodes to a lone surrogate, which no tokenizer, regex engine or UTF-8 encoder accepts), each a ValueError
naming ``body`` or the field. Checking the request is then O(fields): a list is refused by its length (token ids,
messages) before its items are looked at.

Responses: ``completion`` / ``chat_completion`` (non-streaming) and ``*_chunk`` (SSE), with ``usage`` and a
``dgserve`` extension object (seed, request id, per-block denoising stats, timing).
"""

from __future__ import annotations

import dataclasses
import json
import json.decoder
import json.scanner
import math
import time
from dataclasses import dataclass
from typing import Any, cast

from dgserve.engine.async_engine import Draft, DraftSpec, Finished
from dgserve.engine.engine import ChatPrompt, Prompt
from dgserve.outputs import FINISH_CANCELLED, FINISH_EOS, FINISH_LENGTH, FINISH_STOP, BlockOutput
from dgserve.sampling_params import SCALAR_KNOBS, SamplingParams
from dgserve.structured import ResponseFormat
from dgserve.text.tokenizer import check_unicode

from ..errors import clip

# dgserve finish reasons → OpenAI's ("abort": the request was cancelled by the server, e.g. a drain timeout; vLLM's)
FINISH_REASONS = {FINISH_EOS: "stop", FINISH_STOP: "stop", FINISH_LENGTH: "length", FINISH_CANCELLED: "abort"}
# the knobs as body fields: SamplingParams' scalar knobs under their own names (the diffusion knobs are extra body
# fields with the proto's names), except max_new_tokens, which OpenAI calls max_tokens / max_completion_tokens; the
# bounds and validation are SamplingParams' own (one table: dgserve.sampling_params.KNOBS)
OPENAI_NAMES = {"max_new_tokens": ("max_tokens", "max_completion_tokens")}
KNOBS = tuple(name for name in SCALAR_KNOBS if name not in OPENAI_NAMES)
COMMON = {"model", "stream", "stream_options", "max_tokens", "stop", "user", "drafts", "response_format", *KNOBS}
COMPLETION_FIELDS = COMMON | {"prompt"}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "chat_template_kwargs"}
# OpenAI fields with no faithful meaning here, accepted only at the value that asks for nothing
NO_OP: dict[str, tuple[object, ...]] = {
    "n": (1,),
    "best_of": (1,),
    "echo": (False,),
    "logprobs": (False, 0),
    "top_logprobs": (0,),
    "top_p": (1,),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "logit_bias": ({},),
    "tools": ([],),
    "tool_choice": ("none",),
    "parallel_tool_calls": (False,),
    "suffix": ("",),
    "functions": ([],),
}
WHY = {
    "temperature": "the sampler follows a temperature schedule: set t_min and t_max instead",
    "n": "one completion per request",
    "best_of": "one completion per request",
    "logprobs": "log-probabilities are not returned",
    "top_logprobs": "log-probabilities are not returned",
    "top_p": "the diffusion sampler has no nucleus truncation",
    "tools": "tool calling is not supported",
    "tool_choice": "tool calling is not supported",
    "functions": "tool calling is not supported",
}
CHAT_KWARGS = ("enable_thinking", "add_generation_prompt")
# the shape of a body: json.loads holds the GIL for its whole call (~70 ns a value), so a 16 MB body of 8 million
# small values stalled every other caller for 0.6 s even in a worker thread; a real request has a few thousand
# values (token ids and messages are bounded by the context window) and a few levels of nesting (a JSON schema's
# included), and deeper structures only end in RecursionError in json, jinja or a grammar compiler
MAX_JSON_VALUES = 1 << 18
MAX_JSON_DEPTH = 128


@dataclass(frozen=True)
class Call:
    """One checked OpenAI request."""

    prompt: Prompt
    params: SamplingParams
    model: str  # the name asked for ("" = not given)
    stream: bool = False
    include_usage: bool = False
    drafts: DraftSpec | None = None


# ---------------------------------------------------------------------------------------------- requests


def decode_body(raw: bytes):
    """The JSON value of a request body (UTF-8, RFC 8259). ValueError naming ``body`` when it is not UTF-8 JSON,
    has more than MAX_JSON_VALUES values or more than MAX_JSON_DEPTH levels, or naming the field whose text (or
    field name) holds a lone surrogate (``messages[0].content: ...``). Builds at most about MAX_JSON_VALUES
    values; safe in a worker thread."""
    try:
        text = raw.decode("utf-8")  # strict: json.loads(bytes) would let UTF-8-encoded surrogates through
    except UnicodeDecodeError as e:
        raise ValueError(f"body: not valid UTF-8 (byte {e.start}: {e.reason})") from None
    opens = text.count("[") + text.count("{")
    try:
        # commas and brackets bound the number of values from above (strings' own included): below the cap, the
        # fast C parser; above, the Python one, which counts as it goes and gives the GIL up between values
        value = json.loads(text) if text.count(",") + opens <= MAX_JSON_VALUES else _counted_loads(text)
    except RecursionError:
        raise ValueError(f"body: nested deeper than {MAX_JSON_DEPTH} levels") from None
    except _TooManyValues:
        raise ValueError(f"body: more than {MAX_JSON_VALUES} JSON values") from None
    except ValueError as e:
        raise ValueError(f"body: not valid JSON ({e})") from None
    # a lone surrogate can only come from a \uD800-\uDFFF escape (the text itself is strict UTF-8)
    escapes = "\\ud" in text or "\\uD" in text
    if escapes or opens > MAX_JSON_DEPTH:
        _check_shape(value, escapes)
    return value


class _TooManyValues(Exception):
    pass


def _counted_loads(text: str):
    """json.loads with the pure-Python scanner, stopping with _TooManyValues after MAX_JSON_VALUES values."""
    count = 0

    def counted(scan_once):
        def scan(s, idx):
            nonlocal count
            count += 1
            if count > MAX_JSON_VALUES:
                raise _TooManyValues
            return scan_once(s, idx)

        return scan

    # the pure-Python parser's hooks: json.decoder / json.scanner internals (unchanged since Python 2.7, untyped)
    pure: Any = json.decoder
    decoder: Any = json.JSONDecoder()
    decoder.parse_array = lambda s_and_end, scan_once: pure.JSONArray(s_and_end, counted(scan_once))
    decoder.parse_object = lambda s_and_end, strict, scan_once, *hooks: pure.JSONObject(
        s_and_end, strict, counted(scan_once), *hooks
    )
    decoder.scan_once = cast(Any, json.scanner).py_make_scanner(decoder)
    return decoder.decode(text)


def _check_shape(value, text: bool) -> None:
    """ValueError when ``value`` nests deeper than MAX_JSON_DEPTH (naming ``body``) or, with ``text``, holds a
    string or field name that is not valid Unicode (naming its field). Iterative: no recursion on client data."""
    stack: list[tuple[object, int, tuple]] = [(value, 1, ())]
    while stack:
        item, depth, path = stack.pop()
        if isinstance(item, (dict, list)) and depth > MAX_JSON_DEPTH:
            raise ValueError(f"body: nested deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(item, dict):
            for key, child in item.items():
                if text and not key.isascii():  # (the field name is built only for a suspect text)
                    check_unicode(key, field_name(path), "field name")
                stack.append((child, depth + 1, (path, key)))
        elif isinstance(item, list):
            stack.extend((child, depth + 1, (path, i)) for i, child in enumerate(item))
        elif text and isinstance(item, str) and not item.isascii():
            check_unicode(item, field_name(path), "text")


def field_name(path: tuple) -> str:
    """``messages[0].content`` for the linked path ((((), "messages"), 0), "content"); ``body`` for ()."""
    keys = []
    while path:
        path, key = path
        keys.append(key)
    name = ""
    for key in reversed(keys):
        name += f"[{key}]" if isinstance(key, int) else (f".{clip(key)}" if name else clip(key))
    return name or "body"


def completion_request(body, defaults: SamplingParams, vocab_size: int, max_len: int | None = None) -> Call:
    """POST /v1/completions body → Call. ``max_len`` (the context window): more token ids are refused unread."""
    body = _object(body)
    _check_fields(body, COMPLETION_FIELDS)
    return _call(body, _completion_prompt(body.get("prompt"), vocab_size, max_len), defaults, "max_tokens")


def chat_request(body, defaults: SamplingParams, max_len: int | None = None) -> Call:
    """POST /v1/chat/completions body → Call (messages through the checkpoint's chat template). ``max_len`` (the
    context window): more messages, or content parts in all, are refused (each renders to at least a token)."""
    body = _object(body)
    _check_fields(body, CHAT_FIELDS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    if max_len is not None:
        _check_chat_size(messages, max_len)
    kwargs = _optional(body, "chat_template_kwargs", dict) or {}
    for key, value in kwargs.items():
        if key not in CHAT_KWARGS:
            raise ValueError(f"chat_template_kwargs.{clip(key)}: not supported (supported: {', '.join(CHAT_KWARGS)})")
        if not isinstance(value, bool):
            raise ValueError(f"chat_template_kwargs.{key} must be a boolean")
    prompt = ChatPrompt(
        tuple(messages), kwargs.get("add_generation_prompt", True), kwargs.get("enable_thinking", False)
    )
    limit = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    return _call(body, prompt, defaults, limit)


def _call(body: dict, prompt: Prompt, defaults: SamplingParams, limit_field: str) -> Call:
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
    model = _optional(body, "model", str) or ""
    return Call(prompt, sampling_params(body, defaults, limit_field), model, stream, include_usage, drafts)


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
    fmt = response_format(body.get("response_format"))
    if fmt is not None:
        kw["response_format"] = fmt
    try:
        return dataclasses.replace(defaults, **kw)
    except ValueError as e:
        message = str(e)
        for ours, theirs in names.items():
            if message.startswith(ours):
                message = theirs + message[len(ours) :]
        raise ValueError(message) from None


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
        spec = value.get("json_schema")
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
    if kind == "regex":
        return ResponseFormat("regex", regex=value.get("regex"))
    if kind == "choice":
        choices = value.get("choice")
        if not isinstance(choices, list):
            raise ValueError("response_format.choice must be a list of strings")
        return ResponseFormat("choice", choices=tuple(choices))
    return ResponseFormat("json_object")


def _completion_prompt(prompt, vocab_size: int, max_len: int | None = None) -> Prompt:
    """A string, a list of token ids, or a one-element list of either (OpenAI's batch form, batch size 1)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must not be empty")
        return prompt
    if isinstance(prompt, list) and max_len is not None and len(prompt) > max_len:
        raise ValueError(f"prompt: {len(prompt)} token ids exceed the context window of {max_len} positions")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        for i, t in enumerate(prompt):
            if not 0 <= t < vocab_size:
                raise ValueError(f"prompt[{i}]: token id {t} is outside the vocabulary [0, {vocab_size})")
        return prompt
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
    every = spec.get("every_n_steps", 1)
    if isinstance(every, bool) or not isinstance(every, int) or not 1 <= every <= 1024:
        raise ValueError(f"drafts.every_n_steps must be an integer in [1, 1024], got {every!r}")
    if not isinstance(spec.get("include_text", False), bool):
        raise ValueError("drafts.include_text must be a boolean")
    return DraftSpec(every_n_steps=every, include_text=spec.get("include_text", False))


def _object(body) -> dict:
    if not isinstance(body, dict):
        raise ValueError("body: must be a JSON object")
    return body


def _check_fields(body: dict, known: set[str]) -> None:
    for name, value in body.items():
        if name in known or value is None:
            continue
        if name in NO_OP and any(
            (value == v and type(value) is type(v)) or _same_number(value, v) for v in NO_OP[name]
        ):
            continue
        why = WHY.get(name, "not supported by this server")
        raise ValueError(f"{clip(name)}: {why} (got {clip(json.dumps(value))})")


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


# ---------------------------------------------------------------------------------------------- responses


@dataclass
class Output:
    """What a request produced so far (filled from its event stream)."""

    request_id: str
    model: str
    seed: int
    chat: bool
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    text: str = ""
    blocks: list[dict] = dataclasses.field(default_factory=list)
    finished: Finished | None = None

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def add_block(self, block: BlockOutput) -> dict:
        stats = block_stats(block)
        self.text += block.text
        self.blocks.append(stats)
        return stats


def block_stats(b: BlockOutput) -> dict:
    s = b.stats
    return {
        "index": b.index,
        "tokens": len(b.token_ids),
        "denoising_steps": s.denoising_steps,
        "tokens_per_forward": round(s.tokens_per_forward, 4),
        "mean_entropy": _finite(s.mean_entropy),
        "denoise_ms": round(s.denoise_seconds * 1e3, 3),
    }


def usage(f: Finished) -> dict:
    return {
        "prompt_tokens": f.prompt_tokens,
        "completion_tokens": f.completion_tokens,
        "total_tokens": f.prompt_tokens + f.completion_tokens,
    }


def extension(out: Output) -> dict:
    """The ``dgserve`` object of a response / final chunk: seed, request id, per-block stats, timing."""
    f = out.finished
    ext = {"request_id": out.request_id, "seed": out.seed, "blocks": out.blocks}
    if f is not None:
        ext.update(
            denoising_steps=f.denoising_steps,
            queue_ms=round(f.queue_seconds * 1e3, 3),
            first_block_ms=round(_finite(f.first_block_seconds) * 1e3, 3),
            total_ms=round(f.total_seconds * 1e3, 3),
        )
    return ext


def response(out: Output) -> dict:
    """The non-streaming body (chat.completion or text_completion)."""
    f = out.finished
    if f is None:
        raise RuntimeError(f"response: request {out.request_id!r} has not finished")
    if out.chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": out.text},
            "logprobs": None,
            "finish_reason": FINISH_REASONS.get(f.finish_reason, f.finish_reason),
        }
    else:
        choice = {
            "index": 0,
            "text": out.text,
            "logprobs": None,
            "finish_reason": FINISH_REASONS.get(f.finish_reason, f.finish_reason),
        }
    return {
        "id": out.request_id,
        "object": out.object,
        "created": out.created,
        "model": out.model,
        "choices": [choice],
        "usage": usage(f),
        "system_fingerprint": None,
        "dgserve": extension(out),
    }


def chunk(
    out: Output,
    delta: str | None = None,
    *,
    role: bool = False,
    finish: str | None = None,
    extra: dict | None = None,
    usage_: dict | None = None,
    no_choices: bool = False,
) -> dict:
    """One SSE chunk: a text delta, the role opener (chat), the finishing chunk, or the usage-only chunk."""
    body = {
        "id": out.request_id,
        "object": out.object + ("" if not out.chat else ".chunk"),
        "created": out.created,
        "model": out.model,
        "system_fingerprint": None,
    }
    if no_choices:
        body["choices"] = []
    elif out.chat:
        d = {"role": "assistant", "content": ""} if role else ({} if delta is None else {"content": delta})
        body["choices"] = [{"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}]
    else:
        body["choices"] = [{"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}]
    if usage_ is not None or no_choices:
        body["usage"] = usage_
    if extra is not None:
        body["dgserve"] = extra
    return body


def draft_event(d: Draft) -> dict:
    o = d.output
    return {
        "block_index": o.index,
        "step": o.step,
        "token_ids": o.token_ids,
        "mean_entropy": _finite(o.mean_entropy),
        "text": d.text,
    }


def sse(data: dict | str, event: str | None = None) -> bytes:
    """One server-sent event: ``[event: NAME\\n]data: JSON\\n\\n``."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return ((f"event: {event}\n" if event else "") + f"data: {text}\n\n").encode()


def _finite(x: float) -> float:
    return x if math.isfinite(x) else 0.0
