"""The server-wide in-flight byte budget: how many request and response bytes may be held at once.

Every Put stream charges the bytes of each block as it arrives and every Get charges the window it
reads before reading it; both give them back when the call ends, however it ends. A Put that would
go over the budget is refused at once (RESOURCE_EXHAUSTED: the client may retry later); a Get waits
for room (its window is small and bounded, and its deadline bounds the wait). So beyond the tiers'
own arenas the server holds at most ``limit`` bytes of payloads in flight, plus one message per
call that gRPC has already decoded when the check runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque

__all__ = ["InflightBudget"]

logger = logging.getLogger(__name__)


class InflightBudget:
    """A byte count shared by every call on one event loop (loop thread only)."""

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError(f"the in-flight budget must be > 0 bytes, got {limit}")
        self.limit = limit
        self.in_use = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    def try_take(self, size: int) -> bool:
        """Charge ``size`` bytes if they fit now; False (and nothing charged) if not."""
        if self.in_use + size > self.limit:
            return False
        self.in_use += size
        return True

    async def take(self, size: int) -> int:
        """Wait until ``size`` bytes (at most the whole budget) fit; charge and return them.

        A charge larger than the budget is cut to the budget, so a request for it waits for an
        idle server instead of forever.
        """
        size = min(size, self.limit)
        while self.in_use + size > self.limit:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
        self.in_use += size
        return size

    def give(self, size: int) -> None:
        """Give back ``size`` bytes taken before, waking the calls waiting for room (each checks
        again whether its charge fits now)."""
        self.in_use -= size
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
