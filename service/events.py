"""What both front doors take from an engine stream, decided once: the doors only encode it.

The gRPC door (``grpc/``) and the HTTP door (``http/``) turn the same things into protobuf
messages, OpenAI JSON or server-sent events; everything they share is here:

- ``open_events``: submit a door's ``Submission`` and read its stream as ``Events``.
- ``Events``: a ``RequestStream`` as door-neutral events, in order: ``StartEvent``, ``DraftEvent``s,
  ``BlockEvent``s, then ``FinishEvent`` or, when the request failed (its own error, a stalled reader, an engine
  fault), one ``ErrorEvent`` carrying the exception. Nothing follows either. ``Events.cancel`` stops the request.
- The chat output, read here once for every door (``ChatOutput``): a chat request's text is split, block by
  block, into content, reasoning and tool-call deltas by one parser built under one rule (``output_parser``);
  a ``BlockEvent`` carries its pieces, the ``FinishEvent`` what the parser held back, every call whole and the
  final reason (``final_reason``: "tool_calls" for an output that ended after its calls). A door reads
  ``content`` / ``reasoning`` / ``call_deltas`` / ``calls`` and never parses; a text or token-id prompt's
  content is its text.
- ``FINISH_REASONS``: the finish reasons a ``FinishEvent`` carries (each door has one table from these names).
- ``Transcript``: the whole output of a request, gathered from its events (for the doors that answer at once),
  and the one rule for it as a chat's assistant message (``assistant_message``).
- ``Usage``, ``Timing``, ``BlockReport``: the numbers, in milliseconds, with a NaN or infinity reported as 0.
- ``draft_spec``: the draft options' one set of bounds; ``token_ids``: the one check of a prompt's token ids.
  Their ValueErrors name the request field they were given, so both doors answer "invalid argument: <field> ...".

How the generation produces these events is in docs/generation.md; the life of a request through the doors is in
docs/architecture.md.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from dgserve.engine.async_engine import AsyncEngine, Draft, DraftSpec, Finished, RequestStream, Started
from dgserve.engine.prompt import ChatPrompt, Prompt, Submission
from dgserve.engine.request import Request
from dgserve.outputs import FINISH_CANCELLED, FINISH_EOS, FINISH_LENGTH, FINISH_STOP, BlockOutput
from dgserve.sampling_params import MAX_DENOISING_STEPS_LIMIT, SamplingParams
from dgserve.structured.chat_output import ChatDelta, ChatOutputParser
from dgserve.structured.tool_parser import ToolCall, ToolCallDelta

from . import callers

# a chat output that ended (EOS) after the tool calls it made
FINISH_TOOL_CALLS = "tool_calls"
# the reasons a request finishes with; a door's table maps each to its own name (an enum, an OpenAI string)
FINISH_REASONS = (FINISH_EOS, FINISH_LENGTH, FINISH_STOP, FINISH_CANCELLED, FINISH_TOOL_CALLS)
# drafts every n-th denoising step, n in [1, MAX_DRAFT_EVERY]: a block never runs more steps than that, so a
# larger n could never send a draft
MAX_DRAFT_EVERY = MAX_DENOISING_STEPS_LIMIT


# ---------------------------------------------------------------------------------------------- request checks


def draft_spec(every_n_steps: object = None, include_text: object = None, field: str = "drafts") -> DraftSpec:
    """The draft options, checked: ``every_n_steps`` an integer in [1, MAX_DRAFT_EVERY], ``include_text`` a
    boolean; None is the default (every step, no text). ValueError naming ``<field>.every_n_steps`` /
    ``<field>.include_text``."""
    every = 1 if every_n_steps is None else every_n_steps
    if isinstance(every, bool) or not isinstance(every, int) or not 1 <= every <= MAX_DRAFT_EVERY:
        raise ValueError(f"{field}.every_n_steps must be an integer in [1, {MAX_DRAFT_EVERY}], got {every!r}")
    text = False if include_text is None else include_text
    if not isinstance(text, bool):
        raise ValueError(f"{field}.include_text must be a boolean")
    return DraftSpec(every_n_steps=every, include_text=text)


def token_ids(ids: Sequence[int], vocab_size: int, field: str, max_len: int | None = None) -> list[int]:
    """A prompt's token ids as a new list, checked: not empty, at most ``max_len`` (the context window; checked by
    length before any id is looked at), each in [0, vocab_size). ValueError naming ``field`` (``field[i]`` for one
    id). The caller has made sure the items are integers."""
    if not ids:
        raise ValueError(f"{field}: must not be empty")
    if max_len is not None and len(ids) > max_len:
        raise ValueError(f"{field}: {len(ids)} token ids exceed the context window of {max_len} positions")
    out = list(ids)
    for i, t in enumerate(out):
        if not 0 <= t < vocab_size:
            raise ValueError(f"{field}[{i}]: token id {t} is outside the vocabulary [0, {vocab_size})")
    return out


# ---------------------------------------------------------------------------------------------- numbers


def fills_context(limit_given: bool, params: SamplingParams, calls_tools: bool = False) -> bool:
    """Whether the server's default output limit applies (``Submission.fill_context``): the request set no token
    limit. The engine decides the default (``request_checks.output_limit``: --default-max-tokens, else the
    checkpoint's; with neither, the room left in the context for an output a grammar ends, a response_format or
    tools it may call, vLLM's rule for a request without max_tokens). Every door asks this; ``params`` and
    ``calls_tools`` are kept for its callers (the engine reads the grammar from the submission itself)."""
    del params, calls_tools
    return not limit_given


def finite(x: float) -> float:
    """x, or 0.0 for NaN and infinities (no wire format here carries them)."""
    return x if math.isfinite(x) else 0.0


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    blocks: int  # committed canvases
    denoising_steps: int  # decoder forwards, all blocks together
    cached_tokens: int = 0  # of prompt_tokens, those whose KV the prefix cache supplied

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Timing:
    queue_ms: float  # waiting for a running slot
    first_block_ms: float  # arrival to the first committed block; 0 when none was committed
    total_ms: float


@dataclass(frozen=True)
class BlockReport:
    """A committed block's numbers as the doors report them, times in milliseconds (the engine's
    ``dgserve.outputs.BlockStats`` holds seconds)."""

    denoising_steps: int
    tokens_per_forward: float
    mean_entropy: float  # finite
    encode_ms: float
    denoise_ms: float
    pinned_tokens: int = 0  # of the block's tokens, those the request pinned (docs/edit-in-place.md)


# ---------------------------------------------------------------------------------------------- events


@dataclass(frozen=True)
class StartEvent:
    """The request left the queue: the seed in use, the prompt's length and every knob in force."""

    seed: int
    prompt_tokens: int
    params: SamplingParams
    queue_ms: float


@dataclass(frozen=True)
class DraftEvent:
    """A preview of the current block after a denoising step (the whole canvas; it may still change)."""

    block_index: int
    step: int
    token_ids: list[int]
    mean_entropy: float  # finite
    text: str  # "" unless the draft options asked for text


@dataclass(frozen=True)
class BlockEvent:
    """One committed block: the tokens it contributes, its text delta and, for a chat, that text read as content,
    reasoning and tool-call deltas (``delta``; None: all of the text is content)."""

    index: int
    token_ids: list[int]
    text: str  # as decoded (a chat that may call tools or thinks keeps its markers here)
    stats: BlockReport
    delta: ChatDelta | None = None

    @property
    def content(self) -> str:
        return self.text if self.delta is None else self.delta.content

    @property
    def reasoning(self) -> str:
        return "" if self.delta is None else self.delta.reasoning_content

    @property
    def call_deltas(self) -> list[ToolCallDelta]:
        return [] if self.delta is None else self.delta.tool_calls


@dataclass(frozen=True)
class FinishEvent:
    """The last event of a request that completed or was cancelled. For a chat: ``delta``, what the parser held
    back until the end (a partial marker is text after all when the output ended with EOS, and dropped when it was
    cut), and ``calls``, every call of the output whole; ``reason`` is the final one (``final_reason``). Every call
    here and in the block events is whole and its arguments a JSON object its grammar admitted; a call the output
    was cut in is in neither (docs/tools.md, "Valid to the last token"): the reason is then ``length``."""

    reason: str  # one of FINISH_REASONS
    usage: Usage
    timing: Timing
    delta: ChatDelta | None = None
    calls: tuple[ToolCall, ...] = ()
    stop_sequence: str | None = None  # the stop string that ended the output (reason "stop")

    @property
    def content(self) -> str:
        return "" if self.delta is None else self.delta.content

    @property
    def reasoning(self) -> str:
        return "" if self.delta is None else self.delta.reasoning_content

    @property
    def call_deltas(self) -> list[ToolCallDelta]:
        return [] if self.delta is None else self.delta.tool_calls


@dataclass(frozen=True)
class ErrorEvent:
    """The last event of a request that failed; ``error`` is what the engine raised (a door maps it to a status)."""

    error: Exception


Event = StartEvent | DraftEvent | BlockEvent | FinishEvent | ErrorEvent


def event(e: Started | Draft | BlockOutput | Finished) -> StartEvent | DraftEvent | BlockEvent | FinishEvent:
    """One engine event as its door-neutral event; TypeError for anything else."""
    if isinstance(e, BlockOutput):
        return block(e)
    if isinstance(e, Draft):
        d = e.output
        return DraftEvent(d.index, d.step, d.token_ids, finite(d.mean_entropy), e.text)
    if isinstance(e, Started):
        return StartEvent(e.seed, e.prompt_tokens, e.params, e.queue_seconds * 1e3)
    if isinstance(e, Finished):
        return finish(e)
    raise TypeError(f"unknown event {type(e).__name__}")


def block(b: BlockOutput) -> BlockEvent:
    s = b.stats
    stats = BlockReport(
        s.denoising_steps,
        s.tokens_per_forward,
        finite(s.mean_entropy),
        s.encode_seconds * 1e3,
        s.denoise_seconds * 1e3,
        s.pinned_tokens,
    )
    return BlockEvent(b.index, b.token_ids, b.text, stats)


def finish(f: Finished) -> FinishEvent:
    usage = Usage(f.prompt_tokens, f.completion_tokens, f.blocks, f.denoising_steps, f.cached_tokens)
    timing = Timing(f.queue_seconds * 1e3, finite(f.first_block_seconds) * 1e3, f.total_seconds * 1e3)
    return FinishEvent(f.finish_reason, usage, timing, stop_sequence=f.stop_sequence)


# ---------------------------------------------------------------------------------------------- the chat output


def final_reason(reason: str, calls: Sequence[ToolCall]) -> str:
    """The one rule for a request's finish reason: "tool_calls" when the output ended (EOS) after calls."""
    return FINISH_TOOL_CALLS if calls and reason == FINISH_EOS else reason


def output_parser(prompt: Prompt | None, request: Request) -> ChatOutputParser | None:
    """The one parser of a request's output: a chat's (``ChatPrompt.output_parser``: tool calls when it may call
    tools, reasoning when thinking is on, call ids seeded by the request); None for a text or token-id prompt."""
    return prompt.output_parser(request) if isinstance(prompt, ChatPrompt) else None


class ChatOutput:
    """A chat request's output read by its one parser: each ``BlockEvent`` / ``FinishEvent`` with its pieces."""

    def __init__(self, parser: ChatOutputParser):
        self.parser = parser

    def block(self, e: BlockEvent) -> BlockEvent:
        return dataclasses.replace(e, delta=self.parser.push(e.text))

    def finish(self, e: FinishEvent) -> FinishEvent:
        rest = self.parser.finish(cut=e.reason != FINISH_EOS)  # anything but EOS cut the output
        calls = tuple(self.parser.tool_calls)
        return dataclasses.replace(e, reason=final_reason(e.reason, calls), delta=rest, calls=calls)

    def read(self, e: Event) -> Event:
        if isinstance(e, BlockEvent):
            return self.block(e)
        if isinstance(e, FinishEvent):
            return self.finish(e)
        return e


@dataclass
class Transcript:
    """The whole output of a request, gathered from its events (``add`` each one, in order)."""

    text: str = ""  # as decoded, all blocks
    content: str = ""
    reasoning: str = ""
    calls: tuple[ToolCall, ...] = ()
    finished: FinishEvent | None = None

    def add(self, e: Event) -> None:
        if isinstance(e, (BlockEvent, FinishEvent)):
            self.content += e.content
            self.reasoning += e.reasoning
        if isinstance(e, BlockEvent):
            self.text += e.text
        elif isinstance(e, FinishEvent):
            self.calls, self.finished = e.calls, e

    def assistant_message(self) -> dict:
        """The output as a chat's assistant message, the one rule for every door that answers with one or keeps
        it for a later turn: content (null when empty and there are tool calls), reasoning_content (when the
        output had a thought channel), tool_calls (when it made calls)."""
        message: dict = {"role": "assistant", "content": self.content if self.content or not self.calls else None}
        if self.reasoning:
            message["reasoning_content"] = self.reasoning
        if self.calls:
            message["tool_calls"] = [c.to_openai() for c in self.calls]
        return message


# ---------------------------------------------------------------------------------------------- the stream


async def open_events(engine: AsyncEngine, sub: Submission, timeout_s: float | None = None) -> Events:
    """Submit a door's request and read it as events (``AsyncEngine.submit`` raises what it raises). The call's
    caller from a trusted gateway's header (``callers``), when there is one, takes the request's fair share."""
    caller = callers.current()
    if caller is not None and sub.caller is None:
        sub = dataclasses.replace(sub, caller=caller)
    return Events(await engine.submit(sub, timeout_s=timeout_s), sub.prompt)


class Events:
    """A request's stream as door-neutral events (an async iterator; see the module docstring). ``prompt``: the
    prompt the request was made from (a ``ChatPrompt``'s output is read by its parser; ``output_parser``).

    An exception from the stream (the request's own error, ``StreamStalledError``, ``EngineFaultError``, or an
    event of an unknown type) becomes the last event, an ``ErrorEvent``; cancellation of the reading task
    (``asyncio.CancelledError``) is not caught. The door that reads calls ``cancel`` when it stops reading, for
    whatever reason: that frees the engine slot of a request still running, and does nothing otherwise."""

    def __init__(self, stream: RequestStream, prompt: Prompt | None = None):
        self.stream = stream
        self.request_id = stream.request_id
        self.seed = stream.request.seed  # the seed in use (the request's, or the one drawn), known at once
        parser = output_parser(prompt, stream.request)
        self.chat = None if parser is None else ChatOutput(parser)
        self._over = False

    def __aiter__(self) -> Events:
        return self

    async def __anext__(self) -> Event:
        if self._over:
            raise StopAsyncIteration
        try:
            e = event(await anext(self.stream))
            return e if self.chat is None else self.chat.read(e)
        except StopAsyncIteration:
            self._over = True
            raise
        except Exception as e:  # noqa: BLE001 - every failure of the request ends its events the same way
            self._over = True
            return ErrorEvent(e)

    def cancel(self, reason: str = "client_cancelled") -> None:
        """Stop the request (the reader went away, its deadline passed): no more events."""
        self.stream.cancel(reason)
