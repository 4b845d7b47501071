"""``SharedTierWriter``: copies of blocks on their way to the shared tier (``redis``).

New blocks are written *through* (policy ``shared_write = "through"``) and, under ``"back"``, a
block leaving this node's last local tier is written *back*; either way the copy is sent in the
background and never awaited by the request that caused it. Copies in flight are bounded in bytes
(:data:`_WRITE_THROUGH_BACKLOG_BYTES`), and a delete waits for the copies of the keys it unlinks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from kvstore.block import BlockHeader
from kvstore.policy import Policy
from kvstore.store.background import BackgroundTasks
from kvstore.store.counters import StoreCounters
from kvstore.tiers.base import Buffer, SharedTier

__all__ = ["SharedTierWriter"]

# Most payload bytes that may wait for write-through to the shared tier at any time.
_WRITE_THROUGH_BACKLOG_BYTES = 1024**3


class SharedTierWriter:
    """Background copies to the shared tier, with a bounded backlog; inert without one."""

    def __init__(
        self,
        tier: SharedTier | None,
        policy: Policy,
        tasks: BackgroundTasks,
        counters: StoreCounters,
    ) -> None:
        self.tier = tier
        self._policy = policy
        self._tasks = tasks
        self._counters = counters
        self._in_flight_bytes = 0
        # Copies by key, so a delete can wait for the ones it must unlink.
        self._by_key: dict[bytes, asyncio.Task[None]] = {}

    @property
    def backlog_bytes(self) -> int:
        """Payload bytes on their way to the shared tier now."""
        return self._in_flight_bytes

    @property
    def writes_through(self) -> bool:
        """Whether new blocks are copied to the shared tier as they are stored."""
        return self.tier is not None and self._policy.write_through

    @property
    def writes_back(self) -> bool:
        """Whether a block leaving this node's last local tier is copied to the shared tier."""
        return self.tier is not None and self._policy.write_back

    def send(self, blocks: list[tuple[BlockHeader, Buffer]], ttl_s: float | None = None) -> None:
        """Send ``blocks`` to the shared tier in the background, never awaited by the caller;
        ``ttl_s``: keep them there at least this long (a retained put), else the tier's TTL.

        A slow Redis must neither slow puts down nor let copies pile up in memory: past
        :data:`_WRITE_THROUGH_BACKLOG_BYTES` in flight, new blocks are dropped and counted (the
        shared tier is a cache too).
        """
        tier = self.tier
        assert tier is not None
        size = sum(header.length for header, _ in blocks)
        if self._in_flight_bytes + size > _WRITE_THROUGH_BACKLOG_BYTES:
            self._counters.add("write_through_dropped", len(blocks))
            return
        self._in_flight_bytes += size

        async def send() -> None:
            try:
                stored = await tier.write_many(blocks, ttl_s)
                self._counters.written_bytes[tier.name] += sum(
                    header.length for (header, _), ok in zip(blocks, stored, strict=True) if ok
                )
            finally:
                self._in_flight_bytes -= size

        task = self._tasks.spawn(send())
        for header, _ in blocks:
            self._by_key[header.key] = task

        def forget(done: asyncio.Task[None]) -> None:
            for header, _ in blocks:
                if self._by_key.get(header.key) is done:
                    del self._by_key[header.key]

        task.add_done_callback(forget)

    async def remove(self, keys: Sequence[bytes], written: Sequence[bytes]) -> None:
        """Delete ``keys`` from the shared tier, once the copies of ``written`` (the keys this
        node stored) still on their way there have landed: they would bring the blocks back."""
        tier = self.tier
        assert tier is not None
        writing = {self._by_key[key] for key in written if key in self._by_key}
        if writing:
            await asyncio.wait(writing)
        await tier.remove(list(keys))
