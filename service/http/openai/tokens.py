"""POST /tokenize and /detokenize, in vLLM's shapes: what a client needs to count and read tokens as the model does.

    POST /tokenize    {"prompt": str} or {"messages": [...], "add_generation_prompt"?, "chat_template_kwargs"?},
                      "add_special_tokens"? (text: default true, as generation encodes a prompt), "model"?,
                      "return_token_strs"? → {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize  {"tokens": [int], "model"?} → {"prompt": str}

A chat is rendered and tokenized by the checkpoint's chat template exactly as /v1/chat/completions does it (the
caller's text never becomes control tokens: docs/architecture.md, "Content is content"); text is encoded as a
completion's prompt is (special-token texts in it are parsed). At most max_model_len tokens (a longer prompt
could never be used; refused with bounded work). Errors are OpenAI error bodies naming the field, as for generation.
"""

from __future__ import annotations

import asyncio

from fastapi import Request

from dgserve.engine.prompt import ChatPrompt

from ... import events
from ...errors import clip
from ...images import MM_KWARGS, read_images, request_reader
from ..body import off_loop, read_json
from ..gate import Gate
from .input import chat_messages, chat_template_kwargs

TOKENIZE_FIELDS = {"model", "prompt", "messages", "add_generation_prompt", "add_special_tokens", "return_token_strs"}
TOKENIZE_FIELDS |= {"chat_template_kwargs", MM_KWARGS}
DETOKENIZE_FIELDS = {"model", "tokens"}


async def tokenize(gate: Gate, request: Request) -> dict:
    body, engine, tok = await _open(gate, request, TOKENIZE_FIELDS, "prompt")
    info = gate.state.info
    special = _flag(body, "add_special_tokens", bool, True)
    if ("prompt" in body) == ("messages" in body):
        raise ValueError("prompt: give exactly one of prompt (a string) and messages (a chat)")
    if "prompt" in body:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise ValueError("prompt must be a string")
        if special:
            ids = await engine.tokenize(prompt)
        else:
            ids = await engine.tokenizing(tok.encode, prompt, False, info.max_model_len)
    else:
        reader = request_reader(gate.state.images, body.get(MM_KWARGS))
        chat = await off_loop(request, _chat, body, info.max_model_len)
        ids = await engine.tokenize(await read_images(chat, reader))
    strs = None
    if _flag(body, "return_token_strs", bool, False):  # one decode per token, up to max_model_len: off the loop
        strs = await engine.tokenizing(lambda: [tok.decode([t], skip_special_tokens=False) for t in ids])
    return {"count": len(ids), "max_model_len": info.max_model_len, "tokens": ids, "token_strs": strs}


async def detokenize(gate: Gate, request: Request) -> dict:
    body, _, tok = await _open(gate, request, DETOKENIZE_FIELDS, "tokens")
    info = gate.state.info
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise ValueError("tokens must be a non-empty list of token ids")
    ids = events.token_ids(tokens, info.vocab_size, "tokens", info.max_model_len)
    return {"prompt": await asyncio.to_thread(tok.decode, ids)}


async def _open(gate: Gate, request: Request, fields: set[str], field: str):
    """(body, engine, tokenizer) of an authorized call to a ready server for a served model."""
    gate.authorize(request)
    body = _fields(await read_json(request, gate.max_body_bytes), fields)
    engine = gate.state.ready_engine()
    gate.state.check_model(_flag(body, "model", str, ""))
    if engine.tokenizer is None:
        raise ValueError(f"{field}: this model has no tokenizer; {request.url.path} needs one")
    return body, engine, engine.tokenizer


def _chat(body: dict, max_len: int) -> ChatPrompt:
    """The chat as /v1/chat/completions reads it (the same checks), without tools."""
    messages = chat_messages(body, max_len)
    kwargs = chat_template_kwargs(body)
    generation_prompt = _flag(body, "add_generation_prompt", bool, kwargs.get("add_generation_prompt", True))
    return ChatPrompt(messages, generation_prompt, kwargs.get("enable_thinking", False))


def _fields(body, known: set[str]) -> dict:
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object")
    for name in body:
        if name not in known:
            raise ValueError(f"{clip(name)}: unknown field (known: {', '.join(sorted(known))})")
    return body


def _flag(body: dict, name: str, kind: type, default):
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise ValueError(f"{name} must be a {'boolean' if kind is bool else kind.__name__}")
    return value
