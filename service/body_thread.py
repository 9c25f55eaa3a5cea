"""The one body thread: body-sized work of any door (decoding a large JSON body, converting a large request) runs
there, one at a time, off the event loop. json.loads and a request's conversion hold the GIL while they run, so two
at once would only take turns at the GIL away from the event loop; one at a time, the loop gets it back between
them."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


async def in_body_thread(work: Callable[..., T], *args) -> T:
    """``work(*args)`` in the one body thread (body-sized work takes turns there, one at a time)."""
    return await asyncio.get_running_loop().run_in_executor(_body_thread(), work, *args)


@functools.cache
def _body_thread() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dgserve-body")
