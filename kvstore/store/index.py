"""``BlockIndex``: what the store holds, in memory, answered without I/O.

Per key: its namespace and payload length (:class:`BlockMeta`); per tier level: which keys it
holds, least recently used first (:class:`RecencyIndex`); which keys readers have pinned against
eviction; and which keys a put asked to retain, or to keep in memory tiers only
(:mod:`kvstore.retention`). The hierarchy is inclusive, so a key may be held at several levels;
it is indexed (has a :class:`BlockMeta`) exactly while some level holds it.

Only the event loop's thread changes the index, so reads of it need no lock.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass, field

from kvstore.errors import NamespaceMismatchError
from kvstore.policy import Policy
from kvstore.retention import Retention
from kvstore.store.eviction import RecencyIndex
from kvstore.tiers.base import Tier
from kvstore.types import LookupResult

__all__ = ["BlockIndex", "BlockMeta", "Protected", "Whereabouts"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class BlockMeta:
    """One stored block's namespace fingerprint and payload length."""

    namespace: bytes
    length: int
    #: Reads since the block was stored (the ``hit`` nvme admission policy asks).
    hits: int = 0


@dataclass(slots=True)
class Whereabouts:
    """Where one request's keys are, by index into the request (see :meth:`BlockIndex.locate`)."""

    #: Keys indexed under the request's namespace, by the fastest level holding them.
    by_level: dict[int, list[int]] = field(default_factory=dict)
    #: Keys this node does not index (the shared tier may hold them).
    unindexed: list[int] = field(default_factory=list)
    #: How many keys are indexed under another namespace (misses).
    mismatched: int = 0
    #: Keys held in the ``resident`` level passed to :meth:`BlockIndex.locate`, in request order;
    #: they are in no ``by_level`` list.
    resident: list[int] = field(default_factory=list)


class Protected(Container[bytes]):
    """The keys eviction must pass over at ``now``: pinned ones and those whose retention has not
    run out (what :meth:`RecencyIndex.victims` takes as ``exclude``)."""

    __slots__ = ("_now", "_pins", "_retained")

    def __init__(
        self, pins: Mapping[bytes, int], retained: Mapping[bytes, tuple[float, float]], now: float
    ) -> None:
        self._pins = pins
        self._retained = retained
        self._now = now

    def __contains__(self, key: object) -> bool:
        if key in self._pins:
            return True
        window = self._retained.get(key)  # type: ignore[call-overload]
        return window is not None and window[0] > self._now


class BlockIndex:
    """Each stored key's metadata, each level's members in eviction order, pins and retention."""

    def __init__(self, levels: int, policy: Policy) -> None:
        self.meta: dict[bytes, BlockMeta] = {}
        #: One eviction order per tier level (``policy.eviction``), fastest first.
        self.levels = [RecencyIndex(policy.eviction) for _ in range(levels)]
        #: Reference counts of keys a reader holds (never evicted while counted).
        self.pins: Counter[bytes] = Counter()
        #: Retained keys: key -> (until, seconds), ``time.monotonic()`` seconds; a read moves
        #: ``until`` to ``seconds`` from then. Entries whose time ran out stay until the key goes.
        self.retained: dict[bytes, tuple[float, float]] = {}
        #: Called with a key whose entry in :attr:`retained` was set, moved or dropped (the
        #: retention journal listens, :mod:`kvstore.store.retention_journal`).
        self.on_retention: Callable[[bytes], None] | None = None
        #: Keys stored with ``tiers="fast"``: never written to a persistent or shared tier.
        self.fast_only: set[bytes] = set()
        self._policy = policy
        #: Called with (key, the fastest level holding it now or None) after a level gains or
        #: loses ``key`` (the cluster publisher listens, :meth:`TieredStore.add_listener`);
        #: ``None`` when nobody listens, so a change costs one test.
        self.on_change: Callable[[bytes, int | None], None] | None = None

    def __len__(self) -> int:
        return len(self.meta)

    def __contains__(self, key: object) -> bool:
        return key in self.meta

    def level_of(self, key: bytes) -> int | None:
        """The fastest level holding ``key``, or None."""
        for level, recency in enumerate(self.levels):
            if key in recency:
                return level
        return None

    # -- changes -------------------------------------------------------------------------------

    def load(self, tiers: Sequence[Tier]) -> int:
        """Index the blocks that tiers kept across a restart; returns how many."""
        found = 0
        for level, tier in enumerate(tiers):
            for header in tier.scan():
                meta = self.meta.get(header.key)
                if meta is not None and meta.namespace != header.namespace:
                    logger.error("key %s is in two namespaces; ignoring a copy", header.key.hex())
                    continue
                self.meta[header.key] = BlockMeta(header.namespace, header.length)
                self.levels[level].add(header.key, tier.footprint(header.length))
                found += 1
        return found

    def add(self, key: bytes, namespace: bytes, length: int, level: int, footprint: int) -> None:
        """Record that ``level`` now holds ``key`` (most recently used there).

        A key already indexed under the same namespace keeps its hit count.
        """
        meta = self.meta.get(key)
        if meta is None or meta.namespace != namespace:
            self.meta[key] = BlockMeta(namespace, length)
        self.levels[level].add(key, footprint)
        if self.on_change is not None:
            self.on_change(key, self.level_of(key))

    def forget_if_unheld(self, key: bytes) -> bool:
        """Drop ``key``'s metadata if no level holds it any more; True if it is gone."""
        level = self.level_of(key)
        if self.on_change is not None:
            self.on_change(key, level)
        if level is not None:
            return False
        self.meta.pop(key, None)
        if self.retained.pop(key, None) is not None and self.on_retention is not None:
            self.on_retention(key)
        self.fast_only.discard(key)
        return True

    def forget_in(self, level: int, key: bytes) -> bool:
        """``level`` no longer holds ``key``; True if no level does (it left the store)."""
        self.levels[level].discard(key)
        return self.forget_if_unheld(key)

    def touch(self, key: bytes) -> None:
        """Mark ``key`` just used at every level holding it."""
        for recency in self.levels:
            recency.touch(key)

    def age_chain(self, keys: Sequence[bytes]) -> None:
        """Touch one request's keys so that a chain's prefix ends up most recently used."""
        for key in self._policy.recency_order(keys):
            self.touch(key)

    def count_hit(self, key: bytes) -> None:
        """Count a read of ``key`` (admission policies ask how often a block was read); a read
        of a retained block starts its retention window again."""
        meta = self.meta.get(key)
        if meta is not None:
            meta.hits += 1
            if self.retained and key in self.retained:
                self.retain(key, self.retained[key][1])

    def apply(self, key: bytes, retention: Retention, fresh: bool) -> None:
        """Record what a put asked for ``key``: retention (extending, never shortening, a
        window already set) and, for a block it stored (``fresh``), memory tiers only."""
        if retention.seconds > 0:
            self.retain(key, retention.seconds)
        if fresh and retention.fast_only:
            self.fast_only.add(key)

    def retain(self, key: bytes, seconds: float, now: float | None = None) -> None:
        """Keep ``key`` for at least ``seconds`` from ``now`` (default: now)."""
        until = (time.monotonic() if now is None else now) + seconds
        old = self.retained.get(key)
        if old is None:
            self.retained[key] = (until, seconds)
        else:
            self.retained[key] = (max(until, old[0]), max(seconds, old[1]))
        if self.on_retention is not None:
            self.on_retention(key)

    def retained_until(self, key: bytes) -> float:
        """When ``key``'s retention runs out (``-inf``: not retained)."""
        window = self.retained.get(key)
        return -float("inf") if window is None else window[0]

    def protected(self, now: float | None = None) -> Protected:
        """What eviction passes over at ``now`` (default: now): see :class:`Protected`."""
        return Protected(self.pins, self.retained, time.monotonic() if now is None else now)

    def pin(self, keys: Sequence[bytes]) -> None:
        """Keep ``keys`` from being evicted until :meth:`unpin` (reference counted)."""
        self.pins.update(keys)

    def unpin(self, keys: Sequence[bytes]) -> None:
        """Undo one :meth:`pin` of each key."""
        self.pins.subtract(keys)
        for key in keys:
            if self.pins[key] <= 0:
                del self.pins[key]

    # -- questions -----------------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes], namespace: bytes, names: Sequence[str]) -> LookupResult:
        """How many leading ``keys`` are held under ``namespace``; per key, the name (from
        ``names``, one per level) of the fastest level holding it, or ``""``."""
        # The loop below is the hot path of every engine's scheduling step: plain dict lookups,
        # no method calls per key.
        held = [(recency.members, name) for recency, name in zip(self.levels, names, strict=True)]
        meta_of = self.meta.get
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
        return LookupResult(len(keys) if hits < 0 else hits, tiers)

    def check_namespaces(self, keys: Sequence[bytes], namespace: bytes) -> None:
        """Refuse a write of a key already stored under another namespace (before any change)."""
        for index, key in enumerate(keys):
            meta = self.meta.get(key)
            if meta is not None and meta.namespace != namespace:
                # Never name the other namespace: its fingerprint is all a client needs to read
                # that namespace's blocks until tenants are enforced by the server.
                raise NamespaceMismatchError(
                    f"key {index} ({key.hex()}) is stored under another namespace"
                )

    def locate(
        self, keys: Sequence[bytes], namespace: bytes, resident: int | None = None
    ) -> Whereabouts:
        """Sort a request's keys by where they are; see :class:`Whereabouts`.

        With ``resident``, keys held at that level are listed apart (and not read from anywhere).
        """
        found = Whereabouts()
        held = None if resident is None else self.levels[resident]
        for index, key in enumerate(keys):
            meta = self.meta.get(key)
            if meta is None:
                found.unindexed.append(index)
            elif meta.namespace != namespace:
                found.mismatched += 1
            elif held is not None and key in held:
                found.resident.append(index)
            elif (level := self.level_of(key)) is not None:
                found.by_level.setdefault(level, []).append(index)
        return found
