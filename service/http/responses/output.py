"""The Responses API's output (docs/responses-api.md): a request's events → a response object or its stream.

A request becomes the engine's one submission (``input``), and its events (``service.events``: content,
reasoning and tool-call pieces, the calls and the final reason) become a response object or, with ``stream:
true``, OpenAI's event sequence: ``response.created``, ``response.in_progress``, then per output item
``response.output_item.added``, its part / text / arguments events and ``response.output_item.done``, and last
``response.completed`` or ``response.incomplete`` (the token limit, or a cancel such as the drain's); every event
has a ``sequence_number`` from 0. Output items: ``reasoning`` (the thought channel, as reasoning text),
``message`` (one ``output_text`` part) and ``function_call`` (``call_id`` is the call's id), in the order the
output made them. A response with ``store`` (the default) is kept for its caller (``ResponseStore``).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncGenerator

from dgserve.outputs import FINISH_CANCELLED, FINISH_LENGTH
from dgserve.structured.tool_parser import ToolCall, ToolCallDelta

from ... import events
from .. import sse
from ..errors import error_body
from ..event_encoder import CALL, TEXT, ItemEncoder, timing
from ..gate import Gate
from .input import ResponsesCall

# the finish reasons that leave a response incomplete, and the reason it gives
INCOMPLETE = {FINISH_LENGTH: "max_output_tokens", FINISH_CANCELLED: "cancelled"}


# ---------------------------------------------------------------------------------------------- the response


class ResponseOutput(ItemEncoder[dict]):
    """A response being made: its output items, built from the request's events in the order the output made
    them (``event_encoder.ItemEncoder``), and the streaming events that build them (``add`` returns those)."""

    def __init__(self, rc: ResponsesCall, model: str, request_id: str, seed: int):
        super().__init__()
        self.rc, self.model, self.request_id, self.seed = rc, model, request_id, seed
        self.key = secrets.token_hex(12)
        self.id = "resp_" + self.key
        self.created_at = int(time.time())
        self.transcript = events.Transcript()

    # ------------------------------------------------------------------ items: the wire shapes

    def observe(self, e: events.BlockEvent | events.FinishEvent) -> None:
        self.transcript.add(e)

    def start_item(self, kind: str, index: int, call: ToolCallDelta | None) -> tuple[dict, list[dict]]:
        item: dict
        if kind == CALL:
            assert call is not None and call.id is not None
            item = {"type": "function_call", "id": f"fc_{self.key}{index}", "call_id": call.id}
            # a namespace's tool is called by its own name and its namespace (``tools.ResponsesTools.wire``)
            item |= {**self.rc.tools.wire(call.name or ""), "arguments": "", "status": "in_progress"}
            return item, [_added(index, item)]
        if kind == TEXT:
            item = {"type": "message", "id": f"msg_{self.key}{index}", "status": "in_progress", "role": "assistant"}
            item["content"] = []
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"type": "reasoning", "id": f"rs_{self.key}{index}", "summary": [], "content": []}
            item["status"] = "in_progress"
            part = {"type": "reasoning_text", "text": ""}
        out = [_added(index, item)]
        item["content"].append(part)
        where = {"item_id": item["id"], "output_index": index}
        return item, out + [{"type": "response.content_part.added", **where, "content_index": 0, "part": dict(part)}]

    def text_delta(self, kind: str, index: int, item: dict, text: str) -> list[dict]:
        item["content"][0]["text"] += text
        name = "response.output_text.delta" if kind == TEXT else "response.reasoning_text.delta"
        delta = {"type": name, "item_id": item["id"], "output_index": index, "content_index": 0, "delta": text}
        if kind == TEXT:
            delta["logprobs"] = []
        return [delta]

    def arguments_delta(self, index: int, item: dict, arguments: str) -> list[dict]:
        item["arguments"] += arguments
        where = {"item_id": item["id"], "output_index": index}
        return [{"type": "response.function_call_arguments.delta", **where, "delta": arguments}]

    def end_item(self, kind: str, index: int, item: dict) -> list[dict]:
        item["status"] = "completed"
        where = {"item_id": item["id"], "output_index": index}
        if kind == CALL:
            name = "response.function_call_arguments.done"
            out = [{"type": name, **where, "name": item["name"], "arguments": item["arguments"]}]
        else:
            part = item["content"][0]
            name = "response.output_text.done" if kind == TEXT else "response.reasoning_text.done"
            done = {"type": name, **where, "content_index": 0, "text": part["text"]}
            if kind == TEXT:
                done["logprobs"] = []
            out = [done, {"type": "response.content_part.done", **where, "content_index": 0, "part": dict(part)}]
        return out + [{"type": "response.output_item.done", "output_index": index, "item": _copy(item)}]

    def whole_call(self, item: dict, call: ToolCall) -> None:
        item["arguments"] = call.arguments

    # ------------------------------------------------------------------ the response object

    def body(self) -> dict:
        """The response object: in progress until the request finished, then completed or incomplete."""
        f = self.finished
        status, incomplete = "in_progress", None
        if f is not None:
            status = "incomplete" if f.reason in INCOMPLETE else "completed"
            incomplete = {"reason": INCOMPLETE[f.reason]} if f.reason in INCOMPLETE else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "model": self.model,
            "output": [_copy(item) for item in self.items] if f is not None else [],
            **self.rc.echo,
            "usage": None if f is None else usage(f.usage),
            "dgserve": {"request_id": self.request_id, "seed": self.seed, **timing(f), **self._left_out()},
        }

    def _left_out(self) -> dict:
        """The hosted tool types the prompt left out (docs/responses-api.md, "Tools"), when there are any."""
        left_out = self.rc.tools.left_out
        return {"tools_left_out": list(left_out)} if left_out else {}

    def finish(self, gate: Gate, owner: str | None) -> dict:
        """The finished response object, kept in the store when the request asked for it."""
        body = self.body()
        if self.rc.store and self.finished is not None:
            gate.responses.put(owner, body, [*self.rc.history, self.assistant_message()])
        return body

    def assistant_message(self) -> dict:
        """The output as the chat message a later turn continues from (the event layer's one rule)."""
        return self.transcript.assistant_message()


def usage(u: events.Usage) -> dict:
    """The Responses API's usage: input / output tokens, the prompt tokens the prefix cache supplied."""
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.total_tokens,
    }


def _added(index: int, item: dict) -> dict:
    return {"type": "response.output_item.added", "output_index": index, "item": _copy(item)}


def _copy(item: dict) -> dict:
    out = dict(item)
    if "content" in out:
        out["content"] = [dict(p) for p in out["content"]]
    return out


# ---------------------------------------------------------------------------------------------- streaming


async def stream(
    feed: events.Events, out: ResponseOutput, gate: Gate, owner: str | None
) -> AsyncGenerator[bytes, None]:
    """The event sequence of one response (module doc). A request that fails after the headers ends with an
    ``error`` event."""
    seq = 0

    def frame(data: dict) -> bytes:
        nonlocal seq
        data = {**data, "sequence_number": seq}
        seq += 1
        return sse.sse(data, event=data["type"])

    yield frame({"type": "response.created", "response": out.body()})
    yield frame({"type": "response.in_progress", "response": out.body()})
    try:
        async for event in feed:
            if isinstance(event, events.ErrorEvent):
                raise event.error
            for data in out.add(event):
                yield frame(data)
            if isinstance(event, events.FinishEvent):
                body = out.finish(gate, owner)
                kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
                yield frame({"type": kind, "response": body})
    except Exception as e:  # noqa: BLE001 - after the headers, an error can only travel as an event
        err = error_body(e)[1]["error"]
        yield frame({"type": "error", "code": err["code"], "message": err["message"], "param": err["param"]})
