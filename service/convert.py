"""Protobuf ↔ dgserve objects: the only module that imports both.

Every validation message names the proto field (``params.t_max must be > t_min ...``, ``token_ids.ids[3]: ...``)
so that INVALID_ARGUMENT tells the caller exactly what to fix.
"""

from __future__ import annotations

import dataclasses
import math

import torch

import dgserve
from dgserve import sampling_params as sp
from dgserve.async_engine import Draft, DraftSpec, Finished, Started
from dgserve.engine import ChatPrompt, Engine, Prompt
from dgserve.outputs import FINISH_CANCELLED, FINISH_EOS, FINISH_LENGTH, FINISH_STOP, BlockOutput
from dgserve.sampling_params import SamplingParams
from dgserve.scheduler import SchedulerConfig
from dgserve.structured import ResponseFormat
from dgserve.v1 import text_generation_pb2 as pb

FINISH_REASONS = {
    FINISH_EOS: pb.FINISH_REASON_EOS,
    FINISH_LENGTH: pb.FINISH_REASON_LENGTH,
    FINISH_STOP: pb.FINISH_REASON_STOP,
    FINISH_CANCELLED: pb.FINISH_REASON_CANCELLED,
}
_SCALARS = (
    "max_new_tokens",
    "max_denoising_steps",
    "t_min",
    "t_max",
    "entropy_bound",
    "stability_threshold",
    "confidence_threshold",
    "seed",
    "ignore_eos",
)


# ---------------------------------------------------------------------------------------------- requests


def sampling_params(msg: pb.SamplingParams, defaults: SamplingParams) -> SamplingParams:
    """The request's knobs over the model defaults; ValueError names ``params.<field>``."""
    if msg.HasField("n") and msg.n != 1:
        raise NotImplementedError(f"params.n: {msg.n} completions per request is not supported in v1 (only 1)")
    kw = {name: getattr(msg, name) for name in _SCALARS if msg.HasField(name)}
    if msg.stop:
        kw["stop"] = tuple(msg.stop)
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


def prompt(request: pb.GenerateRequest | pb.TokenizeRequest, vocab_size: int) -> Prompt:
    """The request's input as a dgserve prompt: text, token ids or a ChatPrompt."""
    kind = request.WhichOneof("input")
    if kind is None:
        raise ValueError("input: one of prompt, token_ids or chat is required")
    if kind == "prompt":
        if not request.prompt:
            raise ValueError("prompt: must not be empty")
        return request.prompt
    if kind == "token_ids" and isinstance(request, pb.GenerateRequest):  # a TokenizeRequest has no token_ids
        return token_ids(request.token_ids, vocab_size)
    return chat(request.chat)


def token_ids(msg: pb.TokenIds, vocab_size: int) -> list[int]:
    ids = list(msg.ids)
    if not ids:
        raise ValueError("token_ids.ids: must not be empty")
    for i, t in enumerate(ids):
        if t >= vocab_size:
            raise ValueError(f"token_ids.ids[{i}]: {t} is outside the vocabulary [0, {vocab_size})")
    return ids


def chat(msg: pb.Chat) -> ChatPrompt:
    if not msg.messages:
        raise ValueError("chat.messages: must not be empty")
    messages = []
    for i, m in enumerate(msg.messages):
        content: str | list[dict]
        if m.parts:
            content = [_part(p, f"chat.messages[{i}].parts[{j}]") for j, p in enumerate(m.parts)]
        else:
            content = m.content
        messages.append({"role": m.role, "content": content})
    add = msg.add_generation_prompt if msg.HasField("add_generation_prompt") else True
    return ChatPrompt(tuple(messages), add, msg.enable_thinking)


def _part(part: pb.ContentPart, field: str) -> dict:
    kind = part.WhichOneof("part")
    if kind == "text":
        return {"type": "text", "text": part.text}
    if kind is None:
        raise ValueError(f"{field}: empty content part (set text)")
    raise NotImplementedError(f"{field}.{kind}: {kind} input is not supported in v1 (text only)")


def draft_spec(msg: pb.DraftOptions) -> DraftSpec | None:
    if not msg.enabled:
        return None
    return DraftSpec(every_n_steps=max(1, msg.every_n_steps), include_text=msg.include_text)


# ---------------------------------------------------------------------------------------------- responses


def response(request_id: str, event) -> pb.GenerateResponse:
    """One stream event (Started, Draft, BlockOutput, Finished) as a GenerateResponse."""
    if isinstance(event, BlockOutput):
        return pb.GenerateResponse(request_id=request_id, block=block(event))
    if isinstance(event, Draft):
        d = event.output
        return pb.GenerateResponse(
            request_id=request_id,
            draft=pb.Draft(
                block_index=d.index,
                step=d.step,
                token_ids=d.token_ids,
                mean_entropy=_finite(d.mean_entropy),
                text=event.text,
            ),
        )
    if isinstance(event, Started):
        return pb.GenerateResponse(
            request_id=request_id,
            started=pb.Started(
                seed=event.seed,
                prompt_tokens=event.prompt_tokens,
                params=params_message(event.params),
                queue_ms=event.queue_seconds * 1e3,
            ),
        )
    if isinstance(event, Finished):
        return pb.GenerateResponse(request_id=request_id, finished=finished(event))
    raise TypeError(f"unknown event {type(event).__name__}")


def block(b: BlockOutput) -> pb.Block:
    s = b.stats
    return pb.Block(
        index=b.index,
        token_ids=b.token_ids,
        text=b.text,
        stats=pb.BlockStats(
            denoising_steps=s.denoising_steps,
            tokens_per_forward=s.tokens_per_forward,
            mean_entropy=_finite(s.mean_entropy),
            encode_ms=s.encode_seconds * 1e3,
            denoise_ms=s.denoise_seconds * 1e3,
        ),
    )


def finished(f: Finished) -> pb.Finished:
    return pb.Finished(
        finish_reason=FINISH_REASONS.get(f.finish_reason, pb.FINISH_REASON_UNSPECIFIED),
        usage=pb.Usage(
            prompt_tokens=f.prompt_tokens,
            completion_tokens=f.completion_tokens,
            total_tokens=f.prompt_tokens + f.completion_tokens,
            blocks=f.blocks,
            denoising_steps=f.denoising_steps,
        ),
        timing=pb.Timing(
            queue_ms=f.queue_seconds * 1e3,
            first_block_ms=_finite(f.first_block_seconds) * 1e3,
            total_ms=f.total_seconds * 1e3,
        ),
    )


def params_message(p: SamplingParams) -> pb.SamplingParams:
    kw = {name: getattr(p, name) for name in _SCALARS if getattr(p, name) is not None}
    return pb.SamplingParams(stop=list(p.stop), n=1, **kw)


def _finite(x: float) -> float:
    return x if math.isfinite(x) else 0.0


# ---------------------------------------------------------------------------------------------- model info


def model_info(engine: Engine, names: tuple[str, ...], sched: SchedulerConfig) -> pb.GetModelInfoResponse:
    cfg, d = engine.model.config, engine.default_params()
    return pb.GetModelInfoResponse(
        model=names[0],
        aliases=names[1:],
        max_model_len=engine.max_model_len,
        canvas_length=cfg.canvas_length,
        vocab_size=cfg.vocab_size,
        precision=str(engine.model.dtype).removeprefix("torch."),
        eos_token_ids=sorted(engine.eos_ids),
        has_tokenizer=engine.tokenizer is not None,
        defaults=params_message(d),
        bounds=bounds(d),
        max_stop_strings=sp.MAX_STOP_STRINGS,
        max_stop_length=sp.MAX_STOP_LENGTH,
        max_num_seqs=sched.max_num_seqs,
        max_queue_len=sched.max_queue_len if sched.max_queue_len is not None else 0,
        deterministic=engine.model.dtype == torch.float32,
        version=dgserve.__version__,
        **runtime_fields(engine),
    )


def runtime_fields(engine: Engine) -> dict:
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
    K = pb.KnobBounds
    return [
        K(
            name="max_new_tokens",
            min=1,
            max=sp.MAX_NEW_TOKENS_LIMIT,
            integer=True,
            default_value=d.max_new_tokens,
            note="prompt tokens + whole canvases must fit in max_model_len",
        ),
        K(
            name="max_denoising_steps",
            min=1,
            max=sp.MAX_DENOISING_STEPS_LIMIT,
            integer=True,
            default_value=d.max_denoising_steps,
        ),
        K(name="t_min", min=0, max=math.inf, default_value=d.t_min, note="t_min < t_max"),
        K(name="t_max", min=0, max=math.inf, min_exclusive=True, default_value=d.t_max, note="t_max > t_min"),
        K(name="entropy_bound", min=0, max=math.inf, min_exclusive=True, default_value=d.entropy_bound),
        K(
            name="stability_threshold",
            min=0,
            max=sp.MAX_DENOISING_STEPS_LIMIT,
            integer=True,
            default_value=d.stability_threshold,
        ),
        K(name="confidence_threshold", min=0, max=math.inf, min_exclusive=True, default_value=d.confidence_threshold),
        K(name="seed", min=0, max=float(sp.SEED_LIMIT - 1), integer=True, note="unset: random, reported in Started"),
    ]
