"""``BlockWriter``: new blocks into the store, sent by value (``put``) or written by a co-located
client into reserved arena pages (``commit``).

Both run under the mover's lock, leave keys already stored as they are (chained keys name
content), age the request's chain, send what they stored to the shared tier (write-through) and
count it the same way (:meth:`BlockWriter._stored`).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.block import BlockHeader
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
    ) -> None:
        self._stack = stack
        self._index = index
        self._counters = counters
        self._mover = mover
        self._writer = writer

    async def put(
        self, keys: Sequence[bytes], views: Sequence[memoryview], namespace: bytes
    ) -> PutResult:
        """Store checked values (see :meth:`TieredStore.put`); refuses, changing nothing, a key
        already stored under another namespace."""
        stack, index = self._stack, self._index
        stored = present = dropped = 0
        through: list[tuple[BlockHeader, Buffer]] = []
        async with self._mover.lock:
            # Checked under the lock so that no concurrent put can slip a key in between.
            index.check_namespaces(keys, namespace)
            for key, view in zip(keys, views, strict=True):
                if key in index:
                    present += 1
                    index.touch(key)
                    continue
                header = BlockHeader.for_payload(key, namespace, view)
                if await self._mover.place(header, view, stack.host_level, stack.local_levels):
                    stored += 1
                    if self._writer.writes_through:
                        through.append((header, _owned(view)))
                else:
                    dropped += 1
            index.age_chain(keys)
        result = self._stored(
            through, PutResult(stored, present, dropped), sum(len(view) for view in views)
        )
        self._counters.add("put_dropped", dropped)
        return result

    async def commit(
        self, arena: DramTier, written: Sequence[tuple[bytes, Reservation]], namespace: bytes
    ) -> PutResult:
        """Install written reservations as blocks (see :meth:`TieredStore.commit`)."""
        index = self._index
        stored = present = dropped = 0
        through: list[tuple[BlockHeader, Buffer]] = []
        async with self._mover.lock:
            for key, reservation in written:
                meta = index.meta.get(key)
                if meta is not None:
                    arena.cancel(reservation)
                    if meta.namespace == namespace:
                        present += 1
                    else:
                        dropped += 1
                        self._counters.add("namespace_mismatches")
                    continue
                payload = arena.reserved_payload(reservation)
                header = BlockHeader.for_payload(key, namespace, payload)
                if self._writer.writes_through:  # copied now: the pages may be reused soon
                    through.append((header, bytes(payload)))
                arena.install(header, reservation)
                footprint = arena.footprint(header.length)
                index.add(key, namespace, header.length, self._stack.host_level, footprint)
                self._counters.written_bytes[arena.name] += header.length
                stored += 1
            index.age_chain([key for key, _ in written])
        size = sum(reservation.length for _, reservation in written)
        return self._stored(through, PutResult(stored, present, dropped), size)

    def _stored(
        self, through: list[tuple[BlockHeader, Buffer]], result: PutResult, size: int
    ) -> PutResult:
        """Send the new blocks to the shared tier and count the request; returns ``result``."""
        if through and self._writer.writes_through:
            self._writer.send(through)
        self._counters.add("puts")
        self._counters.add("blocks_put", result.stored)
        self._counters.add("bytes_put", size)
        return result
