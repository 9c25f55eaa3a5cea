"""The output-item state machine the agent doors share (docs/responses-api.md, docs/messages-api.md).

A request's events (``service.events``) carry reasoning, content and tool-call pieces in the order the output made
them; an agent door writes them as a list of output items (Responses' output items, Messages' content blocks): one
item per run of reasoning, per run of content and per call, each opened, written and closed in turn, the calls
made whole at the finish. ``ItemEncoder`` walks the events and keeps that state (the items, which one is open and
its kind); a door's subclass supplies only its wire shapes: how an item looks when it opens, what a piece of text
or of a call's arguments streams as, what closing an item streams, and how a whole call is written into its item.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from dgserve.structured.tool_parser import ToolCall, ToolCallDelta

from .. import events

W = TypeVar("W")  # one wire event of a door's stream (Responses: a dict; Messages: an (event name, dict) pair)

# the kinds of output item, door-neutral (each door names them in its own words)
REASONING, TEXT, CALL = "reasoning", "text", "call"


class ItemEncoder(Generic[W]):
    """The output items of one request, built from its events (``add`` each one, in order, and stream what it
    returns). ``items`` holds them in order; once the finish event came, ``finished`` holds it and every call item
    has been given its whole call."""

    def __init__(self) -> None:
        self.items: list[dict] = []
        self.finished: events.FinishEvent | None = None
        self._kind: str | None = None  # the kind of the item being written (the last of items), None when closed
        self._call_ids: dict[int, str] = {}  # a call item's index -> the call's id in the events

    def add(self, e: events.Event) -> list[W]:
        """The wire events that a request event makes (none for an event that carries no output)."""
        if not isinstance(e, (events.BlockEvent, events.FinishEvent)):
            return []
        self.observe(e)
        out: list[W] = []
        if e.reasoning:
            out += self._text(REASONING, e.reasoning)
        if e.content:
            out += self._text(TEXT, e.content)
        for d in e.call_deltas:
            out += self._call(d)
        if isinstance(e, events.FinishEvent):
            out += self._close()
            self.finished = e
            calls = {c.id: c for c in e.calls}
            for index, call_id in self._call_ids.items():  # every call whole, as the parser read it
                if call_id in calls:
                    self.whole_call(self.items[index], calls[call_id])
        return out

    def _text(self, kind: str, text: str) -> list[W]:
        out = [] if self._kind == kind else self._close() + self._open(kind)
        return out + self.text_delta(kind, len(self.items) - 1, self.items[-1], text)

    def _call(self, d: ToolCallDelta) -> list[W]:
        out: list[W] = []
        if d.id is not None:  # a new call
            out += self._close() + self._open(CALL, d)
        if self._kind != CALL or not d.arguments:
            return out
        return out + self.arguments_delta(len(self.items) - 1, self.items[-1], d.arguments)

    def _open(self, kind: str, call: ToolCallDelta | None = None) -> list[W]:
        index = len(self.items)
        if kind == CALL:
            assert call is not None and call.id is not None
            self._call_ids[index] = call.id
        item, out = self.start_item(kind, index, call)
        self.items.append(item)
        self._kind = kind
        return out

    def _close(self) -> list[W]:
        kind, self._kind = self._kind, None
        if kind is None:
            return []
        return self.end_item(kind, len(self.items) - 1, self.items[-1])

    # ------------------------------------------------------------------ a door's wire shapes

    def observe(self, e: events.BlockEvent | events.FinishEvent) -> None:
        """Sees each output event first (a door that keeps more of the output than its items)."""

    def start_item(self, kind: str, index: int, call: ToolCallDelta | None) -> tuple[dict, list[W]]:
        """A new item of ``kind`` at ``index`` (``call``: the call's first delta, with its id and name, for a call
        item) and the wire events that open it."""
        raise NotImplementedError

    def text_delta(self, kind: str, index: int, item: dict, text: str) -> list[W]:
        """Writes ``text`` into the open reasoning or text item; its wire events."""
        raise NotImplementedError

    def arguments_delta(self, index: int, item: dict, arguments: str) -> list[W]:
        """Writes a piece of a call's arguments into the open call item; its wire events."""
        raise NotImplementedError

    def end_item(self, kind: str, index: int, item: dict) -> list[W]:
        """Closes the item; the wire events that close it."""
        raise NotImplementedError

    def whole_call(self, item: dict, call: ToolCall) -> None:
        """Writes the whole call (its arguments as the parser read them) into its item, at the finish."""
        raise NotImplementedError


def timing(f: events.FinishEvent | None) -> dict:
    """The steps and times an agent door's ``dgserve`` object reports (none before the finish)."""
    if f is None:
        return {}
    t = f.timing
    return {
        "denoising_steps": f.usage.denoising_steps,
        "queue_ms": round(t.queue_ms, 3),
        "first_block_ms": round(t.first_block_ms, 3),
        "total_ms": round(t.total_ms, 3),
    }
