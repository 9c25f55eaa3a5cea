"""The knobs and output constraints as body fields, read the same way by every JSON door; and OpenAI's fields
that ask for nothing (``NO_OP``: accepted only at that value, any other refused with the reason, ``WHY``) or
nothing of the output (``NEUTRAL``: accepted, checked for their type, ignored; docs/generation.md, "HTTP fields").

``sampling_params`` reads the knobs over the model defaults: SamplingParams' scalar knobs under their own names
(the diffusion knobs are extra body fields with the proto's names), the token limit under the door's name
(``max_tokens``, ``max_completion_tokens``, ``max_output_tokens``), ``stop``, ``stop_token_ids``, ``temperature``
and the output constraint (``output_format``: OpenAI's ``response_format`` or one of vLLM's); the bounds and the
validation are SamplingParams' own (one table: dgserve.sampling_params.KNOBS), their messages renamed to the body
field. ``reasoning_effort`` is OpenAI's thinking switch.
"""

from __future__ import annotations

import dataclasses
import json

from dgserve.sampling_params import SCALAR_KNOBS, SamplingParams, with_temperature
from dgserve.structured import ResponseFormat
from dgserve.structured.response_format import read_schema

from ..errors import clip
from .fields import optional

# vLLM's output constraints, read as a response_format (``output_format``); at most one constraint per request
GUIDED = ("structured_outputs", "guided_json", "guided_regex", "guided_choice")
# fields accepted and ignored: they ask for nothing a server must do to the output (docs/generation.md, "HTTP
# fields"); checked for their type only
NEUTRAL = {"metadata": dict, "prompt_cache_key": str, "safety_identifier": str, "user": str}
MAX_METADATA_PAIRS = 16
# the knobs as body fields: SamplingParams' scalar knobs under their own names, except max_new_tokens, which OpenAI
# calls max_tokens / max_completion_tokens
OPENAI_NAMES = {"max_new_tokens": ("max_tokens", "max_completion_tokens")}
KNOBS = tuple(name for name in SCALAR_KNOBS if name not in OPENAI_NAMES)
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


def check_neutral(body: dict) -> None:
    """The fields accepted and ignored (``NEUTRAL``) must still have their type; ``metadata`` is OpenAI's: at most
    16 string pairs."""
    for name, kind in NEUTRAL.items():
        optional(body, name, kind)
    metadata = body.get("metadata") or {}
    if len(metadata) > MAX_METADATA_PAIRS or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError(f"metadata must be an object of at most {MAX_METADATA_PAIRS} string values")


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


REASONING_EFFORTS = ("minimal", "low", "medium", "high")


def reasoning_effort(value) -> bool:
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
