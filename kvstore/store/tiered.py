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
the wrong namespace is a miss. Requests are validated whole before any state changes
(:mod:`kvstore.protocol.checks`), so a bad request never loses or alters what is stored.

Concurrency: everything runs on one asyncio event loop. Reads need no lock (the index is only
changed on the loop thread and a DRAM read does not await); operations that change placement
(put, delete, promotion) hold one lock, because demotion awaits slower tiers mid-way.

The class is a facade; each job is a part of its own:

* :class:`~kvstore.store.layout.TierStack`: the tiers, and which level plays which part;
* :class:`~kvstore.store.index.BlockIndex`: per-key metadata, per-level LRU order, pins, lookup;
* :class:`~kvstore.store.mover.BlockMover`: placement, eviction, demotion, promotion, delete,
  persist, under the one lock;
* :class:`~kvstore.store.reads.BlockReader` (get, promote) and
  :class:`~kvstore.store.writes.BlockWriter` (put, commit);
* :class:`~kvstore.store.shared_writer.SharedTierWriter`: write-through and write-back to Redis;
* :class:`~kvstore.store.arena.ArenaLender`: leases and reservations for co-located clients;
* :class:`~kvstore.store.counters.StoreCounters` and
  :class:`~kvstore.store.background.BackgroundTasks`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

from kvstore.block import Keyring, installed_keyring
from kvstore.buffers import byte_view
from kvstore.policy import Policy
from kvstore.protocol.checks import check_keys, check_pairs, check_sizes
from kvstore.retention import KEEP, Retention
from kvstore.store.arena import Acquired, ArenaLender
from kvstore.store.background import BackgroundTasks
from kvstore.store.counters import StoreCounters
from kvstore.store.index import BlockIndex
from kvstore.store.layout import TierStack
from kvstore.store.mover import BlockMover
from kvstore.store.reads import BlockReader, GetResult, Promotion
from kvstore.store.remote import RemoteSource
from kvstore.store.retention_journal import RetentionJournal
from kvstore.store.shared_writer import SharedTierWriter
from kvstore.store.writes import BlockWriter
from kvstore.tiers.base import Tier
from kvstore.tiers.dram import DramLease, DramTier, Reservation
from kvstore.types import LookupResult, PutResult

__all__ = ["Acquired", "GetResult", "LookupResult", "Promotion", "PutResult", "TieredStore"]

logger = logging.getLogger(__name__)


class TieredStore:
    """Blocks across an ordered list of tiers, with LRU demotion and promotion."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        max_block_bytes: int = 64 * 1024**2,
        max_keys_per_request: int = 8192,
        policy: Policy | None = None,
        keyring: Keyring | None = None,
    ) -> None:
        if keyring is not None:
            for tier in tiers:
                tier.keyring = keyring
        self._keyring = keyring
        self._stack = TierStack(tiers)
        self.tiers = self._stack.tiers
        self.max_block_bytes = max_block_bytes
        self.max_keys_per_request = max_keys_per_request
        self.policy = policy if policy is not None else Policy()
        self._index = BlockIndex(len(self.tiers), self.policy)
        self._counters = StoreCounters()
        self._tasks = BackgroundTasks()
        self._shared = SharedTierWriter(
            self._stack.shared, self.policy, self._tasks, self._counters
        )
        self._mover = BlockMover(
            self._stack, self._index, self._counters, self._shared, self.policy
        )
        parts = (self._stack, self._index, self._counters, self._mover)
        self._reader = BlockReader(*parts, self._tasks)
        self._writer = BlockWriter(*parts, self._shared, self._tasks)
        self._lender = ArenaLender(*parts, self._reader, self._writer)
        self._listeners: list[Callable[[bytes, str | None], None]] = []
        # Retention survives a restart where a persistent tier keeps its records (nvme).
        keepers = [t.retention_records() for t in self.tiers]
        records = next((keeper for keeper in keepers if keeper is not None), None)
        self._journal = (
            None
            if records is None
            else RetentionJournal(self._index, records, self.policy.max_retention_s)
        )

    def load_index(self) -> int:
        """Rebuild the index from tiers that kept their blocks across a restart.

        Returns the number of blocks found; their retention is restored too, where a
        persistent tier kept it (:mod:`kvstore.store.retention_journal`). Call once, before
        serving.
        """
        found = self._index.load(self.tiers)
        logger.info("index rebuilt: %d block(s) on restartable tiers", found)
        if self._journal is not None:
            self._journal.restore()  # the retention of the blocks found
        return found

    @property
    def keyring(self) -> Keyring:
        """What this store's blocks are signed and verified with (its tiers, sealed gets, blocks
        read from peers): the keyring it was built with, else the process's installed one."""
        return self._keyring if self._keyring is not None else installed_keyring()

    # -- checks --------------------------------------------------------------------------------

    def _check_keys(self, keys: Sequence[bytes], namespace: bytes | None) -> None:
        check_keys(keys, namespace, self.max_keys_per_request)

    def check_sizes(self, lengths: Sequence[int]) -> None:
        """Refuse values that are empty, over the block limit or too big for the store's tiers
        (the UCX server asks before receiving a batch; put and reserve ask themselves)."""
        # The shared tier's capacity is nominal: only local tiers count.
        check_sizes(lengths, self._stack.local, self.max_block_bytes)

    @property
    def local_capacity(self) -> int:
        """Bytes the local tiers hold together (the shared tier's capacity is nominal)."""
        return sum(tier.capacity for tier in self._stack.local)

    def stored_lengths(self, keys: Sequence[bytes]) -> list[int | None]:
        """Each key's payload length as indexed here, ``None`` where this node does not index it
        (the servicer sizes its read windows with these before reading)."""
        meta = self._index.meta
        return [None if (m := meta.get(key)) is None else m.length for key in keys]

    # -- lookup, get, put, promote, delete -----------------------------------------------------

    def lookup(self, keys: Sequence[bytes], namespace: bytes) -> LookupResult:
        """How many leading ``keys`` are stored under ``namespace``, and the tier of each key."""
        self._check_keys(keys, namespace)
        result = self._index.lookup(keys, namespace, [tier.name for tier in self.tiers])
        self._counters.add("lookups")
        return result

    async def lookup_shared(self, keys: Sequence[bytes], namespace: bytes) -> LookupResult:
        """:meth:`lookup`, then ask the shared tier about the keys missing locally.

        Without a shared tier, or when every key is local, this is :meth:`lookup`. Otherwise it
        makes one ``exists`` call, bounded by the tier's own timeout (and none while it is down),
        and keys found there read ``"redis"``. ``exists`` cannot see a block's namespace, so a key
        held in Redis under another namespace counts here and is a miss for :meth:`get`.
        """
        result = self.lookup(keys, namespace)
        shared = self._stack.shared
        if shared is None or result.hits == len(keys):
            return result
        # Keys indexed locally under another namespace are misses whatever Redis holds.
        asked = [i for i in range(result.hits, len(keys)) if not result.tiers[i]]
        asked = [i for i in asked if keys[i] not in self._index]
        if not asked:
            return result
        found = await shared.exists([keys[i] for i in asked])
        tiers = list(result.tiers)
        for index, present in zip(asked, found, strict=True):
            if present:
                tiers[index] = shared.name
        hits = next((i for i, tier in enumerate(tiers) if not tier), len(keys))
        return LookupResult(hits, tiers)

    async def put(
        self,
        keys: Sequence[bytes],
        values: Sequence[Any],
        namespace: bytes,
        retention: Retention = KEEP,
    ) -> PutResult:
        """Store blocks; keys already present are left as they are (chained keys name content).

        ``retention``: keep them for a while, in memory tiers only, or not at all
        (:mod:`kvstore.retention`); keys already present get its seconds too. The whole request
        is checked first (key and value shapes, limits, namespaces, retention); a bad one raises
        and changes nothing.
        """
        self._check_keys(keys, namespace)
        check_pairs(keys, values, "values")
        self.check_retention(retention)
        views = [byte_view(value) for value in values]
        self.check_sizes([len(view) for view in views])
        if not retention.stores:
            return self.not_stored()
        return await self._writer.put(keys, views, namespace, retention)

    def check_retention(self, retention: Retention) -> None:
        """Refuse retention over the store's ``max_retention_s`` (InvalidRequestError)."""
        retention.check(self.policy.max_retention_s, self.policy.max_retention_setting)

    def not_stored(self) -> PutResult:
        """Count a put that asked not to be stored (``put_not_stored``); stored nothing."""
        self._counters.add("puts")
        self._counters.add("put_not_stored")
        return PutResult()

    async def get(
        self, keys: Sequence[bytes], namespace: bytes, *, sealed: bool = False
    ) -> list[GetResult]:
        """Each key's payload and the tier that served it; misses where absent or mismatched.

        ``sealed`` (a get for another node): each hit also carries its packed wire header with
        the keyed MAC under :attr:`keyring` (:attr:`GetResult.sealed_header`), for the reader to
        verify; a payload changed since its put is a miss instead.
        """
        self._check_keys(keys, namespace)
        return await self._reader.get(keys, namespace, self.keyring if sealed else None)

    async def promote(self, keys: Sequence[bytes], namespace: bytes) -> list[Promotion]:
        """Bring each key into the arena tier (``dram``) now, waiting for it.

        Prefetch and leases use this. Returns, per key, ``"ready"`` (resident in the arena tier),
        ``"missing"`` (in no tier under ``namespace``) or ``"failed"`` (found, but the arena tier
        could not make room for it).
        """
        self._check_keys(keys, namespace)
        return await self._reader.promote(keys, namespace)

    async def delete(self, keys: Sequence[bytes], namespace: bytes | None = None) -> int:
        """Remove blocks from every tier; returns how many this node held and removed.

        With a ``namespace``, only blocks stored under it are removed (a client cannot delete
        another namespace's blocks); ``None`` is the operator's delete of any namespace. Keys this
        node does not index are deleted from the shared tier too (another node may have stored
        them); their namespace is not checked there, which only matters for a 128-bit collision
        of keys that embed their namespace.
        """
        self._check_keys(keys, namespace)
        removed = await self._mover.delete(keys, namespace)
        self._counters.add("deletes", removed)
        return removed

    def pin(self, keys: Sequence[bytes]) -> None:
        """Keep ``keys`` from being evicted until :meth:`unpin` (reference counted)."""
        self._index.pin(keys)

    def unpin(self, keys: Sequence[bytes]) -> None:
        """Undo one :meth:`pin` of each key."""
        self._index.unpin(keys)

    # -- direct access by co-located clients (shared memory, UCX) ------------------------------

    @property
    def arena(self) -> DramTier | None:
        """The top tier if it is a memfd arena that co-located clients can map, else ``None``."""
        return self._lender.arena

    async def acquire(self, keys: Sequence[bytes], namespace: bytes) -> list[Acquired]:
        """Lease each key's pages in the arena for a reader, until :meth:`release`.

        A key held in a lower tier is promoted into the arena first (the call waits for it); one
        that cannot be brought there comes back as its payload bytes instead; a miss is ``None``.
        Leased blocks are pinned, and their pages outlive a delete or replacement until released.
        """
        self._check_keys(keys, namespace)
        return await self._lender.acquire(keys, namespace)

    def release(self, leases: Sequence[DramLease]) -> None:
        """Give back leases from :meth:`acquire` (each exactly once)."""
        self._lender.release(leases)

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
        return self._lender.record_direct_reads(keys, namespace, calls, lookups)

    async def reserve(
        self,
        keys: Sequence[bytes],
        lengths: Sequence[int],
        namespace: bytes,
        retention: Retention = KEEP,
    ) -> list[Reservation | Literal["present"] | None]:
        """Arena pages for blocks a client will write itself, then :meth:`commit`.

        Per key: a :class:`Reservation`, ``"present"`` (already stored; nothing to write) or
        ``None`` (the arena cannot make room; the caller sends that block another way). The whole
        request is checked first; a bad one raises and reserves nothing.
        """
        self.check_reserve(keys, lengths, namespace, retention)
        return await self._lender.reserve(keys, lengths, namespace, retention)

    def check_reserve(
        self,
        keys: Sequence[bytes],
        lengths: Sequence[int],
        namespace: bytes,
        retention: Retention = KEEP,
    ) -> None:
        """Refuse a :meth:`reserve` request this store would refuse (keys, namespace, one length
        per key, sizes, retention, an arena to reserve in), reserving nothing.

        :meth:`reserve` runs it first; a caller that decides something before reserving (an
        arena session's quota, which may leave some keys out of the reserve) runs it on the
        whole request, so that a bad request is an error, never "no room".
        """
        self._check_keys(keys, namespace)
        self._lender.require()
        check_pairs(keys, lengths, "lengths")
        self.check_sizes(lengths)
        self.check_retention(retention)

    async def commit(
        self,
        written: Sequence[tuple[bytes, Reservation]],
        namespace: bytes,
        retention: Retention = KEEP,
    ) -> PutResult:
        """Turn written reservations into blocks (xxh3 checksum now, no MAC); see :meth:`reserve`.

        A key stored meanwhile by someone else keeps that copy and this reservation is given
        back (``already_present``, or ``dropped`` if it was stored under another namespace).
        ``retention`` as for :meth:`put`; ``tiers="none"`` gives every reservation back.
        """
        self.check_retention(retention)
        if not retention.stores:
            self.cancel([reservation for _, reservation in written])
            return self.not_stored()
        return await self._lender.commit(written, namespace, retention)

    def cancel(self, reservations: Sequence[Reservation]) -> None:
        """Give back reservations that will not be committed (idempotent)."""
        self._lender.cancel(reservations)

    # -- watching what the store holds (the cluster index) -------------------------------------

    def set_remote_source(self, source: RemoteSource | None) -> None:
        """Read keys this node does not index from ``source`` (the cluster's peers) once local
        tiers miss, before the shared tier; see :mod:`kvstore.store.remote`."""
        self._reader.remote = source

    def add_listener(self, listener: Callable[[bytes, str | None], None]) -> None:
        """Call ``listener(key, tier)`` whenever a key's fastest local tier changes: ``tier`` is
        that tier's name, or ``None`` once the key left the store.

        It runs on the event loop, inside the change: it must be quick and must not await (queue
        the event and act later). An exception it raises is logged and swallowed: a listener
        never fails a store operation.
        """
        names = [tier.name for tier in self.tiers]
        listeners = self._listeners
        listeners.append(listener)

        def notify(key: bytes, level: int | None) -> None:
            tier = None if level is None else names[level]
            for each in listeners:
                try:
                    each(key, tier)
                except Exception:
                    logger.exception("store listener %r failed; ignored", each)

        self._index.on_change = notify

    def tier_of(self, key: bytes) -> str | None:
        """The name of the fastest local tier holding ``key`` (``None``: none holds it)."""
        level = self._index.level_of(key)
        return None if level is None else self.tiers[level].name

    def holdings(self) -> Iterator[tuple[bytes, str]]:
        """Every key the store holds with the name of the fastest tier holding it (a listener's
        full resync); iterate without awaiting in between (the index changes on the loop)."""
        names = [tier.name for tier in self.tiers]
        index = self._index
        for key in list(index.meta):
            level = index.level_of(key)
            if level is not None:
                yield key, names[level]

    # -- shutdown and stats --------------------------------------------------------------------

    async def persist(self, budget_s: float) -> int:
        """Copy blocks held only in volatile tiers down into the first persistent tier.

        Most recently used blocks go first, and copying stops after ``budget_s`` seconds, so a
        graceful shutdown keeps as much of the hot set as its grace period allows. Returns the
        number of blocks copied.
        """
        return await self._mover.persist(budget_s)

    def stats(self) -> dict[str, Any]:
        """Per-tier usage and counters, plus store-wide counters."""
        return self._counters.report(self._stack, self._index)

    def record_misses(self, reason: str, count: int) -> None:
        """Count ``count`` keys not served for a reason the server saw (``deadline``)."""
        self._counters.misses[reason] += count
        self._counters.add("misses", count)

    @property
    def counters(self) -> StoreCounters:
        """The live counters (the metrics endpoint reads them at scrape time)."""
        return self._counters

    @property
    def background_tasks(self) -> int:
        """Background moves and copies under way now (promotions, demotions, shared copies)."""
        return len(self._tasks)

    @property
    def shared_writer(self) -> SharedTierWriter:
        """Write-through/back to the shared tier (its backlog, for the metrics endpoint)."""
        return self._shared

    async def drain(self) -> None:
        """Wait until background promotions have finished (tests and shutdown use this)."""
        await self._tasks.drain()

    async def close(self) -> None:
        """Let background moves finish, then close every tier."""
        await self.drain()
        await self._shared.close()
        if self._journal is not None:
            await self._journal.close()
        for tier in self.tiers:
            await tier.close()
