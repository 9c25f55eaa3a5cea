"""Streaming responses: a request's events as server-sent events (``text/event-stream``).

The body: the role opener (chat), one chunk per committed block (its ``dgserve.block``: stats and token ids),
drafts as ``event: dgserve.draft`` chunks with no choices (so an OpenAI client yields no text for them), the
finishing chunk with the ``dgserve`` extension, the usage chunk when asked for, ``data: [DONE]``. A request that
fails after the headers were sent ends with its OpenAI error body as one more event, then ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Callable

from fastapi.responses import StreamingResponse

from .. import events
from . import responses
from .choices import Choices
from .errors import error_body


def sse(data: dict | str, event: str | None = None) -> bytes:
    """One server-sent event: ``[event: NAME\\n]data: JSON\\n\\n``."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return ((f"event: {event}\n" if event else "") + f"data: {text}\n\n").encode()


async def body(feeds: Choices, outs: list[responses.Output], include_usage: bool) -> AsyncGenerator[bytes, None]:
    """The SSE body of one request (see the module docstring); ``outs`` (one per choice) collect what it produced.
    With n > 1 the choices' chunks interleave, each with its ``index``; the usage chunk (all choices together)
    comes once, after the last choice finished."""
    if outs[0].chat:
        for out in outs:
            yield sse(responses.chunk(out, role=True))
    try:
        async for i, event in feeds.events():
            for data in _encode(event, outs[i]):
                yield data
    except Exception as e:  # noqa: BLE001 - an encoding failure, too, can only travel as an event now
        yield sse(error_body(e)[1])
    finished = [o.finished for o in outs]
    if include_usage and all(f is not None for f in finished):
        total = responses.total_usage([f.usage for f in finished if f is not None])
        yield sse(responses.chunk(outs[0], no_choices=True, usage_=responses.usage(total)))
    yield sse("[DONE]")


def _encode(event: events.Event, out: responses.Output) -> list[bytes]:
    """The server-sent events for one event (none for StartEvent: the seed went out in the headers)."""
    if isinstance(event, events.BlockEvent):
        stats = out.add_block(event)  # (+ the block's token ids: the canvas it committed, for the playground)
        return [sse(responses.chunk(out, event, extra={"block": {**stats, "token_ids": list(event.token_ids)}}))]
    if isinstance(event, events.DraftEvent):
        draft = responses.chunk(out, no_choices=True, extra={"draft": responses.draft(event)})
        return [sse(draft, event="dgserve.draft")]
    if isinstance(event, events.FinishEvent):
        out.finish(event)
        held = event.content or event.reasoning or event.call_deltas  # what the parser held back to the end
        frames = [sse(responses.chunk(out, event))] if held else []
        reason = responses.finish_reason(event.reason)
        frames.append(sse(responses.chunk(out, finish=reason, extra=responses.extension(out))))
        return frames
    if isinstance(event, events.ErrorEvent):  # after the headers, an error can only travel as an event
        return [sse(error_body(event.error)[1])]
    return []


class EventStream(StreamingResponse):
    """``text/event-stream`` whose request is cancelled in the engine as soon as the client disconnects (not only
    when the next write fails), so the slot is free before the engine's next step, as a gRPC cancel frees it."""

    media_type = "text/event-stream"

    def __init__(
        self,
        body: AsyncGenerator[bytes, None],
        cancel: Callable[[str], None],
        done: Callable[[], None],
        headers: dict[str, str],
    ):
        super().__init__(body, headers={"Cache-Control": "no-cache", **headers}, media_type=self.media_type)
        self.cancel, self.done = cancel, done
        self._body = body  # the body_iterator, kept with its type: an async generator, closed in __call__

    async def __call__(self, scope, receive, send) -> None:
        async def watch():
            while (await receive())["type"] != "http.disconnect":
                pass
            self.cancel("client_cancelled")

        watcher = asyncio.create_task(watch())
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for data in self.body_iterator:
                await send({"type": "http.response.body", "body": data, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client went away between two writes
            self.cancel("client_cancelled")
        finally:
            watcher.cancel()
            self.cancel("client_cancelled")
            await self._body.aclose()
            self.done()
