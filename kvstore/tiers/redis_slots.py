"""``ConnectionSlots``: at most N Redis calls in flight per Redis server, so at most N sockets.

redis-py opens a connection whenever a call finds none free in its pool and never closes an idle
one: a node's connections to each Redis server (each cluster primary) grow to the most calls it
ever had in flight there at once (up to 2**31 for a single server, 100 per cluster node), and its
descriptors with them. A burst of reads after a failover could take hundreds of sockets, and the
count a node settles at depends on its history, not its configuration. Here every call holds one
of ``per_node`` slots of the server it goes to, from before it starts until it has wound down
(a call abandoned at its deadline keeps its slot, and its socket, until it ends), so no pool ever
needs more than ``per_node`` connections; calls beyond that wait for a slot within their own
deadline (:meth:`RedisLink.call <kvstore.tiers.redis_link.RedisLink.call>`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

__all__ = ["MIN_CALL_S", "ConnectionSlots"]

#: The least time a call must have left once it holds its slot to be sent at all. A call that
#: waited nearly all of its deadline in this node's own queue would time out at Redis for no
#: fault of Redis's, and a timeout there marks the server down.
MIN_CALL_S = 0.005


class ConnectionSlots:
    """``per_node`` slots per Redis server name (``"host:port"``; ``""`` for a single server)."""

    def __init__(self, per_node: int) -> None:
        if per_node < 1:
            raise ValueError(f"per_node must be >= 1, got {per_node}")
        self.per_node = per_node
        # One semaphore per server: bounded by the cluster's size (a server that left keeps its
        # few bytes).
        self._slots: dict[str, asyncio.Semaphore] = {}
        self._taken: dict[str, int] = {}
        #: Calls that found no free slot within their deadline (not sent; the server not down).
        self.waits_timed_out = 0

    def _of(self, node: str) -> asyncio.Semaphore:
        slots = self._slots.get(node)
        if slots is None:
            slots = self._slots[node] = asyncio.Semaphore(self.per_node)
        return slots

    async def take(self, node: str, timeout_s: float) -> bool:
        """Take a slot of ``node``, waiting up to ``timeout_s``; False if none came free."""
        if await self.take_free(node):
            return True
        if timeout_s <= 0:
            self.waits_timed_out += 1
            return False
        try:
            await asyncio.wait_for(self._of(node).acquire(), timeout_s)
        except TimeoutError:
            self.waits_timed_out += 1
            return False
        self._taken[node] = self._taken.get(node, 0) + 1
        return True

    async def take_until(self, node: str, deadline: float) -> float | None:
        """Take a slot of ``node`` by ``deadline`` (``time.monotonic()``) and return the seconds
        left for the call; ``None`` (a wait that timed out: nothing taken) if none came free
        with at least :data:`MIN_CALL_S` to spare."""
        if not await self.take(node, deadline - time.monotonic()):
            return None
        left = deadline - time.monotonic()
        if left < MIN_CALL_S:
            # The slot came free just as the deadline ran out: nothing is sent.
            self.give_back(node)
            self.waits_timed_out += 1
            return None
        return left

    async def take_free(self, node: str) -> bool:
        """Take a slot of ``node`` only if one is free now (never waits)."""
        slots = self._of(node)
        if slots.locked():
            return False
        await slots.acquire()  # a free semaphore's acquire returns without suspending
        self._taken[node] = self._taken.get(node, 0) + 1
        return True

    def hold_until_done(self, node: str, task: asyncio.Future[Any]) -> None:
        """Give ``node``'s slot back once ``task`` has ended, however it ends (even cancelled
        before it started: a coroutine's own ``finally`` would not run then)."""
        task.add_done_callback(lambda _: self.give_back(node))

    def give_back(self, node: str) -> None:
        """Give back a slot of ``node`` taken by :meth:`take` or :meth:`take_free`."""
        self._taken[node] -= 1
        self._of(node).release()

    def in_use(self, node: str = "") -> int:
        """Slots of ``node`` taken now."""
        return self._taken.get(node, 0)
