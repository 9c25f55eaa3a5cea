"""The chat and completions API's stream: a request's events as server-sent events.

The body: the role opener (chat), one chunk per committed block (its ``dgserve.block``: stats and token ids),
drafts as ``event: dgserve.draft`` chunks with no choices (so an OpenAI client yields no text for them), the
finishing chunk with the ``dgserve`` extension, the usage chunk when asked for, ``data: [DONE]``. A request that
fails after the headers were sent ends with its OpenAI error body as one more event, then ``[DONE]``.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

from ... import events
from ..choices import Choices
from ..errors import error_body
from ..sse import sse
from . import output


async def body(feeds: Choices, outs: list[output.Output], include_usage: bool) -> AsyncGenerator[bytes, None]:
    """The SSE body of one request (see the module docstring); ``outs`` (one per choice) collect what it produced.
    With n > 1 the choices' chunks interleave, each with its ``index``; the usage chunk (all choices together)
    comes once, after the last choice finished."""
    if outs[0].chat:
        for out in outs:
            yield sse(output.chunk(out, role=True))
    try:
        async for i, event in feeds.events():
            for data in _encode(event, outs[i]):
                yield data
    except Exception as e:  # noqa: BLE001 - an encoding failure, too, can only travel as an event now
        yield sse(error_body(e)[1])
    finished = [o.finished for o in outs]
    if include_usage and all(f is not None for f in finished):
        total = output.total_usage([f.usage for f in finished if f is not None])
        yield sse(output.chunk(outs[0], no_choices=True, usage_=output.usage(total)))
    yield sse("[DONE]")


def _encode(event: events.Event, out: output.Output) -> list[bytes]:
    """The server-sent events for one event (none for StartEvent: the seed went out in the headers)."""
    if isinstance(event, events.BlockEvent):
        stats = out.add_block(event)  # (+ the block's token ids: the canvas it committed, for the playground)
        return [sse(output.chunk(out, event, extra={"block": {**stats, "token_ids": list(event.token_ids)}}))]
    if isinstance(event, events.DraftEvent):
        draft = output.chunk(out, no_choices=True, extra={"draft": output.draft(event)})
        return [sse(draft, event="dgserve.draft")]
    if isinstance(event, events.FinishEvent):
        out.finish(event)
        held = event.content or event.reasoning or event.call_deltas  # what the parser held back to the end
        frames = [sse(output.chunk(out, event))] if held else []
        reason = output.finish_reason(event.reason)
        frames.append(sse(output.chunk(out, finish=reason, extra=output.extension(out))))
        return frames
    if isinstance(event, events.ErrorEvent):  # after the headers, an error can only travel as an event
        return [sse(error_body(event.error)[1])]
    return []
