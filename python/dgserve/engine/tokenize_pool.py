"""The async engine's own bounded pool of tokenization threads (docs/architecture.md, "Threads and locks").

A prompt's work (tokenizing, rendering a chat template, compiling a grammar: the admission of a request) runs here,
never on the event loop nor on a pool other work shares: ``workers`` threads, at most ``queue_len`` prompts
waiting, beyond which ``QueueFullError`` at once (with the scheduler's retry estimate). Counted on the event loop.

Public contract:
    pool = TokenizePool(workers, queue_len, retry_after)   # ValueError unless workers >= 1 and queue_len >= 0
    value = await pool.run(fn, *args)                       # fn(*args) on a pool thread; QueueFullError when full
    pool.shutdown()                                         # queued jobs cancelled; running ones finish
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from dgserve.engine.scheduler import QueueFullError

T = TypeVar("T")
MIN_TOKENIZE_QUEUE = 64  # prompts waiting for a tokenization thread, at least (else the scheduler's capacity)


def default_tokenize_workers() -> int:
    """Tokenization threads by default: one per core, at most 4."""
    return max(1, min(4, os.cpu_count() or 1))


class TokenizePool:
    """``workers`` threads and room for ``queue_len`` waiting prompts; ``retry_after()``: the seconds a refused
    caller is told to wait (``Scheduler.retry_after_s``)."""

    def __init__(self, workers: int, queue_len: int, retry_after: Callable[[], float]):
        if workers < 1 or queue_len < 0:
            raise ValueError(f"tokenize_workers must be >= 1 and tokenize_queue_len >= 0, got {workers}, {queue_len}")
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="dgserve-tokenize")
        self._limit = workers + queue_len
        self._now = 0  # jobs on the pool, queued or running (counted on the loop)
        self._retry_after = retry_after

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the pool; QueueFullError at once when ``queue_len`` prompts already wait for it.
        Cancelled before it starts, it never runs; cancelled while it runs, its slot is held until its thread is
        done."""
        if self._now >= self._limit:
            raise QueueFullError(
                f"server at capacity: {self._now} prompts being tokenized, the limit of the tokenization "
                "threads and their queue",
                self._retry_after(),
            )
        self._now += 1
        job = self._pool.submit(fn, *args)
        try:
            return await asyncio.wrap_future(job)
        except asyncio.CancelledError:
            if not job.cancel():  # running: its thread goes on, and holds its place until it ends
                with contextlib.suppress(BaseException):
                    await asyncio.shield(asyncio.wrap_future(job))
            raise
        finally:
            self._now -= 1

    def shutdown(self) -> None:
        """Stop taking jobs: the queued ones are cancelled, the running ones finish on their threads."""
        self._pool.shutdown(wait=False, cancel_futures=True)
