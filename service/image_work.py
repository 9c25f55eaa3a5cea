"""Image work is admitted work (docs/images.md, "Admission"): the pools images are fetched and decoded on, the
bounded queue in front of them, and the pixel budget of the images being decoded at once.

Public contract:
    work = ImageWork(workers=4, fetchers=16, queue_len=64, pixel_budget=80_000_000)
    async with work.admit(n):          # n images enter; QueueFullError at once when the queue cannot take them
        head = await work.cpu(fn, *args)   # CPU work (base64, headers, decoding, preprocessing): the decode pool
        data = await work.io(fn, *args)    # a remote fetch (I/O): the fetch pool, never a decode worker
        async with work.pixels.hold(w * h):   # the pixel budget: waits while other decodes hold it
            image = await work.cpu(decode, ...)
    work.close()

Nothing here runs on the event loop but the counting; nothing here runs on the pool that tokenizes
(``AsyncEngine``'s own). Every image a request carries counts in the queue from its admission to its end
(fetched, decoded or refused): at most ``workers + queue_len`` images are in the image stage at once (or one
request's, when it comes alone), and a request whose images would pass that is refused at once (429 /
RESOURCE_EXHAUSTED with a Retry-After), before any of its bytes is read.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from dgserve.engine.scheduler import QueueFullError

T = TypeVar("T")

DEFAULT_SECONDS_PER_IMAGE = 0.5  # the Retry-After estimate before any image was timed
MIN_RETRY_AFTER_S, MAX_RETRY_AFTER_S = 0.05, 60.0


def default_image_workers() -> int:
    """Decode workers by default: one per core, at most 4 (decoding holds the GIL little; more cores are the
    engine's)."""
    return max(1, min(4, os.cpu_count() or 1))


@dataclass(eq=False)
class _Waiter:
    pixels: int
    granted: asyncio.Future


class PixelBudget:
    """At most ``total`` pixels held at once (the images being decoded and preprocessed), granted first come first
    served so a large image is not starved by small ones. Lives on one event loop."""

    def __init__(self, total: int):
        if total < 1:
            raise ValueError(f"pixel budget must be >= 1, got {total}")
        self.total = total
        self.used = 0
        self.peak = 0  # the most held at once (for tests and metrics)
        self._waiting: deque[_Waiter] = deque()

    async def acquire(self, pixels: int) -> int:
        """Wait until ``pixels`` (at most the whole budget: the per-image cap keeps images under it) can be held;
        returns what was taken (``release`` it)."""
        n = max(0, min(int(pixels), self.total))
        if not self._waiting and self.used + n <= self.total:
            self._take(n)
            return n
        entry = _Waiter(n, asyncio.get_running_loop().create_future())
        self._waiting.append(entry)
        try:
            await entry.granted
        except asyncio.CancelledError:
            if entry.granted.done() and not entry.granted.cancelled():
                self.release(n)  # granted as it was cancelled: give it back
            else:
                with contextlib.suppress(ValueError):
                    self._waiting.remove(entry)
                self._grant()  # it may have been the head that held the others back
            raise
        return n

    def release(self, pixels: int) -> None:
        self.used -= pixels
        assert self.used >= 0, "released more pixels than were held"
        self._grant()

    @contextlib.asynccontextmanager
    async def hold(self, pixels: int) -> AsyncIterator[int]:
        n = await self.acquire(pixels)
        try:
            yield n
        finally:
            self.release(n)

    def _take(self, n: int) -> None:
        self.used += n
        self.peak = max(self.peak, self.used)

    def _grant(self) -> None:
        while self._waiting:
            head = self._waiting[0]
            if head.granted.done():  # cancelled while waiting
                self._waiting.popleft()
                continue
            if self.used + head.pixels > self.total:
                return
            self._waiting.popleft()
            self._take(head.pixels)
            head.granted.set_result(None)


class ImageWork:
    """The image stage of every request of one server: ``workers`` decode threads, ``fetchers`` fetch threads, a
    queue of ``queue_len`` images beyond the workers and a budget of ``pixel_budget`` pixels decoded at once.
    ``length``: the engine's length check of a prompt with its images counted (``AsyncEngine.check_length``;
    None: not checked here, the engine checks the decoded request)."""

    def __init__(
        self,
        workers: int | None = None,
        fetchers: int = 16,
        queue_len: int = 64,
        pixel_budget: int = 80_000_000,
        length: Callable[..., Any] | None = None,
    ):
        self.workers = workers if workers is not None else default_image_workers()
        if self.workers < 1 or fetchers < 1 or queue_len < 0:
            raise ValueError(
                f"image workers and fetchers must be >= 1 and the queue >= 0, got {workers}, {fetchers}, {queue_len}"
            )
        self.fetchers, self.queue_len, self.length = fetchers, queue_len, length
        self.capacity = self.workers + queue_len
        self.pixels = PixelBudget(pixel_budget)
        self.in_flight = 0  # images admitted and not yet done
        self._decode = ThreadPoolExecutor(self.workers, thread_name_prefix="dgserve-image")
        self._fetch = ThreadPoolExecutor(fetchers, thread_name_prefix="dgserve-fetch")
        self._seconds: float | None = None  # moving average of one image's stage time

    @contextlib.asynccontextmanager
    async def admit(self, images: int) -> AsyncIterator[None]:
        """``images`` enter the stage for the with block; QueueFullError at once when they would pass its
        capacity (the workers and the queue). A request alone always enters (its images are capped per request)."""
        if self.in_flight and self.in_flight + images > self.capacity:
            raise QueueFullError(
                f"server at capacity for images: {self.in_flight} images being read + {images} would pass the "
                f"limit of {self.workers} workers + {self.queue_len} queued (--image-workers, --image-queue-len)",
                self.retry_after_s(),
            )
        self.in_flight += images
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.in_flight -= images
            if images:
                per = (time.monotonic() - t0) / images
                self._seconds = per if self._seconds is None else 0.8 * self._seconds + 0.2 * per

    def retry_after_s(self) -> float:
        """Estimated wait until the queue has room: the images ahead, worked ``workers`` at a time."""
        per = self._seconds if self._seconds is not None else DEFAULT_SECONDS_PER_IMAGE
        rounds = math.ceil(max(1, self.in_flight) / self.workers)
        return min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, per * rounds))

    async def cpu(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a decode worker (``run_held``)."""
        return await run_held(self._decode, fn, *args)

    async def io(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` (a fetch: waits on the network) on a fetch worker (``run_held``)."""
        return await run_held(self._fetch, fn, *args)

    def close(self) -> None:
        self._decode.shutdown(wait=False, cancel_futures=True)
        self._fetch.shutdown(wait=False, cancel_futures=True)


async def run_held(pool: ThreadPoolExecutor, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on ``pool``. Cancelled before it starts, it never runs; cancelled while it runs, the caller
    still waits for its end before the cancellation goes on, so what the caller holds for it (its place in the
    queue, its pixels) is held as long as a thread works for it."""
    job = pool.submit(fn, *args)
    try:
        return await asyncio.wrap_future(job)
    except asyncio.CancelledError:
        if not job.cancel():  # running (or done): its thread goes on, and its holdings with it
            with contextlib.suppress(BaseException):
                await asyncio.shield(asyncio.wrap_future(job))
        raise


def image_work(config, engine) -> ImageWork:
    """The image stage a ``ServiceConfig`` sets (``image_workers``, ``image_fetch_workers``, ``image_queue_len``,
    ``image_decode_pixels``: None is twice ``max_image_pixels``), counting lengths with ``engine`` (an
    ``AsyncEngine``)."""
    budget = config.image_decode_pixels
    return ImageWork(
        config.image_workers,
        config.image_fetch_workers,
        config.image_queue_len,
        budget if budget is not None else 2 * config.max_image_pixels,
        engine.check_length,
    )


_fallback: ImageWork | None = None


def fallback_work() -> ImageWork:
    """The image stage of a reader made without one (embedders, unit tests): the defaults, no length check."""
    global _fallback
    if _fallback is None:
        _fallback = ImageWork()
    return _fallback
