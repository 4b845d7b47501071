"""``ArenaLender``: direct access to the dram arena by co-located clients (shared memory, UCX).

The store's side of lending pages: what is lent, to whom, and for how long is the server's
business (its arena sessions, :mod:`kvstore.server.sessions`); this part keeps each lease and
reservation consistent with the store's index, counters and tiers.

Readers *acquire* leases on a block's arena pages and *release* them when done (the block is pinned
meanwhile, and its pages outlive a delete or replacement until released); clients that read through
the published index report those reads afterwards (*record_direct_reads*). Writers *reserve* arena
pages, write into them, then *commit* them as blocks or *cancel* them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from kvstore.errors import InvalidRequestError
from kvstore.retention import KEEP, Retention
from kvstore.store.counters import StoreCounters
from kvstore.store.index import BlockIndex
from kvstore.store.layout import TierStack
from kvstore.store.mover import BlockMover
from kvstore.store.reads import BlockReader
from kvstore.store.writes import BlockWriter
from kvstore.tiers.dram import DramLease, DramTier, Reservation
from kvstore.types import PutResult

__all__ = ["Acquired", "ArenaLender"]

Acquired = DramLease | bytes | memoryview | None
"""One key's answer to :meth:`TieredStore.acquire`: a lease, the payload itself, or a miss."""


class ArenaLender:
    """Leases and reservations on the arena tier, kept consistent with the index and counters."""

    def __init__(
        self,
        stack: TierStack,
        index: BlockIndex,
        counters: StoreCounters,
        mover: BlockMover,
        reader: BlockReader,
        writer: BlockWriter,
    ) -> None:
        self._stack = stack
        self._index = index
        self._counters = counters
        self._mover = mover
        self._reader = reader
        self._writer = writer

    @property
    def arena(self) -> DramTier | None:
        """The host tier if it is a memfd arena that co-located clients can map, else ``None``."""
        top = self._stack[self._stack.host_level]
        return top if isinstance(top, DramTier) and top.capacity else None

    def require(self) -> DramTier:
        """The arena, or :class:`InvalidRequestError` if this store has none."""
        arena = self.arena
        if arena is None:
            raise InvalidRequestError("this store has no dram arena to share")
        return arena

    # -- readers -------------------------------------------------------------------------------

    async def acquire(self, keys: Sequence[bytes], namespace: bytes) -> list[Acquired]:
        """Lease each key's arena pages (see :meth:`TieredStore.acquire`); keys are checked."""
        arena = self.require()
        index, tiers = self._index, self._stack.tiers
        results: list[Acquired] = [None] * len(keys)
        served_from: list[str] = [""] * len(keys)
        below: list[int] = []
        fallback: list[int] = []
        reasons: dict[int, str] = {}
        for position, key in enumerate(keys):
            meta = index.meta.get(key)
            if meta is not None and meta.namespace != namespace:
                self._counters.add("namespace_mismatches")
                continue
            level = index.level_of(key)
            served_from[position] = "" if level is None else tiers[level].name
            # Lease what is resident first: the pins keep promotions below from evicting it.
            resident = key in index.levels[self._stack.host_level]
            if resident and (lease := self._lease(arena, key)) is not None:
                results[position] = lease
            else:
                below.append(position)
        try:
            if below:
                why: dict[int, str] = {}
                promoted = await self._reader.promote([keys[i] for i in below], namespace, why)
                reasons = {below[i]: reason for i, reason in why.items()}
                for position, outcome in zip(below, promoted, strict=True):
                    lease = self._lease(arena, keys[position]) if outcome == "ready" else None
                    if lease is not None:
                        results[position] = lease
                    elif outcome != "missing":
                        fallback.append(position)
                if fallback:  # found, but the arena has no room (e.g. everything in it is leased)
                    fetched = await self._reader.get([keys[i] for i in fallback], namespace)
                    for position, got in zip(fallback, fetched, strict=True):
                        results[position] = got.payload
        except BaseException:
            # Cancelled (a client's deadline) or failed: nobody will ever release these.
            self.release([lease for lease in results if isinstance(lease, DramLease)])
            raise
        index.age_chain([key for key, got in zip(keys, results, strict=True) if got is not None])
        # Counted like a get; keys that took the fallback were counted by that get.
        leased = 0
        missed: list[int] = []
        counters = self._counters
        for position, acquired in enumerate(results):
            if isinstance(acquired, DramLease):
                leased += 1
                # Blocks that were not indexed locally came from the shared tier.
                tier = served_from[position] or tiers[-1].name
                counters.tier_hits[tier] += 1
                meta = index.meta.get(acquired.key)
                counters.read_bytes[tier] += meta.length if meta is not None else 0
            elif acquired is None and position not in fallback:
                missed.append(position)
        if missed:
            counters.count_misses(keys, missed, reasons, index)
        if not fallback:
            self._counters.add("gets")
        self._counters.add("hits", leased)
        self._counters.add("misses", len(missed))
        self._counters.add("blocks_leased", leased)
        return results

    def _lease(self, arena: DramTier, key: bytes) -> DramLease | None:
        lease = arena.lease(key)
        if lease is not None:
            self._index.pin([key])
            self._index.count_hit(key)
        return lease

    def release(self, leases: Sequence[DramLease]) -> None:
        """Give back leases from :meth:`acquire` (each exactly once)."""
        arena = self.require()
        for lease in leases:
            arena.release(lease)
            self._index.unpin([lease.key])

    def record_direct_reads(
        self, keys: Sequence[bytes], namespace: bytes, calls: int, lookups: int
    ) -> int:
        """Count reads a client served itself (see :meth:`TieredStore.record_direct_reads`)."""
        arena = self.require()
        index = self._index
        if lookups:
            self._counters.add("lookups", lookups)
            self._counters.add("index_lookups", lookups)
        resident = index.levels[self._stack.host_level]
        read = size = 0
        ages: list[bytes] = []
        for key in keys:
            meta = index.meta.get(key)
            if meta is None or meta.namespace != namespace:
                continue  # not what a client can have read through the index
            read += 1
            size += meta.length
            if key in resident:
                ages.append(key)
                index.count_hit(key)
        index.age_chain(ages)
        self._counters.tier_hits[arena.name] += read
        self._counters.read_bytes[arena.name] += size
        self._counters.add("gets", calls)
        self._counters.add("hits", read)
        self._counters.add("blocks_read_direct", read)
        return len(ages)

    # -- writers -------------------------------------------------------------------------------

    async def reserve(
        self,
        keys: Sequence[bytes],
        lengths: Sequence[int],
        namespace: bytes,
        retention: Retention = KEEP,
    ) -> list[Reservation | Literal["present"] | None]:
        """Arena pages for blocks a client will write (see :meth:`TieredStore.reserve`); the
        request is checked. Keys already present get ``retention``'s seconds now (they will not
        be committed); a retained request may make room by evicting retained blocks."""
        arena = self.require()
        host = self._stack.host_level
        out: list[Reservation | Literal["present"] | None] = []
        force = retention.seconds > 0
        async with self._mover.lock:
            self._index.check_namespaces(keys, namespace)
            try:
                for key, length in zip(keys, lengths, strict=True):
                    if key in self._index:
                        self._index.touch(key)
                        self._index.apply(key, retention, fresh=False)
                        out.append("present")
                        continue
                    footprint = arena.footprint(length)
                    room = footprint <= arena.capacity and await self._mover.make_room(
                        host, footprint, force
                    )
                    out.append(arena.reserve(length) if room else None)
            except BaseException:
                # Cancelled mid-eviction (a client's deadline): nobody will ever commit these.
                self.cancel([r for r in out if isinstance(r, Reservation)])
                raise
        return out

    async def commit(
        self,
        written: Sequence[tuple[bytes, Reservation]],
        namespace: bytes,
        retention: Retention = KEEP,
    ) -> PutResult:
        """Turn written reservations into blocks (see :meth:`TieredStore.commit`)."""
        return await self._writer.commit(self.require(), written, namespace, retention)

    def cancel(self, reservations: Sequence[Reservation]) -> None:
        """Give back reservations that will not be committed (idempotent)."""
        arena = self.require()
        for reservation in reservations:
            arena.cancel(reservation)
