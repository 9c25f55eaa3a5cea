"""The chat and completions API's output: dgserve events (``service.events``) → OpenAI's ``chat.completion`` and
``text_completion`` bodies and their SSE chunks (``stream`` sends them).

``completion`` / ``chat.completion`` bodies and their ``*.chunk`` twins carry ``usage`` and a ``dgserve``
extension object (seed, request id, per-block denoising stats, timing); drafts travel in chunks with no choices.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from dgserve.outputs import FINISH_CANCELLED, FINISH_EOS, FINISH_LENGTH, FINISH_STOP

from ... import events

# the finish reasons (events.FINISH_REASONS) as OpenAI's ("abort": the request was cancelled by the server, e.g. a
# drain timeout; vLLM's); a reason not in the table is passed through as it is
FINISH_REASONS = {
    FINISH_EOS: "stop",
    FINISH_STOP: "stop",
    FINISH_LENGTH: "length",
    FINISH_CANCELLED: "abort",
    events.FINISH_TOOL_CALLS: "tool_calls",
}


def finish_reason(reason: str) -> str:
    """OpenAI's name of an event's (final) finish reason."""
    return FINISH_REASONS.get(reason, reason)


@dataclass
class Output:
    """What a request produced so far (filled from its events; the output itself is ``transcript``'s)."""

    request_id: str
    model: str
    seed: int
    chat: bool
    index: int = 0  # the choice (n > 1: one Output per choice, all with the response's id)
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    blocks: list[dict] = dataclasses.field(default_factory=list)
    transcript: events.Transcript = dataclasses.field(default_factory=events.Transcript)

    @property
    def text(self) -> str:
        return self.transcript.text

    @property
    def finished(self) -> events.FinishEvent | None:
        return self.transcript.finished

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def add_block(self, block: events.BlockEvent) -> dict:
        """Append the block; returns its stats (the chunk's ``dgserve.block``)."""
        stats = block_stats(block)
        self.transcript.add(block)
        self.blocks.append(stats)
        return stats

    def finish(self, event: events.FinishEvent) -> None:
        self.transcript.add(event)


def block_stats(b: events.BlockEvent) -> dict:
    s = b.stats
    return {
        "index": b.index,
        "tokens": len(b.token_ids),
        "denoising_steps": s.denoising_steps,
        "tokens_per_forward": round(s.tokens_per_forward, 4),
        "mean_entropy": s.mean_entropy,
        "denoise_ms": round(s.denoise_ms, 3),
        "pinned_tokens": s.pinned_tokens,
    }


def usage(u: events.Usage) -> dict:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens``: prompt tokens the prefix cache supplied."""
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def draft(d: events.DraftEvent) -> dict:
    """A draft chunk's ``dgserve.draft`` object."""
    return {
        "block_index": d.block_index,
        "step": d.step,
        "token_ids": d.token_ids,
        "mean_entropy": d.mean_entropy,
        "text": d.text,
    }


def extension(out: Output) -> dict:
    """The ``dgserve`` object of a response / final chunk: seed, request id, per-block stats, timing."""
    f = out.finished
    ext = {"request_id": out.request_id, "seed": out.seed, "blocks": out.blocks}
    if f is not None:
        t = f.timing
        ext.update(
            denoising_steps=f.usage.denoising_steps,
            queue_ms=round(t.queue_ms, 3),
            first_block_ms=round(t.first_block_ms, 3),
            total_ms=round(t.total_ms, 3),
        )
    return ext


def response(outs: list[Output]) -> dict:
    """The non-streaming body (chat.completion or text_completion) of a request's choices, all finished: one
    choice each, the usage of all (``choices.total_usage``), the ``dgserve`` object of the first (with n > 1, a
    ``choices`` list of each one's)."""
    out = outs[0]
    finished = [o.finished for o in outs]
    if any(f is None for f in finished):
        raise RuntimeError(f"response: request {out.request_id!r} has not finished")
    return {
        "id": out.request_id,
        "object": out.object,
        "created": out.created,
        "model": out.model,
        "choices": [choice(o) for o in outs],
        "usage": usage(total_usage([f.usage for f in finished if f is not None])),
        "system_fingerprint": None,
        "dgserve": extensions(outs),
    }


def choice(out: Output) -> dict:
    f = out.finished
    assert f is not None
    content = {"message": message(out.transcript)} if out.chat else {"text": out.text}
    return {"index": out.index, **content, "logprobs": None, "finish_reason": finish_reason(f.reason)}


def total_usage(each: list[events.Usage]) -> events.Usage:
    """The usage of a request's choices together: the prompt (and its cached tokens) once, as OpenAI counts it,
    the completion tokens, blocks and denoising steps of all."""
    first = each[0]
    return events.Usage(
        first.prompt_tokens,
        sum(u.completion_tokens for u in each),
        sum(u.blocks for u in each),
        sum(u.denoising_steps for u in each),
        first.cached_tokens,
    )


def extensions(outs: list[Output]) -> dict:
    """The ``dgserve`` object of a request: the first choice's; with n > 1 also ``choices``, each one's (its index,
    seed, blocks and timing)."""
    ext = extension(outs[0])
    if len(outs) > 1:
        ext["choices"] = [{"index": o.index, **extension(o)} for o in outs]
    return ext


def message(t: events.Transcript) -> dict:
    """A chat's assistant message (the event layer's one rule: ``Transcript.assistant_message``)."""
    return t.assistant_message()


def chat_delta(e: events.BlockEvent | events.FinishEvent | None) -> dict:
    """A chunk's ``delta``: the event's pieces (reasoning_content, content, tool_calls)."""
    out: dict = {}
    if e is None:
        return out
    if e.reasoning:
        out["reasoning_content"] = e.reasoning
    if e.content:
        out["content"] = e.content
    if e.call_deltas:
        out["tool_calls"] = [c.to_openai() for c in e.call_deltas]
    return out


def chunk(
    out: Output,
    piece: events.BlockEvent | events.FinishEvent | None = None,
    *,
    role: bool = False,
    finish: str | None = None,
    extra: dict | None = None,
    usage_: dict | None = None,
    no_choices: bool = False,
) -> dict:
    """One SSE chunk: an event's piece of the output (``piece``), the role opener (chat), the finishing chunk, or
    the usage-only chunk."""
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
        d = {"role": "assistant", "content": ""} if role else chat_delta(piece)
        body["choices"] = [{"index": out.index, "delta": d, "logprobs": None, "finish_reason": finish}]
    else:
        text = "" if piece is None else piece.content
        body["choices"] = [{"index": out.index, "text": text, "logprobs": None, "finish_reason": finish}]
    if usage_ is not None or no_choices:
        body["usage"] = usage_
    if extra is not None:
        body["dgserve"] = extra
    return body
