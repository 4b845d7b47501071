"""``BlockWriter``: new blocks into the store, sent by value (``put``) or written by a co-located
client into reserved arena pages (``commit``).

Both run under the mover's lock, leave keys already stored as they are (chained keys name
content), age the request's chain, send what they stored to the shared tier (write-through) and
count it the same way (:meth:`BlockWriter._stored`). Both apply the request's
:class:`~kvstore.retention.Retention` to every block they store or find stored, the shared tier's
copy of a block found stored included (its TTL lengthened, :meth:`SharedTierWriter.extend`).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.block import BlockHeader
from kvstore.retention import KEEP, Retention
from kvstore.store.background import BackgroundTasks
from kvstore.store.counters import StoreCounters
from kvstore.store.index import BlockIndex
from kvstore.store.layout import TierStack
from kvstore.store.mover import BlockMover
from kvstore.store.shared_writer import SharedTierWriter
from kvstore.tiers.base import Buffer
from kvstore.tiers.dram import DramTier, Reservation
from kvstore.types import PutResult

__all__ = ["BlockWriter"]


def _owned(view: memoryview) -> Buffer:
    """``view`` itself if it shows immutable bytes, else a copy the caller cannot change later."""
    return view if isinstance(view.obj, bytes) else bytes(view)


class BlockWriter:
    """Stores new blocks: placed from a put's values, or installed from arena reservations."""

    def __init__(
        self,
        stack: TierStack,
        index: BlockIndex,
        counters: StoreCounters,
        mover: BlockMover,
        writer: SharedTierWriter,
        tasks: BackgroundTasks,
    ) -> None:
        self._stack = stack
        self._index = index
        self._counters = counters
        self._mover = mover
        self._writer = writer
        self._tasks = tasks

    async def put(
        self,
        keys: Sequence[bytes],
        views: Sequence[memoryview],
        namespace: bytes,
        retention: Retention = KEEP,
    ) -> PutResult:
        """Store checked values (see :meth:`TieredStore.put`); refuses, changing nothing, a key
        already stored under another namespace."""
        stack, index = self._stack, self._index
        stored = present = dropped = 0
        through: list[tuple[BlockHeader, Buffer]] = []
        found: list[bytes] = []
        fresh: list[bytes] = []
        stop = self._stop(retention)
        force = retention.seconds > 0
        shares = self._writer.writes_through and not retention.fast_only
        async with self._mover.lock:
            # Checked under the lock so that no concurrent put can slip a key in between.
            index.check_namespaces(keys, namespace)
            for key, view in zip(keys, views, strict=True):
                if key in index:
                    present += 1
                    found.append(key)
                    index.touch(key)
                    index.apply(key, retention, fresh=False)
                    continue
                header = BlockHeader.for_payload(key, namespace, view)
                if await self._mover.place(header, view, stack.host_level, stop, force):
                    stored += 1
                    fresh.append(key)
                    index.apply(key, retention, fresh=True)
                    if shares:
                        through.append((header, _owned(view)))
                else:
                    dropped += 1
            index.age_chain(keys)
        result = self._stored(
            through,
            PutResult(stored, present, dropped),
            sum(len(view) for view in views),
            retention,
            found,
            fresh,
        )
        self._counters.add("put_dropped", dropped)
        return result

    async def commit(
        self,
        arena: DramTier,
        written: Sequence[tuple[bytes, Reservation]],
        namespace: bytes,
        retention: Retention = KEEP,
    ) -> PutResult:
        """Install written reservations as blocks (see :meth:`TieredStore.commit`)."""
        index = self._index
        stored = present = dropped = 0
        through: list[tuple[BlockHeader, Buffer]] = []
        found: list[bytes] = []
        fresh: list[bytes] = []
        shares = self._writer.writes_through and not retention.fast_only
        async with self._mover.lock:
            for key, reservation in written:
                meta = index.meta.get(key)
                if meta is not None:
                    arena.cancel(reservation)
                    if meta.namespace == namespace:
                        present += 1
                        found.append(key)
                        index.apply(key, retention, fresh=False)
                    else:
                        dropped += 1
                        self._counters.add("namespace_mismatches")
                    continue
                payload = arena.reserved_payload(reservation)
                header = BlockHeader.for_payload(key, namespace, payload)
                if shares:  # copied now: the pages may be reused soon
                    through.append((header, bytes(payload)))
                arena.install(header, reservation)
                footprint = arena.footprint(header.length)
                index.add(key, namespace, header.length, self._stack.host_level, footprint)
                index.apply(key, retention, fresh=True)
                self._counters.written_bytes[arena.name] += header.length
                stored += 1
                fresh.append(key)
            index.age_chain([key for key, _ in written])
        size = sum(reservation.length for _, reservation in written)
        result = PutResult(stored, present, dropped)
        return self._stored(through, result, size, retention, found, fresh)

    def _stop(self, retention: Retention) -> int:
        """The level a put's blocks may not reach: the first persistent tier for memory-only
        ones, else the end of the local tiers."""
        stack = self._stack
        if retention.fast_only:
            for level in range(stack.host_level, stack.local_levels):
                if stack[level].persistent:
                    return level
        return stack.local_levels

    def _stored(
        self,
        through: list[tuple[BlockHeader, Buffer]],
        result: PutResult,
        size: int,
        retention: Retention,
        found: Sequence[bytes] = (),
        fresh: Sequence[bytes] = (),
    ) -> PutResult:
        """Send the new blocks to the shared tier and count the request; returns ``result``.
        ``found``: keys the request found stored, whose shared copies a retention lengthens;
        ``fresh``: keys it stored, which a retention copies to disk at once."""
        if through and self._writer.writes_through:
            # A retained block outlives the shared tier's usual TTL there too.
            self._writer.send(through, retention.seconds or None)
        if found and retention.seconds > 0 and not retention.fast_only:
            # Found stored: its copy in the shared tier (written through, or demoted there)
            # must live as long as the retention asked now, not the first put's.
            self._writer.extend(found, retention.seconds)
        if fresh and retention.seconds > 0 and not retention.fast_only:
            # On disk beside its deadline now, not at a graceful stop: it survives a crash.
            self._tasks.spawn(self._mover.persist_keys(list(fresh)))
        self._counters.add("puts")
        self._counters.add("blocks_put", result.stored)
        self._counters.add("bytes_put", size)
        return result
