"""What a request is checked against before it is minted: its prompt's ids, its context, its work, its knobs and
its id (docs/architecture.md, "Failures"; docs/generation.md, "Limits"). Every refusal is a ValueError naming the
field, raised with bounded work before the request holds anything.

Public contract:
    limits = RequestLimits(canvas_length, vocab_size, max_model_len, slot_len, max_request_steps, prefill_chunk)
    ids = prompt_ids(prompt, model, tokenizer, chunk, max_tokens)  # text, ids, chat or image prompt → checked ids
    positions = check_context(limits, prompt_tokens, max_new_tokens)  # ValueError past the window or the slot
    tokens = room_left(limits, prompt_tokens, params)   # the most tokens a request may generate (whole canvases)
    check_work(limits, params)                          # ValueError past max_request_steps
    check_stop_token_ids(params, vocab_size)            # ValueError naming stop_token_ids[i]
    check_request_id(value, field)                      # ValueError unless 1 to 256 printable characters
    n = check_max_model_len(value, limit)               # the engine's knobs, checked at construction
    check_max_request_seconds(value)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dgserve.engine.block import canvases
from dgserve.engine.image_batch import image_runs, placeholder_id
from dgserve.engine.prompt import ChatPrompt, ImagePrompt, Prompt
from dgserve.model import DiffusionGemma
from dgserve.sampling_params import SamplingParams
from dgserve.text.token_bounds import PromptTooLongError

if TYPE_CHECKING:
    from dgserve.text.tokenizer import Tokenizer

MAX_REQUEST_ID_LENGTH = 256


@dataclass(frozen=True)
class RequestLimits:
    """The engine's bounds on one request: the model's canvas length C and vocabulary size, the context window
    (max_model_len positions), the positions one KV cache slot holds (slot_len, at most the window), the most
    denoising steps a request may ask for (max_request_steps: steps x canvases; None: no limit), and the prompt
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
    """ValueError (with both numbers) when the prompt plus the canvases generated do not fit the context window,
    or a KV cache slot (``slot_len``, when the cache budget holds fewer positions); else the positions needed."""
    C = limits.canvas_length
    n_blocks = canvases(max_new_tokens, C)
    positions = prompt_tokens + n_blocks * C
    if positions > limits.max_model_len:
        raise ValueError(
            f"prompt: {'at least ' if at_least else ''}{prompt_tokens} tokens + {n_blocks} "
            f"canvases of {C} (max_new_tokens {max_new_tokens}) exceed the context window of "
            f"{limits.max_model_len} positions"
        )
    if positions > limits.slot_len:
        raise ValueError(
            f"prompt: the request needs {positions} KV cache positions, and the KV cache budget holds "
            f"{limits.slot_len} per request (--kv-cache-memory)"
        )
    return positions


def room_left(limits: RequestLimits, prompt_tokens: int, params: SamplingParams) -> int:
    """The most tokens a request of ``prompt_tokens`` may generate: the whole canvases left in its context (the
    window, or the KV cache slot when that is smaller), and at most ``max_request_steps`` of work; at least one."""
    C = limits.canvas_length
    n = (min(limits.max_model_len, limits.slot_len) - prompt_tokens) // C
    if limits.max_request_steps is not None:
        n = min(n, limits.max_request_steps // params.max_denoising_steps)
    return int(max(1, n) * C)


def check_work(limits: RequestLimits, params: SamplingParams) -> None:
    """ValueError naming the knobs when a request asks for more denoising steps than ``max_request_steps``."""
    limit, C = limits.max_request_steps, limits.canvas_length
    n = canvases(params.max_new_tokens, C)
    work = params.max_denoising_steps * n
    if limit is not None and work > limit:
        raise ValueError(
            f"max_denoising_steps: {params.max_denoising_steps} steps x {n} canvases of {C} tokens "
            f"(max_new_tokens {params.max_new_tokens}) = {work} denoising steps, more than this server's limit "
            f"of {limit} per request (--max-request-steps); lower max_denoising_steps or max_new_tokens"
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


def check_max_model_len(value: int | None, limit: int) -> int:
    """The engine's context window: ``value``, or the model's max_position_embeddings (``limit``) when None;
    ValueError unless an integer in [1, limit]."""
    if value is None:
        return limit
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
        raise ValueError(
            f"max_model_len must be an integer in [1, {limit}] (the model's max_position_embeddings), got {value!r}"
        )
    return value


def check_max_request_seconds(value: float | None) -> None:
    """ValueError unless the engine's ``max_request_seconds`` is > 0 or None."""
    if value is not None and not value > 0:
        raise ValueError(f"max_request_seconds must be > 0 or None, got {value!r}")
