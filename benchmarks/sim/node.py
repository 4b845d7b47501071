"""One simulated kvstore node: the store's own index, eviction and placement rules, no bytes.

A :class:`SimNode` keeps kvstore's real :class:`~kvstore.store.index.BlockIndex` (per-level
:class:`~kvstore.store.eviction.RecencyIndex` in the order ``policy.eviction`` evicts, hit
counts, chain ageing by :meth:`kvstore.policy.Policy.recency_order`) over the tiers ``dram`` and
``nvme``, with footprints from the tiers' own ``footprint`` rules. What moves blocks restates
:class:`~kvstore.store.mover.BlockMover` and :class:`~kvstore.store.reads.BlockReader`
synchronously (they are asynchronous and move real bytes):

* a put places each new block in the fastest tier that can make room; making room evicts by the
  policy, and an evicted block is demoted to the next tier if ``Policy.admit_on_demotion`` lets it
  (dropped from the last one); keys already held are touched; the request's keys are aged as a
  chain;
* a get serves each key from the fastest local tier; a lower-tier hit is promoted into the tiers
  above it; a key not indexed here is read from a peer (``peers``/``both``) or the shared Redis
  tier (``redis``/``both``) and placed here like a promotion.

Every change of a key's fastest tier goes to the cluster index (``BlockIndex.on_change``, the
same hook the real publisher listens on).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

from kvstore.config import DramConfig
from kvstore.policy import Policy
from kvstore.store.index import BlockIndex
from kvstore.tiers.nvme import NvmeTier
from kvstore.tiers.paged import PagedTier

__all__ = ["NAMESPACE", "TIERS", "SimNode", "footprints", "key_of"]

#: The tiers of a simulated node, fastest first (the embedded default of ``kvstore serve``).
TIERS = ("dram", "nvme")
#: Whether each tier keeps blocks across restarts (``Tier.persistent``; admission asks).
_PERSISTENT = (False, True)
#: Every simulated block is in one namespace (tenancy does not change placement).
NAMESPACE = b"sim"


def key_of(chunk: int) -> bytes:
    """The 16-byte key (``kvstore.keys.KEY_BYTES``) standing for chunk id ``chunk``."""
    return chunk.to_bytes(16, "big")


def footprints(block_bytes: int, dram_page_size: int | None = None) -> tuple[int, int]:
    """Bytes one block of ``block_bytes`` occupies in dram and in nvme, by the tiers' own rules
    (``PagedTier.footprint``: whole pages; ``NvmeTier.footprint``: LMDB pages with header)."""
    page = dram_page_size or DramConfig(capacity=0).page_size
    # Both rules read nothing of the tier but its page size: called on a stand-in, not a copy.
    dram = PagedTier.footprint(_stand_in(page_size=page), block_bytes)
    nvme = NvmeTier.footprint(_stand_in(), block_bytes)
    return dram, nvme


def _stand_in(**fields: int) -> Any:
    return SimpleNamespace(**fields)


class SimNode:
    """A node's tiers by capacity, its real block index, and counters of where reads came from."""

    def __init__(
        self,
        name: str,
        capacities: Sequence[int],
        footprint: Sequence[int],
        policy: Policy,
        on_change: Callable[[str, bytes, int | None], None] | None = None,
    ) -> None:
        self.name = name
        self.capacity = list(capacities)
        self.used = [0] * len(TIERS)
        self.footprint = list(footprint)
        self.policy = policy
        self.index = BlockIndex(len(TIERS), policy)
        if on_change is not None:
            self.index.on_change = lambda key, level: on_change(name, key, level)
        self.evicted = 0
        self.demoted = 0

    def level_of(self, key: bytes) -> int | None:
        """The fastest tier level holding ``key`` here, or ``None``."""
        return self.index.level_of(key)

    # -- BlockMover.place / make_room / evict / _demote, synchronously --------------------------

    def place(self, key: bytes, start: int = 0, stop: int = len(TIERS)) -> int | None:
        """Store ``key`` in the fastest level of ``[start, stop)`` that can make room."""
        for level in range(start, stop):
            footprint = self.footprint[level]
            if footprint > self.capacity[level] or not self._make_room(level, footprint):
                continue
            self.used[level] += footprint
            self.index.add(key, NAMESPACE, self.footprint[0], level, footprint)
            return level
        return None

    def _make_room(self, level: int, footprint: int) -> bool:
        needed = footprint - (self.capacity[level] - self.used[level])
        victims = self.index.levels[level].victims(needed, exclude=self.index.pins)
        if victims is None:
            return False
        for victim in victims:
            self._demote(victim, level)
        return self.capacity[level] - self.used[level] >= footprint

    def _demote(self, key: bytes, level: int) -> None:
        index = self.index
        lower = any(key in index.levels[lv] for lv in range(level + 1, len(TIERS)))
        meta = index.meta.get(key)
        if not lower and level + 1 < len(TIERS):
            hits = meta.hits if meta else 0
            admit = self.policy.admit_on_demotion(_PERSISTENT[level + 1], hits)
            if admit and self.place(key, level + 1, len(TIERS)) is not None:
                self.demoted += 1
        self.used[level] -= self.footprint[level]
        if index.forget_in(level, key):
            self.evicted += 1

    # -- TieredStore.get / put ------------------------------------------------------------------

    def get(self, keys: Sequence[bytes], remote: Callable[[bytes], str | None]) -> list[str | None]:
        """Per key, where it was read from (``"dram"``, ``"nvme"``, or what ``remote`` answered
        for a key not indexed here: ``"peer"``, ``"redis"``), ``None`` for a miss."""
        sources: list[str | None] = []
        promote: list[tuple[bytes, int]] = []
        fetched: list[bytes] = []
        for key in keys:
            level = self.index.level_of(key)
            if level is not None:
                sources.append(TIERS[level])
                self.index.count_hit(key)
                if level > 0:
                    promote.append((key, level))
                continue
            source = remote(key)
            sources.append(source)
            if source is not None:
                fetched.append(key)
        self.index.age_chain([k for k, s in zip(keys, sources, strict=True) if s is not None])
        # The store does these in the background, after answering.
        for key, level in promote:
            if (now := self.index.level_of(key)) is not None and now >= level:
                self.place(key, 0, level)
        for key in fetched:
            if key not in self.index:
                self.place(key, 0, len(TIERS))
        return sources

    def put(self, keys: Sequence[bytes]) -> list[bytes]:
        """Store ``keys`` (those held are touched); returns the keys newly stored."""
        stored = []
        for key in keys:
            if key in self.index:
                self.index.touch(key)
            elif self.place(key) is not None:
                stored.append(key)
        self.index.age_chain(keys)
        return stored
