"""``BlockMover``: every change of where blocks live, under the store's one lock.

* :meth:`~BlockMover.place` writes a block into the fastest tier of a range that can make room;
  making room evicts that tier's least recently used unpinned blocks, and eviction *demotes*: the
  victim is copied to the next tier down (if the admission policy lets it and it is not already
  there) before its pages are freed. A block evicted from the last local tier leaves the store
  (and, under write-back, goes to the shared tier).
* :meth:`~BlockMover.promote_hit` copies a block that was read below the top tier up into the
  fastest tier that takes it; :meth:`~BlockMover.copy_into` copies one into one given tier (the
  arena, for prefetch and leases). The hierarchy is inclusive: the lower copy stays.
* :meth:`~BlockMover.delete` and :meth:`~BlockMover.persist` (the shutdown copy down into the
  first persistent tier).

Retention (:mod:`kvstore.retention`): eviction passes over retained blocks as over pinned ones.
Only a ``force``-d placement (a put that asks for retention, or the demotion of a retained block)
may evict retained blocks, and only once every other unpinned block of the tier is gone; those
leave soonest-expiring first and count as ``retained_evicted_early``. A block kept in memory
tiers only is dropped where eviction would demote it into a persistent tier, never written back
and never persisted.

Demotion awaits slower tiers mid-way, hence the lock: callers hold :attr:`BlockMover.lock`
around :meth:`place`, :meth:`make_room` and :meth:`evict`; the other methods take it themselves.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from kvstore.block import BlockHeader
from kvstore.policy import Policy
from kvstore.store.counters import StoreCounters
from kvstore.store.index import BlockIndex
from kvstore.store.layout import TierStack
from kvstore.store.shared_writer import SharedTierWriter
from kvstore.tiers.dram import DramTier

__all__ = ["BlockMover"]

# How many extra LRU blocks to evict when a tier reports "no room" despite its accounting
# (LMDB's map can fill with B-tree and free pages before our estimate says so).
_MAX_WRITE_RETRIES = 8


class BlockMover:
    """Places, evicts, demotes, promotes and deletes blocks, one change at a time."""

    def __init__(
        self,
        stack: TierStack,
        index: BlockIndex,
        counters: StoreCounters,
        writer: SharedTierWriter,
        policy: Policy,
    ) -> None:
        self.lock = asyncio.Lock()
        #: Bumped by every delete: a block read from the shared tier before a delete must not be
        #: promoted after it (it would bring back a deleted block).
        self.delete_epoch = 0
        self._stack = stack
        self._index = index
        self._counters = counters
        self._writer = writer
        self._policy = policy

    # -- placement and eviction (caller holds the lock) ---------------------------------------

    async def place_promotion(
        self, header: BlockHeader, payload: memoryview, start: int, stop: int
    ) -> str | None:
        """:meth:`place` a block read from further away (a lower tier, a peer), counted as a
        promotion into the tier that took it. Must hold :attr:`lock`."""
        placed = await self.place(header, payload, start, stop)
        if placed:
            self._counters.add("promotions")
            self._counters.promotions[placed] += 1
        return placed

    async def place(
        self,
        header: BlockHeader,
        payload: memoryview,
        start: int,
        stop: int,
        force: bool = False,
    ) -> str | None:
        """Write a block into the fastest tier in ``[start, stop)`` that can make room for it.

        ``force``: the block is retained, so room may be made by evicting retained blocks too
        (see the module docstring). Returns the tier's name, or ``None`` if none could. Must
        hold :attr:`lock`.
        """
        for level in range(start, min(stop, self._stack.local_levels)):
            tier = self._stack[level]
            footprint = tier.footprint(header.length)
            if footprint > tier.capacity:
                continue
            if not await self.make_room(level, footprint, force):
                continue
            for _ in range(_MAX_WRITE_RETRIES):
                if await tier.write(header, payload):
                    self._counters.written_bytes[tier.name] += header.length
                    self._index.add(header.key, header.namespace, header.length, level, footprint)
                    return tier.name
                # The tier's own limit bit before our estimate: evict one more block and retry.
                if not await self.evict(level, 1, force):
                    break
        return None

    async def make_room(self, level: int, footprint: int, force: bool = False) -> bool:
        """Evict (demoting) LRU blocks of tier ``level`` until ``footprint`` bytes are free
        (``force``: retained ones too, as a last resort)."""
        tier = self._stack[level]
        return await self.evict(level, footprint - (tier.capacity - tier.used), force) and (
            tier.capacity - tier.used >= footprint
        )

    async def evict(self, level: int, needed: int, force: bool = False) -> bool:
        """Demote LRU blocks of tier ``level`` worth at least ``needed`` bytes, passing over
        pinned and retained ones (``force``: retained ones go last, soonest-expiring first).

        Returns False, having evicted nothing, if the blocks it may evict cannot add up to
        ``needed``.
        """
        if level >= self._stack.local_levels:
            return False  # the shared tier evicts by itself (TTL, maxmemory)
        recency = self._index.levels[level]
        pins = self._index.pins
        protected = self._index.protected()
        victims = recency.victims(needed, exclude=protected)
        if victims is None and force:
            victims = self._forced_victims(level, needed)
        if victims is None:
            return False
        for victim in victims:
            # Demotion awaits, so a reader may have pinned a later victim in the meantime.
            if victim in pins or victim not in recency:
                continue
            await self._demote(victim, level)
        return True

    def _forced_victims(self, level: int, needed: int) -> list[bytes] | None:
        """Every unprotected block of tier ``level``, then retained ones soonest-expiring first,
        until they add up to ``needed`` bytes; ``None`` if even that is not enough."""
        index = self._index
        recency = index.levels[level]
        members = recency.members
        protected = index.protected()
        chosen = [key for key in recency if key not in protected]
        freed = sum(members[key] for key in chosen)
        pins = index.pins
        retained = sorted(
            (index.retained_until(key), key)
            for key in members
            if key in protected and key not in pins
        )
        for _, key in retained:
            if freed >= needed:
                break
            chosen.append(key)
            freed += members[key]
        return chosen if freed >= needed else None

    async def _demote(self, key: bytes, level: int) -> None:
        """Move a block out of tier ``level`` into a lower tier, or out of the store."""
        stack, index = self._stack, self._index
        tier = stack[level]
        self._counters.evictions[tier.name] += 1
        retained = index.retained_until(key) > time.monotonic()
        if retained:
            self._counters.evicted_early[tier.name] += 1
        lower = next((lv for lv in range(level + 1, len(stack)) if key in index.levels[lv]), None)
        meta = index.meta.get(key)
        fast_only = key in index.fast_only
        write_back = self._writer.writes_back and not fast_only
        block = None
        if lower is None and level + 1 < stack.local_levels:
            if fast_only and stack[level + 1].persistent:
                self._counters.add("fast_only_dropped")
            elif self._policy.admit_on_demotion(
                stack[level + 1].persistent, meta.hits if meta else 0
            ):
                block = (await tier.read([key]))[0]
                stop = stack.local_levels
                if fast_only:  # memory tiers only: stop above the first persistent one
                    stop = next((lv for lv in range(level + 1, stop) if stack[lv].persistent), stop)
                if block is not None and await self.place(
                    block.header, memoryview(block.payload), level + 1, stop, retained
                ):
                    self._counters.add("demotions")
                    self._counters.demotions[tier.name] += 1
            else:
                self._counters.add("demotions_refused")
        leaving = not any(key in r for lv, r in enumerate(index.levels) if lv != level)
        if leaving and write_back and block is None:
            block = (await tier.read([key]))[0]  # write-back: this node's last copy goes out
        if not await tier.remove([key]):
            return  # still on the medium: keep indexing it rather than orphan it
        if index.forget_in(level, key):
            self._counters.add("evicted_from_store")
            self._counters.left_store(key)
            if write_back and block is not None:
                self._writer.send([(block.header, bytes(block.payload))])
                self._counters.add("written_back")

    # -- promotion (takes the lock) ------------------------------------------------------------

    async def promote_hit(
        self, header: BlockHeader, payload: bytes | memoryview, level: int, epoch: int
    ) -> bool:
        """Copy a block just read from tier ``level`` into the fastest tier above it that can
        make room (a block read again is hot: device tiers take it).

        ``epoch``: :attr:`delete_epoch` when the block was read; for a shared-tier block, a delete
        since then means it may be a deleted one, and it is dropped. Returns True if the block is
        in the top tier afterwards.
        """
        return await self._copy_up(header, payload, level, epoch, None)

    async def copy_into(
        self, header: BlockHeader, payload: bytes | memoryview, level: int, into: int, epoch: int
    ) -> bool:
        """Copy a block read from tier ``level`` into tier ``into`` exactly (the arena, for
        prefetch and leases); ``epoch`` as for :meth:`promote_hit`. Returns True if the block is
        in tier ``into`` afterwards."""
        return await self._copy_up(header, payload, level, epoch, into)

    async def _copy_up(
        self,
        header: BlockHeader,
        payload: bytes | memoryview,
        level: int,
        epoch: int,
        into: int | None,
    ) -> bool:
        key, levels = header.key, self._index.levels
        shared_level = self._stack.shared_level
        async with self.lock:
            if level == shared_level and epoch != self.delete_epoch:
                return False
            current = self._index.level_of(key)
            meta = self._index.meta.get(key)
            if meta is not None and meta.namespace != header.namespace:
                return False
            target = 0 if into is None else into
            if level == shared_level:
                # Not indexed locally when read; a put or another promotion may have stored it
                # meanwhile.
                if current is not None and (into is None or key in levels[into]):
                    return key in levels[target]
            elif current is None:  # deleted meanwhile
                return False
            elif into is None and current < level:  # already promoted meanwhile
                return current == 0
            elif into is not None and key in levels[into]:
                return True
            start, stop = (0, level) if into is None else (into, into + 1)
            host = self._stack.host_level
            if into is None and not self._policy.promote_to_device(meta.hits if meta else 0):
                start = host  # not read often enough for a device tier yet
                if start >= level:
                    return False
            source = self._arena_view(key) if start < host else None
            if source is None:
                await self.place_promotion(header, memoryview(payload), start, stop)
                return key in levels[target]
            # Into a device tier from the arena pages themselves (page-locked where CUDA
            # exists: a DMA, no pageable copy); pinned so making room cannot move them.
            self._index.pin([key])
            try:
                await self.place_promotion(header, source, start, stop)
            finally:
                self._index.unpin([key])
            return key in levels[target]

    def _arena_view(self, key: bytes) -> memoryview | None:
        """A zero-copy view of ``key``'s payload in the dram arena, if it is one run there."""
        arena = self._stack[self._stack.host_level]
        if not isinstance(arena, DramTier) or key not in self._index.levels[self._stack.host_level]:
            return None
        return arena.view(key)

    # -- delete and persist (take the lock) ----------------------------------------------------

    async def delete(self, keys: Sequence[bytes], namespace: bytes | None) -> int:
        """Remove blocks from every tier; see :meth:`TieredStore.delete`. Returns how many."""
        index = self._index
        removed = 0
        deleted: list[bytes] = []
        unindexed: list[bytes] = []
        async with self.lock:
            self.delete_epoch += 1
            for key in dict.fromkeys(keys):  # each key once, in order
                meta = index.meta.get(key)
                if meta is None:
                    unindexed.append(key)
                    continue
                if namespace is not None and meta.namespace != namespace:
                    continue
                for level, tier in enumerate(self._stack.tiers):
                    if key in index.levels[level] and await tier.remove([key]):
                        index.levels[level].discard(key)
                # A read that found the block gone while a remove above was awaited may have
                # dropped the entry already.
                if index.forget_if_unheld(key):
                    removed += 1
                    deleted.append(key)
                else:  # a tier could not delete it; it stays visible instead of coming back later
                    self._counters.add("delete_failures")
            if self._writer.tier is not None and (deleted or unindexed):
                # Otherwise the next get here, or anywhere, brings the block back.
                await self._writer.remove(deleted + unindexed, written=deleted)
        return removed

    async def persist_keys(self, keys: Sequence[bytes]) -> int:
        """Copy ``keys`` into the first persistent tier where only faster tiers hold them (a
        retained put's blocks: with their deadlines on disk too, they survive a crash, not only
        a graceful stop). Makes room as a put would, never by evicting retained blocks. Returns
        the number of blocks copied."""
        index = self._index
        target = self._persistent_level()
        if target is None:
            return 0
        copied = 0
        async with self.lock:
            for key in keys:
                level = index.level_of(key)
                if level is None or level >= target or key in index.levels[target]:
                    continue  # gone, or on disk already
                if key in index.fast_only:
                    continue
                copied += await self._copy_down(key, level, target)
        return copied

    async def persist(self, budget_s: float) -> int:
        """Copy blocks held only in volatile tiers down into the first persistent tier.

        Most recently used blocks go first, and copying stops after ``budget_s`` seconds. Returns
        the number of blocks copied.
        """
        target = self._persistent_level()
        if target is None:
            return 0
        deadline = time.monotonic() + budget_s
        copied = 0
        async with self.lock:
            for level in range(target):
                for key in reversed(list(self._index.levels[level])):
                    if time.monotonic() > deadline:
                        return copied
                    if key in self._index.levels[target] or key in self._index.fast_only:
                        continue
                    copied += await self._copy_down(key, level, target)
        return copied

    def _persistent_level(self) -> int | None:
        """The level of the first persistent tier (``None``: none is)."""
        tiers = self._stack.tiers
        return next((level for level, tier in enumerate(tiers) if tier.persistent), None)

    async def _copy_down(self, key: bytes, level: int, target: int) -> bool:
        """Copy ``key``'s block from ``level`` into ``target`` (making room as a put would, never
        below ``target``); whether it was placed. Called under :attr:`lock`."""
        block = (await self._stack.tiers[level].read([key]))[0]
        if block is None:
            return False
        return bool(await self.place(block.header, memoryview(block.payload), target, target + 1))
