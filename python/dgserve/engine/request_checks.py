"""What a request is checked against before it is minted: its prompt's ids, its context, its work, its knobs and
its id (docs/architecture.md, "Failures"; docs/generation.md, "Limits"). Every refusal is a ValueError naming the
field, raised with bounded work before the request holds anything.

Public contract:
    limits = RequestLimits(canvas_length, vocab_size, max_model_len, slot_len, max_request_steps, prefill_chunk)
    ids = prompt_ids(prompt, model, tokenizer, chunk, max_tokens)  # text, ids, chat or image prompt → checked ids
    positions = check_context(limits, prompt_tokens, max_new_tokens)  # ValueError past the window or the slot
    tokens = room_left(limits, prompt_tokens)           # the most tokens a request may generate (whole canvases)
    check_output_limit(limits, prompt_tokens, n, field) # ValueError naming field when n > room_left
    n = output_limit(limits, OutputLimits(policy, default, max_length), prompt_tokens, params, given, field)
    check_work(limits, params)                          # ValueError: one canvas's steps past max_request_steps
    check_stop_token_ids(params, vocab_size)            # ValueError naming stop_token_ids[i]
    check_request_id(value, field)                      # ValueError unless 1 to 256 printable characters
    n = check_max_model_len(value, limit)               # the engine's knobs, checked at construction
    n = check_max_model_len(value, limit, allow_long=True)  # above limit: the opt-in, with a warning
    check_max_request_seconds(value)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dgserve.engine.block import canvases
from dgserve.engine.image_batch import image_runs, placeholder_id
from dgserve.engine.prompt import ChatPrompt, ImagePrompt, Prompt
from dgserve.model import DiffusionGemma
from dgserve.sampling_params import SamplingParams
from dgserve.text.token_bounds import ContextLengthError, PromptTooLongError

log = logging.getLogger("dgserve.engine.request_checks")
# the server's opt-in (service/flags.py) to a max_model_len past max_position_embeddings
ALLOW_LONG_MAX_MODEL_LEN = "DGSERVE_ALLOW_LONG_MAX_MODEL_LEN"
MAX_MODEL_LEN_CEILING = 1 << 30  # the largest max_model_len even with the opt-in (ServiceConfig's bound too)

if TYPE_CHECKING:
    from dgserve.text.tokenizer import Tokenizer

MAX_REQUEST_ID_LENGTH = 256


@dataclass(frozen=True)
class RequestLimits:
    """The engine's bounds on one request: the model's canvas length C and vocabulary size, the context window
    (max_model_len positions), the positions one KV cache slot holds (slot_len, at most the window), the most
    denoising steps a request may run (max_request_steps, all its canvases together; None: no limit), and the prompt
    tokens per encoder chunk (prefill_chunk: an image's soft tokens must fit one)."""

    canvas_length: int
    vocab_size: int
    max_model_len: int
    slot_len: int
    max_request_steps: int | None
    prefill_chunk: int


def prompt_ids(
    prompt: Prompt,
    model: DiffusionGemma,
    tokenizer: Tokenizer | None,
    chunk: int,
    max_tokens: int | None = None,
) -> list[int]:
    """Token ids of a prompt (text, ids, chat or an image prompt), validated against the vocabulary; ``chunk`` is
    the prefill chunk (an image's soft tokens must fit one). ValueError naming ``prompt`` (or ``messages``).

    ``max_tokens``: a prompt with more tokens raises PromptTooLongError (a ValueError naming ``prompt``) with
    bounded work: text that cannot fit is rejected by its byte length or a bounded count, never tokenized whole
    (``Tokenizer.encode``)."""
    if isinstance(prompt, (str, ChatPrompt)):
        ids = _encode(prompt, model, tokenizer, chunk, max_tokens)
    else:
        if isinstance(prompt, ImagePrompt):
            if prompt.images:  # the model's checks; the caller placed the placeholders
                image_runs(model, prompt, chunk)
            ids = list(prompt.ids)
        else:
            ids = [int(t) for t in (prompt.tolist() if isinstance(prompt, torch.Tensor) else prompt)]
        if max_tokens is not None and len(ids) > max_tokens:
            raise PromptTooLongError(len(ids), max_tokens, "given")
    V = model.config.vocab_size
    if not ids:
        raise ValueError("prompt: must contain at least one token")
    image_id = placeholder_id(model, prompt, ids)  # -1 when the model takes no images
    bad = [t for t in ids if not 0 <= t < V and t != image_id]
    if bad:
        raise ValueError(f"prompt: token id {bad[0]} is outside the vocabulary [0, {V})")
    return ids


def _encode(
    prompt: str | ChatPrompt, model: DiffusionGemma, tokenizer: Tokenizer | None, chunk: int, max_tokens: int | None
) -> list[int]:
    """A text prompt's ids (BOS first), or a chat's as its template renders it (its images' runs spliced in)."""
    if tokenizer is None:
        raise ValueError("prompt: text and chat prompts need a tokenizer, and this model has none; pass token ids")
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=True, max_tokens=max_tokens)
    tools = prompt.tools.rendered() if prompt.tools is not None else None
    return tokenizer.encode_chat(
        list(prompt.messages),
        prompt.add_generation_prompt,
        prompt.enable_thinking,
        max_tokens=max_tokens,
        tools=tools,
        continue_final_message=prompt.continue_final_message,
        chat_template=prompt.chat_template,
        image_runs=image_runs(model, prompt, chunk),
    )


def check_context(limits: RequestLimits, prompt_tokens: int, max_new_tokens: int, at_least: bool = False) -> int:
    """ContextLengthError (a ValueError with both numbers; its ``maximum`` the most prompt tokens that fit with
    those canvases) when the prompt plus the canvases generated do not fit the context window, or a KV cache slot
    (``slot_len``, when the cache budget holds fewer positions); else the positions needed."""
    C = limits.canvas_length
    n_blocks = canvases(max_new_tokens, C)
    positions = prompt_tokens + n_blocks * C
    if positions > limits.max_model_len:
        raise ContextLengthError(
            f"prompt: {'at least ' if at_least else ''}{prompt_tokens} tokens + {n_blocks} "
            f"canvases of {C} (max_new_tokens {max_new_tokens}) exceed the context window of "
            f"{limits.max_model_len} positions",
            prompt_tokens,
            limits.max_model_len - n_blocks * C,
            at_least,
        )
    if positions > limits.slot_len:
        raise ContextLengthError(
            f"prompt: the request needs {positions} KV cache positions, and the KV cache budget holds "
            f"{limits.slot_len} per request (--kv-cache-memory)",
            prompt_tokens,
            limits.slot_len - n_blocks * C,
            at_least,
        )
    return positions


def room_left(limits: RequestLimits, prompt_tokens: int) -> int:
    """The most tokens a request of ``prompt_tokens`` may generate: the whole canvases left in its context (the
    window, or the KV cache slot when that is smaller); at least one canvas."""
    C = limits.canvas_length
    n = (min(limits.max_model_len, limits.slot_len) - prompt_tokens) // C
    return int(max(1, n) * C)


def check_output_limit(limits: RequestLimits, prompt_tokens: int, wanted: int, field: str) -> None:
    """ValueError naming ``field`` (the door's output-limit field) when ``wanted`` tokens are more than the room
    left after the prompt (``room_left``): ``--max-tokens-policy reject``, vLLM's rule."""
    room = room_left(limits, prompt_tokens)
    if wanted > room:
        raise ValueError(
            f"{field}: {wanted} tokens are more than the room left in the context: the prompt's {prompt_tokens} "
            f"tokens leave {room} of the {min(limits.max_model_len, limits.slot_len)}-position window (whole "
            f"canvases of {limits.canvas_length}); ask for at most {room} (this server refuses a larger limit: "
            "--max-tokens-policy reject)"
        )


MAX_TOKENS_POLICIES = ("clamp", "reject")


@dataclass(frozen=True)
class OutputLimits:
    """How a request's output limit is decided (docs/generation.md, "Limits"). ``policy``: a limit the caller sent
    above the room left is lowered to the room ("clamp", the default; its finish says "length" when that limit
    ends it) or refused ("reject", vLLM's rule). ``default_max_tokens``: the limit of a request that sent none
    (the operator's --default-max-tokens, else generation_config.json's max_new_tokens; None: neither).
    ``max_length``: generation_config.json's max_length (prompt + output, transformers' meaning), the default when
    there is no ``default_max_tokens``. With neither, an output a grammar ends (a response_format, or tools it may
    call) fills the room left, and any other takes the built-in max_new_tokens."""

    policy: str = "clamp"
    default_max_tokens: int | None = None
    max_length: int | None = None

    def __post_init__(self) -> None:
        if self.policy not in MAX_TOKENS_POLICIES:
            raise ValueError(f"max_tokens_policy must be one of {', '.join(MAX_TOKENS_POLICIES)}, got {self.policy!r}")


def output_limit(
    limits: RequestLimits, out: OutputLimits, prompt_tokens: int, params: SamplingParams, given: bool, field: str
) -> int:
    """The max_new_tokens a request runs with: its own (``given``) or the default (``OutputLimits``), at most the
    room left (``room_left``); a limit the caller gave above the room is refused under the "reject" policy
    (``check_output_limit``, naming ``field``). A default is never refused, only lowered."""
    room = room_left(limits, prompt_tokens)
    wanted = params.max_new_tokens
    if not given:
        if out.default_max_tokens is not None:
            wanted = out.default_max_tokens
        elif out.max_length is not None:
            wanted = max(1, out.max_length - prompt_tokens)
        elif params.response_format is not None:
            wanted = room
    elif out.policy == "reject":
        check_output_limit(limits, prompt_tokens, wanted, field)
    return min(wanted, room)


def check_work(limits: RequestLimits, params: SamplingParams) -> None:
    """ValueError naming ``max_denoising_steps`` when one canvas alone may take more denoising steps than
    ``max_request_steps``. More canvases than the limit affords are not refused: the engine ends the request with
    finish reason "length" when its steps reach the limit (docs/generation.md, "Limits")."""
    limit = limits.max_request_steps
    if limit is not None and params.max_denoising_steps > limit:
        raise ValueError(
            f"max_denoising_steps: {params.max_denoising_steps} steps for one canvas are more than this server's "
            f"limit of {limit} denoising steps per request (--max-request-steps)"
        )


def check_stop_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """ValueError naming ``stop_token_ids[i]`` for an id outside the vocabulary."""
    for i, t in enumerate(params.stop_token_ids):
        if t >= vocab_size:
            raise ValueError(f"stop_token_ids[{i}]: token id {t} is outside the vocabulary [0, {vocab_size})")


def check_request_id(value: str, field: str = "request_id") -> None:
    """ValueError naming ``field`` unless ``value`` is 1 to 256 printable characters. Ids end up in logs, metrics
    and error messages: no control characters (forged log lines), no megabyte ids. The message does not echo it."""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_REQUEST_ID_LENGTH:
        n = len(value) if isinstance(value, str) else type(value).__name__
        raise ValueError(f"{field}: must be 1 to {MAX_REQUEST_ID_LENGTH} printable characters, got {n}")
    if not value.isprintable():
        bad = next(c for c in value if not c.isprintable())
        raise ValueError(
            f"{field}: must be 1 to {MAX_REQUEST_ID_LENGTH} printable characters, got {bad!r} at "
            f"index {value.index(bad)}"
        )


def check_max_model_len(value: int | None, limit: int, allow_long: bool = False) -> int:
    """The engine's context window: ``value``, or the model's max_position_embeddings (``limit``) when None;
    ValueError unless an integer in [1, limit]. Above ``limit`` only when ``allow_long`` (the server's
    ``DGSERVE_ALLOW_LONG_MAX_MODEL_LEN=1``, vLLM's ``VLLM_ALLOW_LONG_MAX_MODEL_LEN``; the engine's
    ``allow_long_max_model_len``), with a warning: the model was not configured for those positions
    (docs/generation.md, "Limits: what one request can cost")."""
    if value is None:
        return limit
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_MODEL_LEN_CEILING:
        raise ValueError(
            f"max_model_len must be an integer in [1, {limit}] (the model's max_position_embeddings), got {value!r}"
        )
    if value > limit:
        if not allow_long:
            raise ValueError(
                f"max_model_len {value} exceeds the model's max_position_embeddings {limit}; set "
                f"{ALLOW_LONG_MAX_MODEL_LEN}=1 (Engine: allow_long_max_model_len=True) to allow it (positions past "
                f"{limit} may give poor output)"
            )
        log.warning(
            "max_model_len %d exceeds the model's max_position_embeddings %d (allowed by %s=1): positions past %d "
            "may give poor output",
            value,
            limit,
            ALLOW_LONG_MAX_MODEL_LEN,
            limit,
        )
    return value


def check_max_request_seconds(value: float | None) -> None:
    """ValueError unless the engine's ``max_request_seconds`` is > 0 or None."""
    if value is not None and not value > 0:
        raise ValueError(f"max_request_seconds must be > 0 or None, got {value!r}")
