"""Streaming responses: server-sent events (``text/event-stream``), the one framing every API's stream uses
(``sse``), sent by ``EventStream``, which cancels the request in the engine as soon as the client disconnects."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Callable

from fastapi.responses import StreamingResponse


def sse(data: dict | str, event: str | None = None) -> bytes:
    """One server-sent event: ``[event: NAME\\n]data: JSON\\n\\n``."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return ((f"event: {event}\n" if event else "") + f"data: {text}\n\n").encode()


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
