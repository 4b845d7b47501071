"""``TieredStore``: the store's logic, below the gRPC layer and above the tiers.

Tiers are ordered fastest first (``hbm``, ``dram``, then ``nvme``, ...). The store decides
everything that moves bytes between them; tiers only hold bytes:

* **put** lands a block in the fastest *host* tier that can make room for it (device tiers such as
  ``hbm`` come first but take only promotions: blocks read again). Making room evicts that tier's
  least recently used blocks, and eviction *demotes*: the victim is written to the next tier down
  (unless it is already there) before its pages are freed. A block evicted from the last tier
  leaves the store.
* **get** serves each key from the fastest tier holding it; a hit below the top tier is returned
  at once and *promoted* into the tiers above in the background. The hierarchy is inclusive: a
  promoted block keeps its copy below, so demoting it again later costs nothing.
* **lookup** answers from an in-memory index (no I/O): how many leading keys are present, and the
  tier of each.

A *shared* tier (``redis``, seen by every node of a cluster; at most one, and last) is not part of
that hierarchy: the store never places blocks there or evicts them from it. Instead every newly
stored block is written through to it in the background, a get looks there (one batched read) for
keys the local index lacks and promotes what it finds, and :meth:`TieredStore.lookup_shared` asks
it which of the keys missing locally exist elsewhere in the cluster.

Every block is stored with its namespace fingerprint. A put of a key already held under another
namespace is refused (``NamespaceMismatchError``) before anything is stored; a get or lookup under
the wrong namespace is a miss. Requests are validated whole before any state changes, so a bad
request never loses or alters what is stored.

Concurrency: everything runs on one asyncio event loop. Reads need no lock (the index is only
changed on the loop thread and a DRAM read does not await); operations that change placement
(put, delete, promotion) hold one lock, because demotion awaits slower tiers mid-way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kvstore.block import BlockHeader
from kvstore.buffers import byte_view
from kvstore.errors import CapacityError, InvalidRequestError, NamespaceMismatchError
from kvstore.keys import KEY_BYTES, NAMESPACE_BYTES
from kvstore.policy import Policy
from kvstore.store.eviction import RecencyIndex
from kvstore.tiers.base import Buffer, Tier
from kvstore.tiers.dram import DramLease, DramTier, Reservation
from kvstore.tiers.redis import RedisTier
from kvstore.types import LookupResult, PutResult

__all__ = ["Acquired", "GetResult", "LookupResult", "Promotion", "PutResult", "TieredStore"]

logger = logging.getLogger(__name__)

# How many extra LRU blocks to evict when a tier reports "no room" despite its accounting
# (LMDB's map can fill with B-tree and free pages before our estimate says so).
_MAX_WRITE_RETRIES = 8

# Most payload bytes that may wait for write-through to the shared tier at any time.
_WRITE_THROUGH_BACKLOG_BYTES = 1024**3


Acquired = DramLease | bytes | memoryview | None
"""One key's answer to :meth:`TieredStore.acquire`: a lease, the payload itself, or a miss."""

Promotion = Literal["ready", "missing", "failed"]
"""What :meth:`TieredStore.promote` did with one key."""


@dataclass(frozen=True, slots=True)
class GetResult:
    """One key's answer to a get: the payload and the tier it came from, or a miss."""

    payload: bytes | memoryview | None
    tier: str = ""

    @property
    def found(self) -> bool:
        """True for a hit."""
        return self.payload is not None


@dataclass(slots=True)
class _Meta:
    namespace: bytes
    length: int
    #: Reads since the block was stored (the ``hit`` nvme admission policy asks).
    hits: int = 0


@dataclass
class _Counters:
    values: Counter[str] = field(default_factory=Counter)

    def add(self, name: str, amount: int = 1) -> None:
        self.values[name] += amount


def _owned(view: memoryview) -> Buffer:
    """``view`` itself if it shows immutable bytes, else a copy the caller cannot change later."""
    return view if isinstance(view.obj, bytes) else bytes(view)


class TieredStore:
    """Blocks across an ordered list of tiers, with LRU demotion and promotion."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        max_block_bytes: int = 64 * 1024**2,
        max_keys_per_request: int = 8192,
        policy: Policy | None = None,
    ) -> None:
        if not tiers:
            raise ValueError("a TieredStore needs at least one tier")
        self.tiers = list(tiers)
        shared = [level for level, tier in enumerate(self.tiers) if tier.shared]
        if shared and (len(shared) > 1 or shared[0] != len(self.tiers) - 1 or len(tiers) == 1):
            raise ValueError("a shared tier must be the only one, last, below a local tier")
        #: Level of the shared tier, or None; local tiers are the levels above it.
        self._shared_level = shared[0] if shared else None
        self._local_levels = len(self.tiers) - len(shared)
        devices = [level for level, tier in enumerate(self.tiers) if tier.device]
        if devices != list(range(len(devices))) or len(devices) >= self._local_levels:
            raise ValueError("device tiers (hbm) must come first, above at least one host tier")
        #: The first host-memory tier: new blocks start here (device tiers above it only take
        #: promotions), and it is the arena co-located clients map and prefetch fills.
        self._host_level = len(devices)
        self.max_block_bytes = max_block_bytes
        self.max_keys_per_request = max_keys_per_request
        self.policy = policy if policy is not None else Policy()
        self._recency = [RecencyIndex() for _ in self.tiers]
        self._meta: dict[bytes, _Meta] = {}
        self._pins: Counter[bytes] = Counter()
        self._lock = asyncio.Lock()
        self._background: set[asyncio.Task[None]] = set()
        self._counters = _Counters()
        self._tier_hits: Counter[str] = Counter()
        self._evictions: Counter[str] = Counter()
        self._write_through_bytes = 0
        # Write-through tasks by key, so a delete can wait for the copies it must unlink.
        self._through_tasks: dict[bytes, asyncio.Task[None]] = {}
        # Bumped by every delete: a block read from the shared tier before a delete must not be
        # promoted after it (it would bring back a deleted block).
        self._delete_epoch = 0

    # -- start-up -------------------------------------------------------------------------

    def load_index(self) -> int:
        """Rebuild the index from tiers that kept their blocks across a restart.

        Returns the number of blocks found. Call once, before serving.
        """
        found = 0
        for level, tier in enumerate(self.tiers):
            for header in tier.scan():
                meta = self._meta.get(header.key)
                if meta is not None and meta.namespace != header.namespace:
                    logger.error("key %s is in two namespaces; ignoring a copy", header.key.hex())
                    continue
                self._meta[header.key] = _Meta(header.namespace, header.length)
                self._recency[level].add(header.key, tier.footprint(header.length))
                found += 1
        logger.info("index rebuilt: %d block(s) on restartable tiers", found)
        return found

    # -- validation ------------------------------------------------------------------------

    def _check_keys(self, keys: Sequence[bytes], namespace: bytes | None) -> None:
        if not keys:
            raise InvalidRequestError("the request names no keys")
        if len(keys) > self.max_keys_per_request:
            raise InvalidRequestError(
                f"{len(keys)} keys in one request; the limit is {self.max_keys_per_request}"
            )
        if set(map(len, keys)) != {KEY_BYTES}:  # C speed; lookups of 1000s of keys are hot
            index, key = next((i, k) for i, k in enumerate(keys) if len(k) != KEY_BYTES)
            raise InvalidRequestError(
                f"key {index} is {len(key)} bytes; keys are {KEY_BYTES} bytes"
            )
        if namespace is not None and len(namespace) != NAMESPACE_BYTES:
            raise InvalidRequestError(
                f"namespace fingerprint is {len(namespace)} bytes; it must be {NAMESPACE_BYTES}"
            )

    def _check_namespaces(self, keys: Sequence[bytes], namespace: bytes) -> None:
        """Refuse a write of a key already stored under another namespace (before any change)."""
        for index, key in enumerate(keys):
            meta = self._meta.get(key)
            if meta is not None and meta.namespace != namespace:
                raise NamespaceMismatchError(
                    f"key {index} ({key.hex()}) is stored under namespace "
                    f"{meta.namespace.hex()}, not {namespace.hex()}"
                )

    def _level_of(self, key: bytes) -> int | None:
        for level, recency in enumerate(self._recency):
            if key in recency:
                return level
        return None

    # -- lookup ----------------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes], namespace: bytes) -> LookupResult:
        """How many leading ``keys`` are stored under ``namespace``, and the tier of each key."""
        self._check_keys(keys, namespace)
        # The loop below is the hot path of every engine's scheduling step: plain dict lookups,
        # no method calls per key.
        held = [
            (recency.members, tier.name)
            for recency, tier in zip(self._recency, self.tiers, strict=True)
        ]
        meta_of = self._meta.get
        tiers: list[str] = []
        hits = -1
        for index, key in enumerate(keys):
            meta = meta_of(key)
            name = ""
            if meta is not None and meta.namespace == namespace:
                for members, tier in held:
                    if key in members:
                        name = tier
                        break
            if not name and hits < 0:
                hits = index
            tiers.append(name)
        self._counters.add("lookups")
        return LookupResult(len(keys) if hits < 0 else hits, tiers)

    async def lookup_shared(self, keys: Sequence[bytes], namespace: bytes) -> LookupResult:
        """:meth:`lookup`, then ask the shared tier about the keys missing locally.

        Without a shared tier, or when every key is local, this is :meth:`lookup`. Otherwise it
        makes one ``exists`` call, bounded by the tier's own timeout (and none while it is down),
        and keys found there read ``"redis"``. ``exists`` cannot see a block's namespace, so a key
        held in Redis under another namespace counts here and is a miss for :meth:`get`.
        """
        result = self.lookup(keys, namespace)
        shared = self._shared_tier()
        if shared is None or result.hits == len(keys):
            return result
        # Keys indexed locally under another namespace are misses whatever Redis holds.
        asked = [i for i in range(result.hits, len(keys)) if not result.tiers[i]]
        asked = [i for i in asked if keys[i] not in self._meta]
        if not asked:
            return result
        found = await shared.exists([keys[i] for i in asked])
        tiers = list(result.tiers)
        for index, present in zip(asked, found, strict=True):
            if present:
                tiers[index] = shared.name
        hits = next((i for i, tier in enumerate(tiers) if not tier), len(keys))
        return LookupResult(hits, tiers)

    def _shared_tier(self) -> RedisTier | None:
        if self._shared_level is None:
            return None
        tier = self.tiers[self._shared_level]
        # ``exists`` and ``write_many`` are the shared tier's batch extras beyond ``Tier``.
        return tier if isinstance(tier, RedisTier) else None

    # -- put -------------------------------------------------------------------------------

    async def put(
        self, keys: Sequence[bytes], values: Sequence[Any], namespace: bytes
    ) -> PutResult:
        """Store blocks; keys already present are left as they are (chained keys name content).

        The whole request is checked first (key and value shapes, limits, namespaces); a bad one
        raises and changes nothing.
        """
        self._check_keys(keys, namespace)
        if len(values) != len(keys):
            raise InvalidRequestError(f"{len(keys)} keys but {len(values)} values")
        views = [byte_view(value) for value in values]
        self._check_sizes([len(view) for view in views])
        stored = present = dropped = 0
        through: list[tuple[BlockHeader, Buffer]] = []
        async with self._lock:
            # Checked under the lock so that no concurrent put can slip a key in between.
            self._check_namespaces(keys, namespace)
            for key, view in zip(keys, views, strict=True):
                if key in self._meta:
                    present += 1
                    self._touch(key)
                    continue
                header = BlockHeader.for_payload(key, namespace, view)
                if await self._place(header, view, self._host_level, self._local_levels) is None:
                    dropped += 1
                else:
                    stored += 1
                    through.append((header, _owned(view)))
            self._age_chain(keys)
        shared = self._shared_tier()
        if shared is not None and through and self.policy.write_through:
            self._write_through(shared, through)
        self._counters.add("puts")
        self._counters.add("blocks_put", stored)
        self._counters.add("bytes_put", sum(len(v) for v in views))
        self._counters.add("put_dropped", dropped)
        return PutResult(stored, present, dropped)

    def _check_sizes(self, lengths: Sequence[int]) -> None:
        """Refuse a request with an empty value, a value over the limit or too big for the store."""
        local = self.tiers[: self._local_levels]  # the shared tier's capacity is nominal
        largest = max(local, key=lambda tier: tier.capacity)
        total = 0
        for index, length in enumerate(lengths):
            if length <= 0:
                raise InvalidRequestError(f"value {index} is empty")
            if length > self.max_block_bytes:
                raise CapacityError(
                    f"value {index} is {length} bytes; the block limit is "
                    f"{self.max_block_bytes} bytes"
                )
            if largest.footprint(length) > largest.capacity:
                raise CapacityError(
                    f"value {index} is {length} bytes; no tier can hold it (largest tier "
                    f"{largest.name} holds {largest.capacity} bytes)"
                )
            total += largest.footprint(length)
        capacity = sum(tier.capacity for tier in local)
        if total > capacity:
            raise CapacityError(
                f"the request holds {total} bytes; all tiers together hold {capacity} bytes"
            )

    async def _place(
        self, header: BlockHeader, payload: memoryview, start: int, stop: int
    ) -> str | None:
        """Write a block into the fastest tier in ``[start, stop)`` that can make room for it.

        Returns the tier's name, or ``None`` if none could. Must hold ``self._lock``.
        """
        for level in range(start, min(stop, self._local_levels)):
            tier = self.tiers[level]
            footprint = tier.footprint(header.length)
            if footprint > tier.capacity:
                continue
            if not await self._make_room(level, footprint):
                continue
            for _ in range(_MAX_WRITE_RETRIES):
                if await tier.write(header, payload):
                    meta = self._meta.get(header.key)
                    if meta is None or meta.namespace != header.namespace:  # keep its hit count
                        self._meta[header.key] = _Meta(header.namespace, header.length)
                    self._recency[level].add(header.key, footprint)
                    return tier.name
                # The tier's own limit bit before our estimate: evict one more block and retry.
                if not await self._evict(level, 1):
                    break
        return None

    async def _make_room(self, level: int, footprint: int) -> bool:
        """Evict (demoting) LRU blocks of tier ``level`` until ``footprint`` bytes are free."""
        tier = self.tiers[level]
        return await self._evict(level, footprint - (tier.capacity - tier.used)) and (
            tier.capacity - tier.used >= footprint
        )

    async def _evict(self, level: int, needed: int) -> bool:
        """Demote LRU blocks of tier ``level`` worth at least ``needed`` bytes.

        Returns False, having evicted nothing, if unpinned blocks cannot add up to ``needed``.
        """
        if level >= self._local_levels:
            return False  # the shared tier evicts by itself (TTL, maxmemory)
        victims = self._recency[level].victims(needed, exclude=self._pins)
        if victims is None:
            return False
        for victim in victims:
            # Demotion awaits, so a reader may have pinned a later victim in the meantime.
            if victim in self._pins or victim not in self._recency[level]:
                continue
            await self._demote(victim, level)
        return True

    async def _demote(self, key: bytes, level: int) -> None:
        """Move a block out of tier ``level`` into a lower tier, or out of the store."""
        tier = self.tiers[level]
        self._evictions[tier.name] += 1
        lower = next(
            (lv for lv in range(level + 1, len(self.tiers)) if key in self._recency[lv]), None
        )
        meta = self._meta.get(key)
        shared = self._shared_tier() if self.policy.write_back else None
        block = None
        if lower is None and level + 1 < self._local_levels:
            if self.policy.admit_on_demotion(
                self.tiers[level + 1].persistent, meta.hits if meta else 0
            ):
                block = (await tier.read([key]))[0]
                if block is not None and await self._place(
                    block.header, memoryview(block.payload), level + 1, self._local_levels
                ):
                    self._counters.add("demotions")
            else:
                self._counters.add("demotions_refused")
        leaving = not any(key in r for lv, r in enumerate(self._recency) if lv != level)
        if leaving and shared is not None and block is None:
            block = (await tier.read([key]))[0]  # write-back: this node's last copy goes out
        if not await tier.remove([key]):
            return  # still on the medium: keep indexing it rather than orphan it
        self._recency[level].discard(key)
        if self._level_of(key) is None:
            self._meta.pop(key, None)
            self._counters.add("evicted_from_store")
            if shared is not None and block is not None:
                self._write_through(shared, [(block.header, bytes(block.payload))])
                self._counters.add("written_back")

    # -- get -------------------------------------------------------------------------------

    async def get(self, keys: Sequence[bytes], namespace: bytes) -> list[GetResult]:
        """Each key's payload and the tier that served it; misses where absent or mismatched."""
        self._check_keys(keys, namespace)
        results = [GetResult(None)] * len(keys)
        by_level: dict[int, list[int]] = {}
        unindexed: list[int] = []
        for index, key in enumerate(keys):
            meta = self._meta.get(key)
            if meta is None:
                unindexed.append(index)
                continue
            if meta.namespace != namespace:
                self._counters.add("namespace_mismatches")
                continue
            level = self._level_of(key)
            if level is not None:
                by_level.setdefault(level, []).append(index)
        for level in sorted(by_level):
            tier = self.tiers[level]
            wanted = [keys[index] for index in by_level[level]]
            blocks = await tier.read(wanted)
            for index, key, block in zip(by_level[level], wanted, blocks, strict=True):
                if block is None:  # vanished or failed verification: the tier dropped it
                    self._forget_in(level, key)
                    continue
                results[index] = GetResult(block.payload, tier.name)
                self._tier_hits[tier.name] += 1
                self._count_hit(key)
                if level > 0:
                    self._spawn(self._promote(block.header, block.payload, level))
        if unindexed and self._shared_level is not None:
            await self._get_shared(keys, namespace, unindexed, results)
        self._age_chain([key for key, result in zip(keys, results, strict=True) if result.found])
        found = sum(result.found for result in results)
        self._counters.add("gets")
        self._counters.add("hits", found)
        self._counters.add("misses", len(keys) - found)
        return results

    async def _get_shared(
        self,
        keys: Sequence[bytes],
        namespace: bytes,
        indices: Sequence[int],
        results: list[GetResult],
    ) -> None:
        """Fill ``results[indices]`` from the shared tier in one batched read; promote hits."""
        level = self._shared_level
        assert level is not None
        tier = self.tiers[level]
        epoch = self._delete_epoch
        blocks = await tier.read([keys[index] for index in indices])
        for index, block in zip(indices, blocks, strict=True):
            if block is None:
                continue
            if block.header.namespace != namespace:
                self._counters.add("namespace_mismatches")
                continue
            results[index] = GetResult(block.payload, tier.name)
            self._tier_hits[tier.name] += 1
            self._spawn(self._promote(block.header, block.payload, level, epoch))

    def _forget_in(self, level: int, key: bytes) -> None:
        self._recency[level].discard(key)
        if self._level_of(key) is None:
            self._meta.pop(key, None)

    async def _promote(
        self,
        header: BlockHeader,
        payload: bytes | memoryview,
        level: int,
        epoch: int = -1,
        into: int | None = None,
    ) -> bool:
        """Copy a block read from tier ``level`` into a faster tier.

        Without ``into``, into the fastest tier above ``level`` that can make room (a block read
        again is hot: device tiers take it); with ``into``, into that tier exactly (the arena,
        for prefetch and leases). ``epoch``: :attr:`_delete_epoch` when a shared-tier block was
        read; if a delete has run since, the copy may be of a deleted block and is dropped.
        Returns True if the block is in the target tier afterwards (the fastest one without
        ``into``).
        """
        async with self._lock:
            if level == self._shared_level and epoch != self._delete_epoch:
                return False
            current = self._level_of(header.key)
            meta = self._meta.get(header.key)
            if meta is not None and meta.namespace != header.namespace:
                return False
            target = 0 if into is None else into
            if level == self._shared_level:
                # Not indexed locally when read; a put or another promotion may have stored it
                # meanwhile.
                if current is not None and (into is None or header.key in self._recency[into]):
                    return header.key in self._recency[target]
            elif current is None:  # deleted meanwhile
                return False
            elif into is None and current < level:  # already promoted meanwhile
                return current == 0
            elif into is not None and header.key in self._recency[into]:
                return True
            start, stop = (0, level) if into is None else (into, into + 1)
            if await self._place(header, memoryview(payload), start, stop):
                self._counters.add("promotions")
            return header.key in self._recency[target]

    async def promote(self, keys: Sequence[bytes], namespace: bytes) -> list[Promotion]:
        """Bring each key into the arena tier (``dram``) now, waiting for it.

        Prefetch and leases use this. Returns, per key, ``"ready"`` (resident in the arena tier),
        ``"missing"`` (in no tier under ``namespace``) or ``"failed"`` (found, but the arena tier
        could not make room for it).
        """
        self._check_keys(keys, namespace)
        host = self._host_level
        outcomes: list[Promotion] = ["missing"] * len(keys)
        by_level: dict[int, list[int]] = {}
        unindexed: list[int] = []
        for index, key in enumerate(keys):
            meta = self._meta.get(key)
            if meta is None:
                unindexed.append(index)
            elif meta.namespace == namespace:
                level = self._level_of(key)
                if key in self._recency[host]:
                    outcomes[index] = "ready"
                    self._recency[host].touch(key)
                elif level is not None:
                    by_level.setdefault(level, []).append(index)
        if unindexed and self._shared_level is not None:
            by_level[self._shared_level] = unindexed
        for level in sorted(by_level):
            indices = by_level[level]
            epoch = self._delete_epoch
            blocks = await self.tiers[level].read([keys[index] for index in indices])
            for index, block in zip(indices, blocks, strict=True):
                if block is None:
                    if level != self._shared_level:  # vanished or failed verification
                        self._forget_in(level, keys[index])
                    continue
                if block.header.namespace != namespace:
                    self._counters.add("namespace_mismatches")
                    continue
                promoted = await self._promote(block.header, block.payload, level, epoch, host)
                outcomes[index] = "ready" if promoted else "failed"
        return outcomes

    def _touch(self, key: bytes) -> None:
        for recency in self._recency:
            recency.touch(key)

    def _age_chain(self, keys: Sequence[bytes]) -> None:
        """Touch one request's keys so that a chain's prefix ends up most recently used."""
        for key in self.policy.recency_order(keys):
            self._touch(key)

    def _count_hit(self, key: bytes) -> None:
        meta = self._meta.get(key)
        if meta is not None:
            meta.hits += 1

    def _write_through(self, shared: Any, blocks: list[tuple[BlockHeader, Any]]) -> None:
        """Send new blocks to the shared tier in the background, never awaited by the put.

        A slow Redis must neither slow puts down nor let copies pile up in memory: past
        :data:`_WRITE_THROUGH_BACKLOG_BYTES` in flight, new blocks are dropped and counted (the
        shared tier is a cache too).
        """
        size = sum(header.length for header, _ in blocks)
        if self._write_through_bytes + size > _WRITE_THROUGH_BACKLOG_BYTES:
            self._counters.add("write_through_dropped", len(blocks))
            return
        self._write_through_bytes += size

        async def send() -> None:
            try:
                await shared.write_many(blocks)
            finally:
                self._write_through_bytes -= size

        task = self._spawn(send())
        for header, _ in blocks:
            self._through_tasks[header.key] = task

        def forget(done: asyncio.Task[None]) -> None:
            for header, _ in blocks:
                if self._through_tasks.get(header.key) is done:
                    del self._through_tasks[header.key]

        task.add_done_callback(forget)

    def _spawn(self, coroutine: Any) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background_done)
        return task

    def _background_done(self, task: asyncio.Task[None]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("background move failed", exc_info=task.exception())

    async def drain(self) -> None:
        """Wait until background promotions have finished (tests and shutdown use this)."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    # -- direct access by co-located clients (shared memory) --------------------------------

    @property
    def arena(self) -> DramTier | None:
        """The top tier if it is a memfd arena that co-located clients can map, else ``None``."""
        top = self.tiers[self._host_level]
        return top if isinstance(top, DramTier) and top.capacity else None

    def _require_arena(self) -> DramTier:
        arena = self.arena
        if arena is None:
            raise InvalidRequestError("this store has no dram arena to share")
        return arena

    async def acquire(self, keys: Sequence[bytes], namespace: bytes) -> list[Acquired]:
        """Lease each key's pages in the arena for a reader, until :meth:`release`.

        A key held in a lower tier is promoted into the arena first (the call waits for it); one
        that cannot be brought there comes back as its payload bytes instead; a miss is ``None``.
        Leased blocks are pinned, and their pages outlive a delete or replacement until released.
        """
        self._check_keys(keys, namespace)
        arena = self._require_arena()
        results: list[Acquired] = [None] * len(keys)
        served_from: list[str] = [""] * len(keys)
        below: list[int] = []
        fallback: list[int] = []
        for index, key in enumerate(keys):
            meta = self._meta.get(key)
            if meta is not None and meta.namespace != namespace:
                self._counters.add("namespace_mismatches")
                continue
            level = self._level_of(key)
            served_from[index] = "" if level is None else self.tiers[level].name
            # Lease what is resident first: the pins keep promotions below from evicting it.
            resident = key in self._recency[self._host_level]
            if resident and (lease := self._lease(arena, key)) is not None:
                results[index] = lease
            else:
                below.append(index)
        try:
            if below:
                promoted = await self.promote([keys[index] for index in below], namespace)
                for index, outcome in zip(below, promoted, strict=True):
                    lease = self._lease(arena, keys[index]) if outcome == "ready" else None
                    if lease is not None:
                        results[index] = lease
                    elif outcome != "missing":
                        fallback.append(index)
                if fallback:  # found, but the arena has no room (e.g. everything in it is leased)
                    fetched = await self.get([keys[index] for index in fallback], namespace)
                    for index, got in zip(fallback, fetched, strict=True):
                        results[index] = got.payload
        except BaseException:
            # Cancelled (a client's deadline) or failed: nobody will ever release these.
            self.release([lease for lease in results if isinstance(lease, DramLease)])
            raise
        self._age_chain([key for key, got in zip(keys, results, strict=True) if got is not None])
        # Counted like a get; keys that took the fallback were counted by that get.
        leased = missed = 0
        for index, acquired in enumerate(results):
            if isinstance(acquired, DramLease):
                leased += 1
                # Blocks that were not indexed locally came from the shared tier.
                self._tier_hits[served_from[index] or self.tiers[-1].name] += 1
            elif acquired is None:
                missed += 1
        if not fallback:
            self._counters.add("gets")
        self._counters.add("hits", leased)
        self._counters.add("misses", missed)
        self._counters.add("blocks_leased", leased)
        return results

    def _lease(self, arena: DramTier, key: bytes) -> DramLease | None:
        lease = arena.lease(key)
        if lease is not None:
            self.pin([key])
            self._count_hit(key)
        return lease

    def release(self, leases: Sequence[DramLease]) -> None:
        """Give back leases from :meth:`acquire` (each exactly once)."""
        arena = self._require_arena()
        for lease in leases:
            arena.release(lease)
            self.unpin([lease.key])

    def record_direct_reads(
        self, keys: Sequence[bytes], namespace: bytes, calls: int = 1, lookups: int = 0
    ) -> int:
        """Count reads a co-located client served itself from the arena's published index.

        Such reads take no lease and never reach :meth:`acquire`, so this is what keeps the LRU
        order and the hit counters true to them; ``calls`` is how many client calls read them and
        no other way (counted as gets), ``lookups`` how many lookups the client answered from the
        index. Keys stored under ``namespace`` count as hits (if evicted since, the client read
        them before that); those still in the arena are also aged. Returns how many were aged.
        """
        if keys or calls:
            self._check_keys(keys, namespace)
        arena = self._require_arena()
        if lookups:
            self._counters.add("lookups", lookups)
        resident = self._recency[self._host_level]
        read = 0
        ages: list[bytes] = []
        for key in keys:
            meta = self._meta.get(key)
            if meta is None or meta.namespace != namespace:
                continue  # not what a client can have read through the index
            read += 1
            if key in resident:
                ages.append(key)
                self._count_hit(key)
        self._age_chain(ages)
        self._tier_hits[arena.name] += read
        self._counters.add("gets", calls)
        self._counters.add("hits", read)
        self._counters.add("blocks_read_direct", read)
        return len(ages)

    async def reserve(
        self, keys: Sequence[bytes], lengths: Sequence[int], namespace: bytes
    ) -> list[Reservation | Literal["present"] | None]:
        """Arena pages for blocks a client will write itself, then :meth:`commit`.

        Per key: a :class:`Reservation`, ``"present"`` (already stored; nothing to write) or
        ``None`` (the arena cannot make room; the caller sends that block another way). The whole
        request is checked first; a bad one raises and reserves nothing.
        """
        self._check_keys(keys, namespace)
        arena = self._require_arena()
        if len(lengths) != len(keys):
            raise InvalidRequestError(f"{len(keys)} keys but {len(lengths)} lengths")
        self._check_sizes(lengths)
        out: list[Reservation | Literal["present"] | None] = []
        async with self._lock:
            self._check_namespaces(keys, namespace)
            try:
                for key, length in zip(keys, lengths, strict=True):
                    if key in self._meta:
                        self._touch(key)
                        out.append("present")
                        continue
                    footprint = arena.footprint(length)
                    room = footprint <= arena.capacity and await self._make_room(
                        self._host_level, footprint
                    )
                    out.append(arena.reserve(length) if room else None)
            except BaseException:
                # Cancelled mid-eviction (a client's deadline): nobody will ever commit these.
                self.cancel([r for r in out if isinstance(r, Reservation)])
                raise
        return out

    async def commit(
        self, written: Sequence[tuple[bytes, Reservation]], namespace: bytes
    ) -> PutResult:
        """Turn written reservations into blocks (checksummed now); see :meth:`reserve`.

        A key stored meanwhile by someone else keeps that copy and this reservation is given
        back (``already_present``, or ``dropped`` if it was stored under another namespace).
        """
        arena = self._require_arena()
        stored = present = dropped = 0
        through: list[tuple[BlockHeader, Buffer]] = []
        shared = self._shared_tier()
        async with self._lock:
            for key, reservation in written:
                meta = self._meta.get(key)
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
                if shared is not None and self.policy.write_through:  # pages may be reused soon
                    through.append((header, bytes(payload)))
                arena.install(header, reservation)
                self._meta[key] = _Meta(namespace, header.length)
                self._recency[self._host_level].add(key, arena.footprint(header.length))
                stored += 1
            self._age_chain([key for key, _ in written])
        if shared is not None and through and self.policy.write_through:
            self._write_through(shared, through)
        self._counters.add("puts")
        self._counters.add("blocks_put", stored)
        self._counters.add("bytes_put", sum(reservation.length for _, reservation in written))
        return PutResult(stored, present, dropped)

    def cancel(self, reservations: Sequence[Reservation]) -> None:
        """Give back reservations that will not be committed (idempotent)."""
        arena = self._require_arena()
        for reservation in reservations:
            arena.cancel(reservation)

    # -- shutdown --------------------------------------------------------------------------

    async def persist(self, budget_s: float) -> int:
        """Copy blocks held only in volatile tiers down into the first persistent tier.

        Most recently used blocks go first, and copying stops after ``budget_s`` seconds, so a
        graceful shutdown keeps as much of the hot set as its grace period allows. Returns the
        number of blocks copied.
        """
        target = next((lv for lv, tier in enumerate(self.tiers) if tier.persistent), None)
        if target is None:
            return 0
        deadline = time.monotonic() + budget_s
        copied = 0
        async with self._lock:
            for level in range(target):
                for key in reversed(list(self._recency[level])):
                    if time.monotonic() > deadline:
                        return copied
                    if key in self._recency[target]:
                        continue
                    block = (await self.tiers[level].read([key]))[0]
                    if block is not None and await self._place(
                        block.header, memoryview(block.payload), target, target + 1
                    ):
                        copied += 1
        return copied

    # -- delete, pins, stats ---------------------------------------------------------------

    async def delete(self, keys: Sequence[bytes], namespace: bytes | None = None) -> int:
        """Remove blocks from every tier; returns how many this node held and removed.

        With a ``namespace``, only blocks stored under it are removed (a client cannot delete
        another namespace's blocks); ``None`` is the operator's delete of any namespace. Keys this
        node does not index are deleted from the shared tier too (another node may have stored
        them); their namespace is not checked there, which only matters for a 128-bit collision
        of keys that embed their namespace.
        """
        self._check_keys(keys, namespace)
        removed = 0
        deleted: list[bytes] = []
        unindexed: list[bytes] = []
        async with self._lock:
            self._delete_epoch += 1
            for key in dict.fromkeys(keys):  # each key once, in order
                meta = self._meta.get(key)
                if meta is None:
                    unindexed.append(key)
                    continue
                if namespace is not None and meta.namespace != namespace:
                    continue
                for level, tier in enumerate(self.tiers):
                    if key in self._recency[level] and await tier.remove([key]):
                        self._recency[level].discard(key)
                if self._level_of(key) is None:
                    # A read that found the block gone while a remove above was awaited may
                    # have dropped the entry already.
                    self._meta.pop(key, None)
                    removed += 1
                    deleted.append(key)
                else:  # a tier could not delete it; it stays visible instead of coming back later
                    self._counters.add("delete_failures")
            shared = self._shared_tier()
            if shared is not None and (deleted or unindexed):
                # A copy still on its way to the shared tier would land after the unlink.
                writing = {self._through_tasks[k] for k in deleted if k in self._through_tasks}
                if writing:
                    await asyncio.wait(writing)
                # Otherwise the next get here, or anywhere, brings the block back.
                await shared.remove(deleted + unindexed)
        self._counters.add("deletes", removed)
        return removed

    def pin(self, keys: Sequence[bytes]) -> None:
        """Keep ``keys`` from being evicted until :meth:`unpin` (reference counted)."""
        self._pins.update(keys)

    def unpin(self, keys: Sequence[bytes]) -> None:
        """Undo one :meth:`pin` of each key."""
        self._pins.subtract(keys)
        for key in keys:
            if self._pins[key] <= 0:
                del self._pins[key]

    def stats(self) -> dict[str, Any]:
        """Per-tier usage and counters, plus store-wide counters."""
        tiers = {}
        for level, tier in enumerate(self.tiers):
            entry = tier.stats()
            entry["hits"] = self._tier_hits[tier.name]
            entry["evictions"] = self._evictions[tier.name]
            entry["indexed_blocks"] = len(self._recency[level])
            tiers[tier.name] = entry
        return {"tiers": tiers, "counters": dict(self._counters.values), "blocks": len(self._meta)}

    async def close(self) -> None:
        """Let background moves finish, then close every tier."""
        await self.drain()
        for tier in self.tiers:
            await tier.close()
