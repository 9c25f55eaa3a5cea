"""The Messages API's output (docs/messages-api.md): a request's events → a message object or its stream.

A request becomes the engine's one submission (``input``), and its events (``service.events``: content,
reasoning and tool-call pieces, the calls and the final reason) become Anthropic's message object or, with
``stream: true``, its event stream: ``message_start``, ``ping``, per content block ``content_block_start``, its
``content_block_delta``s (``text_delta``, ``thinking_delta``, ``input_json_delta``) and ``content_block_stop``,
then ``message_delta`` (the stop reason and usage) and ``message_stop``; a ``ping`` also goes out whenever no event
came for ``PING_INTERVAL_S`` (a queued request, a long block), and a failure after the headers is an ``error``
event. Content blocks: ``thinking`` (the thought channel; its signature is empty), ``text`` and ``tool_use`` (id
``toolu_…``, ``input`` the call's arguments), in the order the output made them. Errors on these routes are
Anthropic's error objects (``errors.anthropic_error_response``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from collections.abc import AsyncGenerator

from dgserve.outputs import FINISH_CANCELLED, FINISH_EOS, FINISH_LENGTH, FINISH_STOP
from dgserve.structured.tool_parser import ToolCall, ToolCallDelta

from ... import events
from .. import sse
from ..errors import anthropic_error_body
from ..event_encoder import CALL, REASONING, TEXT, ItemEncoder, timing

# the finish reasons (events.FINISH_REASONS) as Anthropic's stop reasons; a server-side cancel (a drain past its
# grace) ends the message as the token limit would: the output is cut, not complete
STOP_REASONS = {
    FINISH_EOS: "end_turn",
    FINISH_STOP: "stop_sequence",
    FINISH_LENGTH: "max_tokens",
    FINISH_CANCELLED: "max_tokens",
    events.FINISH_TOOL_CALLS: "tool_use",
}
PING_INTERVAL_S = 10.0  # a ping while no event comes, so proxies and clients see a live stream


# ---------------------------------------------------------------------------------------------- the message


class MessageOutput(ItemEncoder[tuple[str, dict]]):
    """A message being made: its content blocks, built from the request's events in the order the output made
    them (``event_encoder.ItemEncoder``; ``items`` are the blocks), and the stream events that build them
    (``add`` returns them as (event name, data) pairs)."""

    def __init__(self, model: str, request_id: str, seed: int, prompt_tokens: int):
        super().__init__()
        self.model, self.request_id, self.seed, self.prompt_tokens = model, request_id, seed, prompt_tokens
        self.id = "msg_" + secrets.token_hex(12)
        self._args: dict[int, str] = {}  # a tool_use block's arguments as streamed, by block index

    # ------------------------------------------------------------------ content blocks: the wire shapes

    def start_item(self, kind: str, index: int, call: ToolCallDelta | None) -> tuple[dict, list[tuple[str, dict]]]:
        block: dict
        if kind == CALL:
            assert call is not None and call.id is not None
            block = {"type": "tool_use", "id": _tool_use_id(call.id), "name": call.name or "", "input": {}}
            self._args[index] = ""
        elif kind == REASONING:
            block = {"type": "thinking", "thinking": "", "signature": ""}
        else:
            block = {"type": "text", "text": ""}
        start = {"type": "content_block_start", "index": index, "content_block": dict(block)}
        return block, [("content_block_start", start)]

    def text_delta(self, kind: str, index: int, item: dict, text: str) -> list[tuple[str, dict]]:
        key = "text" if kind == TEXT else "thinking"
        item[key] += text
        return [_delta(index, {"type": f"{key}_delta", key: text})]

    def arguments_delta(self, index: int, item: dict, arguments: str) -> list[tuple[str, dict]]:
        self._args[index] += arguments
        return [_delta(index, {"type": "input_json_delta", "partial_json": arguments})]

    def end_item(self, kind: str, index: int, item: dict) -> list[tuple[str, dict]]:
        if kind == CALL and self._args[index]:
            item["input"] = json.loads(self._args[index])
        return [("content_block_stop", {"type": "content_block_stop", "index": index})]

    def whole_call(self, item: dict, call: ToolCall) -> None:
        item["input"] = json.loads(call.arguments)

    # ------------------------------------------------------------------ the message object

    def stop(self) -> tuple[str | None, str | None]:
        """(stop_reason, stop_sequence): None until the request finished."""
        f = self.finished
        if f is None:
            return None, None
        reason = STOP_REASONS.get(f.reason, f.reason)
        return reason, f.stop_sequence if reason == "stop_sequence" else None

    def usage(self) -> dict:
        """Anthropic's usage: ``input_tokens`` the prompt tokens not read from the prefix cache, which
        ``cache_read_input_tokens`` counts (their sum is the prompt, what count_tokens says)."""
        f = self.finished
        if f is None:
            cached, output = 0, 0
            prompt = self.prompt_tokens
        else:
            cached, output, prompt = f.usage.cached_tokens, f.usage.completion_tokens, f.usage.prompt_tokens
        return {
            "input_tokens": prompt - cached,
            "output_tokens": output,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
        }

    def body(self) -> dict:
        reason, sequence = self.stop()
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [dict(b) for b in self.items] if self.finished is not None else [],
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": self.usage(),
            "dgserve": {"request_id": self.request_id, "seed": self.seed, **timing(self.finished)},
        }

    def message_delta(self) -> dict:
        reason, sequence = self.stop()
        return {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": self.usage(),
        }


def _tool_use_id(call_id: str) -> str:
    """A call's id as a tool_use id: ``call_X`` → ``toolu_X`` (the same random part)."""
    return "toolu_" + call_id.removeprefix("call_")


def _delta(index: int, delta: dict) -> tuple[str, dict]:
    return "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}


# ---------------------------------------------------------------------------------------------- streaming


async def stream(feed: events.Events, out: MessageOutput) -> AsyncGenerator[bytes, None]:
    """The event stream of one message (module doc)."""
    start = out.body()
    yield sse.sse({"type": "message_start", "message": start}, event="message_start")
    yield _ping()
    try:
        async with contextlib.aclosing(_with_pings(feed)) as feed_with_pings:
            async for event in feed_with_pings:
                if event is None:
                    yield _ping()
                    continue
                if isinstance(event, events.ErrorEvent):
                    raise event.error
                for name, data in out.add(event):
                    yield sse.sse(data, event=name)
                if isinstance(event, events.FinishEvent):
                    yield sse.sse(out.message_delta(), event="message_delta")
                    yield sse.sse({"type": "message_stop"}, event="message_stop")
    except Exception as e:  # noqa: BLE001 - after the headers, an error can only travel as an event
        yield sse.sse(anthropic_error_body(e)[1], event="error")


async def _with_pings(feed: events.Events) -> AsyncGenerator[events.Event | None, None]:
    """The request's events, with None each time PING_INTERVAL_S passed without one (the wait goes on: the
    pending read is never cancelled)."""
    while True:
        task = asyncio.ensure_future(anext(feed))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=PING_INTERVAL_S)
                if done:
                    break
                yield None
            try:
                event = task.result()
            except StopAsyncIteration:
                return
        finally:
            task.cancel()
        yield event


def _ping() -> bytes:
    return sse.sse({"type": "ping"}, event="ping")
