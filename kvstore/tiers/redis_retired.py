"""``RetiredClients``: Redis clients swapped out of use, closed again once their last call ends.

redis-py reconnects a closed client on its next command: ``aclose()`` only marks it for a new
start-up, and a cluster client's next command rediscovers the topology and opens sockets again.
A call still in flight on a client the reconnect loop has just replaced (or a cancelled PING on a
rejected candidate, still winding down) can therefore open connections *after* the client was
closed; once nothing refers to it, the garbage collector finds it open and redis-py logs
"Unclosed RedisCluster client" / "Unclosed ClusterNode object", with its sockets left to the
collector. So every call counts as a *user* of its client while it runs (cancelled or not), and
a client retired while it has users is closed once more when the last of them ends.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

__all__ = ["RetiredClients"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


class RetiredClients:
    """In-flight calls per client, and the retired clients waiting for theirs to end.

    ``close`` is the coroutine that closes a client (every connection of it); closes that fail
    are logged at DEBUG, as a discarded client's close is best effort."""

    def __init__(self, close: Callable[[Any], Awaitable[None]], timeout_s: float) -> None:
        self._close = close
        self._timeout_s = timeout_s
        # id(client) -> calls running on it; id(client) -> client retired while in use.
        self._users: dict[int, int] = {}
        self._retired: dict[int, Any] = {}
        self._closing: set[asyncio.Task[None]] = set()

    async def run(self, client: Any, call: Callable[[Any], Awaitable[_T]]) -> _T:
        """``await call(client)``, counted as a user of ``client`` until it ends, cancelled
        or not (a call abandoned at its deadline keeps counting while it winds down)."""
        key = id(client)
        self._users[key] = self._users.get(key, 0) + 1
        try:
            return await call(client)
        finally:
            left = self._users.pop(key) - 1
            if left:
                self._users[key] = left
            elif key in self._retired:
                self._close_later(self._retired.pop(key))

    async def retire(self, client: Any) -> None:
        """Close ``client`` now (bounded by the timeout), and again after its last user ends if
        calls are still running on it."""
        if self._users.get(id(client)):
            self._retired[id(client)] = client
        await self._close_quietly(client)

    @property
    def waiting(self) -> int:
        """Retired clients still in use, or being closed once more."""
        return len(self._retired) + len(self._closing)

    async def drain(self) -> None:
        """Wait (bounded by the timeout) for the pending second closes, then close the clients
        still in use: at shutdown nothing may be left for the collector."""
        if self._closing:
            await asyncio.wait(set(self._closing), timeout=self._timeout_s)
        retired, self._retired = list(self._retired.values()), {}
        for client in retired:
            await self._close_quietly(client)

    def _close_later(self, client: Any) -> None:
        task = asyncio.get_running_loop().create_task(
            self._close_quietly(client), name="kvstore-redis-close-retired"
        )
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _close_quietly(self, client: Any) -> None:
        try:
            # Not bounded by kvstore.deadline.within(): an abandoned close would leave
            # connections open, the very thing this class is for.
            await asyncio.wait_for(self._close(client), self._timeout_s)
        except Exception as exc:  # best effort: the client is no longer used
            logger.debug("closing a retired redis client failed: %s", exc)
