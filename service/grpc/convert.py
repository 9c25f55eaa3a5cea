"""Protobuf ↔ dgserve objects: the only module that imports both.

Every validation message names the proto field (``params.t_max must be > t_min ...``, ``token_ids.ids[3]: ...``)
so that INVALID_ARGUMENT tells the caller exactly what to fix. The knobs' field list, bounds and validation are
SamplingParams' own (``dgserve.sampling_params.KNOBS``): nothing here repeats them. The draft options' bounds and
the token-id check are ``service.events``' (the HTTP door uses the same), and responses encode its door-neutral
events.

Conversion runs on the event loop, so its work is bounded whatever the message holds: a repeated field's length is
checked (an O(1) ``len``) before any per-item Python work, and refused when it could never fit the context window
(a 16 MB message of token ids or empty chat messages took 1.6 s / 2.9 s of loop time to convert).
"""

from __future__ import annotations

import dataclasses
import math

import torch

import dgserve
from dgserve import sampling_params as sp
from dgserve.engine.async_engine import AsyncEngine, DraftSpec
from dgserve.engine.prompt import ChatPrompt, Prompt, Submission
from dgserve.outputs import FINISH_CANCELLED, FINISH_EOS, FINISH_LENGTH, FINISH_STOP
from dgserve.sampling_params import SamplingParams
from dgserve.structured import ResponseFormat
from dgserve.structured.response_format import read_schema
from dgserve.structured.tools import ToolSet
from dgserve.v1 import text_generation_pb2 as pb

from .. import events, images

# the finish reasons (events.FINISH_REASONS) as the proto's enum
FINISH_REASONS = {
    events.FINISH_TOOL_CALLS: pb.FINISH_REASON_TOOL_CALLS,
    FINISH_EOS: pb.FINISH_REASON_EOS,
    FINISH_LENGTH: pb.FINISH_REASON_LENGTH,
    FINISH_STOP: pb.FINISH_REASON_STOP,
    FINISH_CANCELLED: pb.FINISH_REASON_CANCELLED,
}
# the proto's `optional` scalars: SamplingParams' scalar knobs, same names (tests/service/test_knob_surface.py)
_SCALARS = sp.SCALAR_KNOBS


# ---------------------------------------------------------------------------------------------- requests


def submission(
    request: pb.GenerateRequest,
    info: pb.GetModelInfoResponse,
    defaults: SamplingParams,
    owner: str | None,
    request_id: str | None,
) -> Submission:
    """The GenerateRequest as the engine's one submission (``owner``: the caller; ``request_id``: the request's id,
    None to let the engine mint one); ValueError naming the field."""
    prompt_ = prompt(request, info.vocab_size, info.max_model_len)
    params = with_response_format(sampling_params(request.params, defaults), request)
    calls_tools = isinstance(prompt_, ChatPrompt) and prompt_.calls_tools
    return Submission(
        prompt_,
        params,
        request_id,
        drafts=draft_spec(request.drafts),
        owner=owner,
        fill_context=events.fills_context(request.params.HasField("max_new_tokens"), params, calls_tools),
        limit_field="params.max_new_tokens",
        cache_salt=request.cache_salt or None,
        **initial_canvas_fields(request, info.max_model_len),
    )


def initial_canvas_fields(request: pb.GenerateRequest, max_len: int) -> dict:
    """GenerateRequest.initial_canvas and pinned (docs/edit-in-place.md) as Submission keyword arguments; repeated
    fields longer than ``max_len`` (the context window) are refused unread. The admission
    (``initial_canvas.read_initial_canvas``) checks the rest, naming the same fields."""
    canvas: str | list[int] | None = None
    if request.HasField("initial_canvas"):
        kind = request.initial_canvas.WhichOneof("draft")
        if kind is None:
            raise ValueError("initial_canvas: set text or ids")
        if kind == "text":
            canvas = request.initial_canvas.text
        else:
            ids = request.initial_canvas.ids.ids
            if len(ids) > max_len:
                raise ValueError(f"initial_canvas: {len(ids)} token ids exceed the context window of {max_len}")
            canvas = list(ids)
    pinned: bool | list[list[int]] | None = None
    if request.HasField("pinned"):
        msg = request.pinned
        if msg.all and msg.ranges:
            raise ValueError("pinned: set all or ranges, not both")
        if len(msg.ranges) > max_len:
            raise ValueError(f"pinned: {len(msg.ranges)} ranges exceed the context window of {max_len}")
        pinned = True if msg.all else [[r.start, r.end] for r in msg.ranges]
    return {"initial_canvas": canvas, "pinned": pinned}


def sampling_params(msg: pb.SamplingParams, defaults: SamplingParams) -> SamplingParams:
    """The request's knobs over the model defaults; ValueError names ``params.<field>``."""
    if msg.HasField("n") and msg.n != 1:
        raise NotImplementedError(f"params.n: {msg.n} completions per request is not supported in v1 (only 1)")
    kw = {name: getattr(msg, name) for name in _SCALARS if msg.HasField(name)}
    if msg.stop:
        most = sp.KNOBS["stop"].max_items
        if most is not None and len(msg.stop) > most:  # before copying millions of strings into a tuple
            raise ValueError(f"params.stop has {len(msg.stop)} strings; at most {most} are allowed")
        kw["stop"] = tuple(msg.stop)
    if msg.stop_token_ids:
        if len(msg.stop_token_ids) > sp.MAX_STOP_TOKEN_IDS:  # before copying millions of ids into a tuple
            raise ValueError(
                f"params.stop_token_ids has {len(msg.stop_token_ids)} ids; at most {sp.MAX_STOP_TOKEN_IDS} are allowed"
            )
        kw["stop_token_ids"] = tuple(msg.stop_token_ids)
    try:
        return dataclasses.replace(defaults, **kw)
    except ValueError as e:
        raise ValueError(f"params.{e}") from None


def response_format(request: pb.GenerateRequest) -> ResponseFormat | None:
    """GenerateRequest.response_format → ResponseFormat (None when unset); ValueError names response_format."""
    if not request.HasField("response_format"):
        return None
    msg = request.response_format
    kind = msg.WhichOneof("format")
    if kind is None:
        raise ValueError("response_format: set one of json_schema, json_object, regex, choice")
    if kind == "json_schema":
        js = msg.json_schema
        return ResponseFormat("json_schema", schema=js.schema, name=js.name, strict=js.strict)
    if kind == "regex":
        return ResponseFormat("regex", regex=msg.regex)
    if kind == "choice":
        return ResponseFormat("choice", choices=tuple(msg.choice.choices))
    return ResponseFormat("json_object")


def with_response_format(params: SamplingParams, request: pb.GenerateRequest) -> SamplingParams:
    """params with the request's response_format (unchanged when it has none)."""
    fmt = response_format(request)
    return params if fmt is None else dataclasses.replace(params, response_format=fmt)


def prompt(request: pb.GenerateRequest | pb.TokenizeRequest, vocab_size: int, max_len: int | None = None) -> Prompt:
    """The request's input as a dgserve prompt: text, token ids or a ChatPrompt. ``max_len`` (the context window):
    more token ids, chat messages or content parts than that are refused before they are copied."""
    kind = request.WhichOneof("input")
    if kind is None:
        raise ValueError("input: one of prompt, token_ids or chat is required")
    if kind == "prompt":
        if not request.prompt:
            raise ValueError("prompt: must not be empty")
        return request.prompt
    if kind == "token_ids" and isinstance(request, pb.GenerateRequest):  # a TokenizeRequest has no token_ids
        return token_ids(request.token_ids, vocab_size, max_len)
    return chat(request.chat, max_len)


def token_ids(msg: pb.TokenIds, vocab_size: int, max_len: int | None = None) -> list[int]:
    return events.token_ids(msg.ids, vocab_size, "token_ids.ids", max_len)


def chat(msg: pb.Chat, max_len: int | None = None) -> ChatPrompt:
    if not msg.messages:
        raise ValueError("chat.messages: must not be empty")
    if max_len is not None:
        _check_chat_size(msg, max_len)
    messages = []
    for i, m in enumerate(msg.messages):
        content: str | list[dict]
        if m.parts:
            content = [_part(p, f"chat.messages[{i}].parts[{j}]") for j, p in enumerate(m.parts)]
        else:
            content = m.content
        messages.append(_message(m, content))
    add = msg.add_generation_prompt if msg.HasField("add_generation_prompt") else True
    return ChatPrompt(tuple(messages), add, msg.enable_thinking, tools=tools(msg))


def _message(m: pb.ChatMessage, content: str | list[dict]) -> dict:
    """One ChatMessage as the chat template's dict (OpenAI's shape: tool_calls, tool_call_id, reasoning_content)."""
    out: dict = {"role": m.role, "content": content}
    if m.tool_calls:
        calls = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in m.tool_calls
        ]
        out["tool_calls"] = calls
        if content == "":
            out["content"] = None
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.HasField("reasoning_content"):
        out["reasoning_content"] = m.reasoning_content
    return out


def tools(msg: pb.Chat) -> ToolSet | None:
    """Chat.tools / tool_choice / parallel_tool_calls → the ToolSet (ValueError naming chat.tools..., as OpenAI's)."""
    listed: list[dict] = []
    for t in msg.tools:
        fn: dict = {"name": t.name, "description": t.description}
        if t.parameters_json:  # the one reader, with the schema bounds (what HTTP's tools[i].function.parameters get)
            fn["parameters"] = read_schema(t.parameters_json, f"chat.tools[{len(listed)}].parameters_json")
        listed.append({"type": "function", "function": fn})
    choice: object = None
    kind = msg.tool_choice.WhichOneof("choice") if msg.HasField("tool_choice") else None
    if kind == "mode":
        choice = msg.tool_choice.mode
    elif kind == "function":
        choice = {"type": "function", "function": {"name": msg.tool_choice.function}}
    parallel = msg.parallel_tool_calls if msg.HasField("parallel_tool_calls") else None
    try:
        return ToolSet.from_openai(listed or None, choice, parallel)
    except ValueError as e:
        raise ValueError(f"chat.{e}") from None


def _check_chat_size(msg: pb.Chat, max_len: int) -> None:
    """ValueError when the chat has more messages, or content parts in all, than the context has positions: every
    message renders to at least one token, and a part-by-part copy of millions of empty parts is loop time."""
    if len(msg.messages) > max_len:
        raise ValueError(
            f"chat.messages: {len(msg.messages)} messages exceed the context window of {max_len} positions"
        )
    parts = sum(len(m.parts) for m in msg.messages)
    if parts > max_len:
        raise ValueError(f"chat.messages: {parts} content parts exceed the context window of {max_len} positions")


def _part(part: pb.ContentPart, field: str) -> dict:
    kind = part.WhichOneof("part")
    if kind == "text":
        return {"type": "text", "text": part.text}
    if kind == "image":
        return images.image_bytes(part.image.data, field)
    raise ValueError(f"{field}: empty content part (set text or image)")


def draft_spec(msg: pb.DraftOptions) -> DraftSpec | None:
    """The request's draft options (None when not enabled); every_n_steps 0 is proto3's unset: every step."""
    if not msg.enabled:
        return None
    return events.draft_spec(msg.every_n_steps or None, msg.include_text)


# ---------------------------------------------------------------------------------------------- responses


def response(request_id: str, event: events.Event) -> pb.GenerateResponse:
    """One event of a request (``service.events``) as a GenerateResponse; TypeError for an ErrorEvent (the
    servicer raises its error instead: the call ends with a status)."""
    if isinstance(event, events.BlockEvent):
        return pb.GenerateResponse(request_id=request_id, block=block(event))
    if isinstance(event, events.DraftEvent):
        return pb.GenerateResponse(request_id=request_id, draft=draft(event))
    if isinstance(event, events.StartEvent):
        return pb.GenerateResponse(request_id=request_id, started=started(event))
    if isinstance(event, events.FinishEvent):
        return pb.GenerateResponse(request_id=request_id, finished=finished(event))
    raise TypeError(f"unknown event {type(event).__name__}")


def started(e: events.StartEvent) -> pb.Started:
    return pb.Started(seed=e.seed, prompt_tokens=e.prompt_tokens, params=params_message(e.params), queue_ms=e.queue_ms)


def draft(d: events.DraftEvent) -> pb.Draft:
    return pb.Draft(
        block_index=d.block_index, step=d.step, token_ids=d.token_ids, mean_entropy=d.mean_entropy, text=d.text
    )


def block(b: events.BlockEvent) -> pb.Block:
    s = b.stats
    stats = pb.BlockStats(
        denoising_steps=s.denoising_steps,
        tokens_per_forward=s.tokens_per_forward,
        mean_entropy=s.mean_entropy,
        encode_ms=s.encode_ms,
        denoise_ms=s.denoise_ms,
        pinned_tokens=s.pinned_tokens,
    )
    # the text is the block's content: a chat's reasoning and tool-call deltas travel apart (service.events)
    msg = pb.Block(index=b.index, token_ids=b.token_ids, text=b.content, reasoning=b.reasoning, stats=stats)
    msg.tool_calls.extend(
        pb.ToolCallDelta(index=d.index, id=d.id or "", name=d.name or "", arguments=d.arguments) for d in b.call_deltas
    )
    return msg


def finished(f: events.FinishEvent) -> pb.Finished:
    """Finished, with a chat's every call whole and what its parser held back (text, reasoning)."""
    u, t = f.usage, f.timing
    return pb.Finished(
        text=f.content,
        reasoning=f.reasoning,
        tool_calls=[pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in f.calls],
        finish_reason=FINISH_REASONS.get(f.reason, pb.FINISH_REASON_UNSPECIFIED),
        usage=pb.Usage(
            prompt_tokens=u.prompt_tokens,
            completion_tokens=u.completion_tokens,
            total_tokens=u.total_tokens,
            blocks=u.blocks,
            denoising_steps=u.denoising_steps,
            cached_tokens=u.cached_tokens,
        ),
        timing=pb.Timing(queue_ms=t.queue_ms, first_block_ms=t.first_block_ms, total_ms=t.total_ms),
    )


def params_message(p: SamplingParams) -> pb.SamplingParams:
    kw = {name: getattr(p, name) for name in _SCALARS if getattr(p, name) is not None}
    return pb.SamplingParams(stop=list(p.stop), stop_token_ids=list(p.stop_token_ids), n=1, **kw)


# ---------------------------------------------------------------------------------------------- model info


def model_info(engine: AsyncEngine, names: tuple[str, ...]) -> pb.GetModelInfoResponse:
    cfg, d = engine.model_config, engine.default_params()
    return pb.GetModelInfoResponse(
        model=names[0],
        aliases=names[1:],
        max_model_len=engine.max_model_len,
        canvas_length=cfg.canvas_length,
        vocab_size=cfg.vocab_size,
        precision=str(engine.dtype).removeprefix("torch."),
        eos_token_ids=sorted(engine.eos_ids),
        has_tokenizer=engine.tokenizer is not None,
        defaults=params_message(d),
        bounds=bounds(d),
        max_stop_strings=sp.KNOBS["stop"].max_items,
        max_stop_length=sp.KNOBS["stop"].max_chars,
        max_num_seqs=engine.max_num_seqs,
        max_queue_len=engine.max_queue_len if engine.max_queue_len is not None else 0,
        deterministic=engine.dtype == torch.float32,
        version=dgserve.__version__,
        **runtime_fields(engine),
    )


def runtime_fields(engine: AsyncEngine) -> dict:
    """GetModelInfoResponse's runtime section (device, dtype's expert format, native ops) from the engine."""
    rt = engine.runtime_info()
    return dict(
        device=rt["device"],
        expert_format=rt["expert_format"],
        native_ops=rt["native_ops"],
        native_ops_mode=rt["native_ops_mode"],
        native_ops_disabled=[
            pb.NativeOpStatus(op=op, reason=why) for op, why in sorted(rt["native_ops_disabled"].items())
        ],
    )


def bounds(d: SamplingParams) -> list[pb.KnobBounds]:
    """KnobBounds of every numeric knob, from its Knob metadata (``Knob.bounds``: the knob's own bounds narrowed to
    its dtype, what validation accepts), with ``d``'s values as the defaults. An integer bound a double cannot hold
    exactly (the seed's 2^64 − 1) is reported as the next integer, excluded."""
    out = []
    for name, k in sp.KNOBS.items():
        if not k.numeric:
            continue
        b = k.bounds
        hi, hi_open = (math.inf, False) if b.hi is None else (b.hi, b.hi_open)
        if k.kind is int and hi != math.inf and float(hi) != hi and not hi_open:
            hi, hi_open = hi + 1, True
        default = getattr(d, name)
        out.append(
            pb.KnobBounds(
                name=name,
                min=-math.inf if b.lo is None else b.lo,
                max=hi,
                min_exclusive=b.lo_open,
                max_exclusive=hi_open,
                integer=k.kind is int,
                default_value=0 if default is None else default,
                note=k.constraint(name),
            )
        )
    return out
