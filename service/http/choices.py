"""A request's ``n`` choices (docs/generation.md, "Several choices"): n submissions opened together, so they batch
in the engine, read as one stream of (choice index, event) and cancelled together.

Each choice is a request of its own in the engine (its own id, seed, slot and chat output parser); the door only
interleaves their events in the order they come. A choice that fails ends the whole request: the others are
cancelled. A request with more choices than the engine runs and queues together could never be admitted (a 429
would have its client retry forever): ``check_admissible`` refuses it as a bad ``n`` before any work starts.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from dgserve.engine.async_engine import AsyncEngine
from dgserve.engine.prompt import Submission

from .. import events


def check_admissible(engine: AsyncEngine, n: int) -> None:
    """ValueError naming ``n`` when ``n`` choices (each a request) exceed what the engine ever holds at once: its
    running slots (``max_num_seqs``, after the KV cache budget) plus its queue (``max_queue_len``; None: unbounded).
    """
    running, queued = engine.max_num_seqs, engine.max_queue_len
    if queued is not None and n > running + queued:
        raise ValueError(
            f"n: {n} choices can never be admitted: the server runs at most {running} requests and queues "
            f"{queued} (--max-num-seqs + --max-queue-len); ask for at most {running + queued}"
        )


class Choices:
    """The events of a request's choices (``feeds``, in choice order), merged."""

    def __init__(self, feeds: Sequence[events.Events]):
        self.feeds = list(feeds)

    @classmethod
    async def open(cls, engine: AsyncEngine, subs: Sequence[Submission]) -> Choices:
        """Submit every choice, before the engine could finish any (so they run in the same steps); when one is
        refused (the queue is full, a bad field), those already submitted are cancelled and the error raised.
        More choices than the engine could ever hold are refused before the first is submitted."""
        check_admissible(engine, len(subs))
        feeds: list[events.Events] = []
        try:
            for sub in subs:
                feeds.append(await events.open_events(engine, sub))  # noqa: PERF401 - cancelled on failure
        except BaseException:
            for f in feeds:
                f.cancel("client_cancelled")
            raise
        return cls(feeds)

    def cancel(self, reason: str = "client_cancelled") -> None:
        """Stop every choice still running."""
        for f in self.feeds:
            f.cancel(reason)

    async def events(self) -> AsyncIterator[tuple[int, events.Event]]:
        """(choice index, event) as each choice's events come, each choice's in its order, until every choice has
        ended; after an ErrorEvent nothing more comes (the other choices are cancelled)."""
        if len(self.feeds) == 1:
            async for e in self.feeds[0]:
                yield 0, e
            return
        queue: asyncio.Queue[tuple[int, events.Event | None]] = asyncio.Queue()

        async def pump(i: int, feed: events.Events) -> None:
            try:
                async for e in feed:
                    queue.put_nowait((i, e))
            finally:
                queue.put_nowait((i, None))

        tasks = [asyncio.create_task(pump(i, f)) for i, f in enumerate(self.feeds)]
        try:
            running = len(tasks)
            while running:
                i, got = await queue.get()
                if got is None:
                    running -= 1
                    continue
                yield i, got
                if isinstance(got, events.ErrorEvent):
                    return
        finally:
            self.cancel()
            for t in tasks:
                t.cancel()
