"""``InFlight``: the calls of one front door that are still running, which a drain waits for."""

from __future__ import annotations

import asyncio


class InFlight:
    """A count of running calls and an event set while it is 0. Use on the event loop."""

    def __init__(self) -> None:
        self.count = 0
        self.idle = asyncio.Event()
        self.idle.set()

    def enter(self) -> None:
        self.count += 1
        self.idle.clear()

    def leave(self) -> None:
        self.count -= 1
        if self.count == 0:
            self.idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """Until no call is running (at most ``timeout`` s); True when idle."""
        if self.idle.is_set():
            return True
        try:
            await asyncio.wait_for(self.idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False
