"""``SharedTierWriter``: copies of blocks on their way to the shared tier (``redis``).

New blocks are written *through* (policy ``shared_write = "through"``) and, under ``"back"``, a
block leaving this node's last local tier is written *back*; either way the copy is sent in the
background and never awaited by the request that caused it. Copies in flight are bounded in bytes
(:data:`_WRITE_THROUGH_BACKLOG_BYTES`), and a delete waits for the copies of the keys it unlinks.

**No copy is lost without a count.** A copy Redis refuses (the tier is down, the cluster node
serving its slot died, a slot is moving, a command failed) is kept in the *re-send queue*,
bounded by ``redis.resend_queue_bytes`` and ``redis.resend_queue_blocks``, and sent again with
capped, jittered exponential backoff once the tier answers (counted ``write_through_resent``).
What does not fit the queue or the in-flight backlog, and what the queue still holds when the
store closes, is *not shared*: counted in ``write_through_dropped`` (``stats``, and
``kvstore_shared_writes_dropped_total`` in ``/metrics``). A put is answered before its copy is
sent, so the answer cannot say; those counters do. A block whose payload changed since its put is
never stored (the tier counts it corrupt) and never queued. A delete drops queued copies of the
keys it removes, so a re-send never brings a deleted block back.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import OrderedDict
from collections.abc import Sequence

from kvstore.block import BlockHeader
from kvstore.policy import Policy
from kvstore.store.background import BackgroundTasks
from kvstore.store.counters import StoreCounters
from kvstore.tiers.base import Buffer, SharedTier

__all__ = ["SharedTierWriter"]

logger = logging.getLogger(__name__)

# Most payload bytes that may wait for write-through to the shared tier at any time.
_WRITE_THROUGH_BACKLOG_BYTES = 1024**3
# Most blocks / payload bytes re-sent in one batch: a batch must fit the tier's op timeout.
_RESEND_BATCH_BLOCKS = 256
_RESEND_BATCH_BYTES = 16 * 1024**2

_Block = tuple[BlockHeader, Buffer]


class SharedTierWriter:
    """Background copies to the shared tier, with a bounded backlog and a bounded re-send
    queue; inert without a shared tier."""

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
        # Copies Redis refused, oldest first, waiting to be sent again.
        self._queue: OrderedDict[bytes, _Block] = OrderedDict()
        self._queued_bytes = 0
        # The retention (seconds) a queued copy was put with, where it asked for one.
        self._queued_ttl: dict[bytes, float] = {}
        self._resender: asyncio.Task[None] | None = None
        self._closed = False
        if tier is not None:
            for name in ("write_through_dropped", "write_through_queued", "write_through_resent"):
                counters.add(name, 0)

    @property
    def backlog_bytes(self) -> int:
        """Payload bytes on their way to the shared tier now."""
        return self._in_flight_bytes

    @property
    def queued_blocks(self) -> int:
        """Blocks Redis refused that wait to be sent again."""
        return len(self._queue)

    @property
    def queued_bytes(self) -> int:
        """Payload bytes of :attr:`queued_blocks`."""
        return self._queued_bytes

    @property
    def pending_keys(self) -> int:
        """Keys whose copy is on its way to the shared tier now (a delete waits for these)."""
        return len(self._by_key)

    def queued(self, key: bytes) -> BlockHeader | None:
        """The header of ``key``'s copy waiting in the re-send queue, if one is."""
        block = self._queue.get(key)
        return None if block is None else block[0]

    @property
    def writes_through(self) -> bool:
        """Whether new blocks are copied to the shared tier as they are stored."""
        return self.tier is not None and self._policy.write_through

    @property
    def writes_back(self) -> bool:
        """Whether a block leaving this node's last local tier is copied to the shared tier."""
        return self.tier is not None and self._policy.write_back

    def send(self, blocks: list[_Block], ttl_s: float | None = None) -> None:
        """Send ``blocks`` to the shared tier in the background, never awaited by the caller;
        ``ttl_s``: keep them there at least this long (a retained put), else the tier's TTL.

        A slow Redis must neither slow puts down nor let copies pile up in memory: past
        :data:`_WRITE_THROUGH_BACKLOG_BYTES` in flight, new blocks are not shared (counted).
        Blocks Redis refuses go to the re-send queue.
        """
        size = sum(header.length for header, _ in blocks)
        if self._in_flight_bytes + size > _WRITE_THROUGH_BACKLOG_BYTES:
            self._not_shared(len(blocks), "the write-through backlog is full")
            return
        self._in_flight_bytes += size
        self._spawn(blocks, size, ttl_s=ttl_s)

    def extend(self, keys: Sequence[bytes], ttl_s: float) -> None:
        """Keep the shared tier's copies of ``keys`` (blocks already stored, put again with
        retention ``ttl_s``) at least that long, in the background: after any copy of them still
        on its way there, and for copies waiting to be sent again."""
        tier = self.tier
        if tier is None or not keys:
            return
        for key in keys:
            if key in self._queue:
                self._queued_ttl[key] = max(ttl_s, self._queued_ttl.get(key, 0.0))
        pending = {self._by_key[key] for key in keys if key in self._by_key}
        wanted = list(keys)

        async def lengthen() -> None:
            if pending:  # the SET of a copy under way would otherwise undo the longer TTL
                await asyncio.wait(pending)
            await tier.extend(wanted, ttl_s)

        self._tasks.spawn(lengthen())

    def _spawn(
        self, blocks: list[_Block], size: int, resent: bool = False, ttl_s: float | None = None
    ) -> asyncio.Task[None]:
        """One background write of ``blocks`` (``size`` bytes counted in flight; ``resent``:
        taken from the re-send queue; ``ttl_s``: their retention)."""
        tier = self.tier
        assert tier is not None

        async def send() -> None:
            try:
                outcomes = await tier.write_outcomes(blocks, ttl_s)
            finally:
                self._in_flight_bytes -= size
            written = stored = 0
            refused: list[_Block] = []
            for block, outcome in zip(blocks, outcomes, strict=True):
                if outcome is True:
                    written += block[0].length
                    stored += 1
                    self._unqueue(block[0].key)
                elif outcome is False:
                    refused.append(block)
            self._counters.written_bytes[tier.name] += written
            if resent:
                self._counters.add("write_through_resent", stored)
            self._keep(refused, ttl_s)

        task = self._tasks.spawn(send())
        for header, _ in blocks:
            self._by_key[header.key] = task

        def forget(done: asyncio.Task[None]) -> None:
            for header, _ in blocks:
                if self._by_key.get(header.key) is done:
                    del self._by_key[header.key]

        task.add_done_callback(forget)
        return task

    def _unqueue(self, key: bytes) -> _Block | None:
        """Take ``key``'s copy out of the re-send queue, if one is there."""
        block = self._queue.pop(key, None)
        if block is not None:
            self._queued_bytes -= block[0].length
            self._queued_ttl.pop(key, None)
        return block

    def _keep(self, refused: list[_Block], ttl_s: float | None = None) -> None:
        """Queue ``refused`` copies (put with retention ``ttl_s``) for re-sending, within the
        queue's bounds."""
        tier = self.tier
        assert tier is not None
        lost = 0
        for header, payload in refused:
            queued = self._queue.get(header.key)
            if queued is not None and queued[0] is header:  # a re-send refused again
                self._queue.move_to_end(header.key)
                continue
            if queued is not None:  # an older copy of the key (put again since): replaced
                self._unqueue(header.key)
            if self._closed or (
                len(self._queue) >= tier.resend_queue_blocks
                or self._queued_bytes + header.length > tier.resend_queue_bytes
            ):
                lost += 1
                continue
            self._queue[header.key] = (header, payload)
            self._queued_bytes += header.length
            if ttl_s:
                self._queued_ttl[header.key] = ttl_s
            self._counters.add("write_through_queued")
        if lost:
            self._not_shared(lost, "the re-send queue is full (redis.resend_queue_bytes/_blocks)")
        if self._queue and (self._resender is None or self._resender.done()):
            logger.warning(
                "redis refused %d write-through(s); keeping up to %d blocks / %d bytes to send "
                "again (redis.resend_queue_blocks / _bytes)",
                len(self._queue),
                tier.resend_queue_blocks,
                tier.resend_queue_bytes,
            )
            self._resender = asyncio.get_running_loop().create_task(
                self._resend(), name="kvstore-shared-resend"
            )

    def _not_shared(self, count: int, why: str) -> None:
        if self._counters.values["write_through_dropped"] == 0:
            logger.warning("%d block(s) not shared with other nodes: %s", count, why)
        self._counters.add("write_through_dropped", count)

    async def _resend(self) -> None:
        """Send queued copies again, oldest first, until the queue is empty (or closed)."""
        tier = self.tier
        assert tier is not None
        low, cap = tier.reconnect_backoff_s
        # At least every second: a promoted replica takes over within seconds, and a look at a
        # tier still down costs nothing (no network).
        cap = min(cap, 1.0)
        delay = low
        resent = self._counters.values["write_through_resent"]
        while self._queue and not self._closed:
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            if not tier.up:
                delay = min(delay * 2, cap)
                continue
            batch: list[_Block] = []
            size = 0
            # One batch, one retention: the oldest copy's, and the others queued with it.
            ttl_s = self._queued_ttl.get(next(iter(self._queue)))
            for header, payload in self._queue.values():
                if batch and (
                    len(batch) >= _RESEND_BATCH_BLOCKS or size + header.length > _RESEND_BATCH_BYTES
                ):
                    break
                if self._queued_ttl.get(header.key) != ttl_s:
                    continue
                batch.append((header, payload))
                size += header.length
            # The copies stay queued while they are sent: one stored leaves the queue, one
            # refused again moves to its end (the next batch tries the others first).
            self._in_flight_bytes += size
            before = self._counters.values["write_through_resent"]
            await asyncio.wait({self._spawn(batch, size, resent=True, ttl_s=ttl_s)})
            progress = self._counters.values["write_through_resent"] > before
            delay = low if progress else min(delay * 2, cap)
        if not self._queue:
            logger.warning(
                "re-send queue drained: %d write-through(s) sent again",
                self._counters.values["write_through_resent"] - resent,
            )

    async def remove(self, keys: Sequence[bytes], written: Sequence[bytes]) -> None:
        """Delete ``keys`` from the shared tier, once the copies of ``written`` (the keys this
        node stored) still on their way there have landed: they would bring the blocks back.
        Queued copies of ``keys`` are dropped."""
        tier = self.tier
        assert tier is not None
        for key in keys:
            self._unqueue(key)
        writing = {self._by_key[key] for key in written if key in self._by_key}
        if writing:
            await asyncio.wait(writing)
            # A copy refused meanwhile went back to the queue.
            for key in keys:
                self._unqueue(key)
        await tier.remove(list(keys))

    async def close(self) -> None:
        """Stop re-sending; what the queue still holds is counted as not shared."""
        self._closed = True
        task, self._resender = self._resender, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if self._queue:
            self._not_shared(len(self._queue), "the store closed before Redis took them")
            self._queue.clear()
            self._queued_ttl.clear()
            self._queued_bytes = 0
