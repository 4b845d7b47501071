"""Eviction policy: which blocks leave a tier when it needs room.

A policy is data: an :class:`EvictionPolicy` is a name and a *priority function* from an
:class:`Entry` (footprint, when it was stored, when last used, how often used) to a tuple; the
block with the lowest priority leaves first (the same idea as SGLang's ``evict_policy.py``):

* ``lru`` (default): ``(last_access,)``, the least recently used block first.
* ``fifo``: ``(inserted,)``, the oldest block first, whatever its use.
* ``lfu-aging``: LFU with dynamic ageing (LFU-DA): ``(clock + hits, last_access)``, where
  ``clock`` is the index's ageing clock when the block was last used; each eviction advances the
  clock to the evicted block's ``clock + hits``. Blocks many requests share (a chain's common
  prefix) outlive one-off suffixes, and the clock lets once-popular blocks age out.

The policy only orders keys; it never touches bytes. Each tier gets one :class:`RecencyIndex`
built with its policy. :meth:`RecencyIndex.victims` answers "which blocks must go to free this
many bytes" and, like every eviction decision here, either returns a complete answer or ``None``
having changed nothing.

``RecencyIndex(policy)`` gives an :class:`LruIndex` for ``lru``: an ``OrderedDict`` whose touch
is one ``move_to_end``, as before policies existed (touches are on every read's hot path). Any
other policy gets a :class:`PriorityIndex`: a lazy min-heap of priorities (a touch pushes a new
heap item; stale ones are skipped and compacted away).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Container, Iterator, Mapping
from dataclasses import dataclass
from typing import cast

from kvstore.policy import EVICTIONS

__all__ = [
    "FIFO",
    "LFU_AGING",
    "LRU",
    "POLICIES",
    "Entry",
    "EvictionPolicy",
    "LruIndex",
    "PriorityIndex",
    "RecencyIndex",
    "eviction_policy",
]

Priority = tuple[int, ...]
_Item = tuple[int | bytes, ...]


@dataclass(slots=True)
class Entry:
    """What a priority function may look at: one block's footprint and use.

    Times are the index's own sequence numbers (one per add or touch), not clock time: ordering is
    all a policy needs, and they make victim order deterministic.
    """

    footprint: int
    #: Sequence number of the add that stored the block.
    inserted: int
    #: Sequence number of the latest add or touch.
    last_access: int
    #: Touches since the block was stored.
    hits: int = 0
    #: The index's ageing clock at the latest add or touch (see ``lfu-aging``).
    clock: int = 0
    #: The index's bookkeeping: the priority and stamp of the entry's live heap item.
    rank: Priority = ()
    stamp: int = 0


@dataclass(frozen=True)
class EvictionPolicy:
    """A named priority function: lower priorities are evicted first.

    ``ages``, if given, is the value the index's ageing clock advances to when a block is chosen
    as a victim. ``by_recency`` says the priority is the last access alone, so an ``OrderedDict``
    kept in use order is exact and :class:`RecencyIndex` uses the O(1) :class:`LruIndex`.
    """

    name: str
    priority: Callable[[Entry], Priority]
    ages: Callable[[Entry], int] | None = None
    by_recency: bool = False


LRU = EvictionPolicy("lru", lambda e: (e.last_access,), by_recency=True)
FIFO = EvictionPolicy("fifo", lambda e: (e.inserted,))
LFU_AGING = EvictionPolicy(
    "lfu-aging", lambda e: (e.clock + e.hits, e.last_access), ages=lambda e: e.clock + e.hits
)

#: Every policy by its ``policy.eviction`` name.
POLICIES: dict[str, EvictionPolicy] = {p.name: p for p in (LRU, FIFO, LFU_AGING)}
# The config validates names against kvstore.policy.EVICTIONS (a leaf module); keep them one list.
assert tuple(POLICIES) == EVICTIONS, (tuple(POLICIES), EVICTIONS)


def eviction_policy(policy: EvictionPolicy | str) -> EvictionPolicy:
    """The policy itself, or the one registered under that name (``ValueError`` if none)."""
    if isinstance(policy, EvictionPolicy):
        return policy
    try:
        return POLICIES[policy]
    except KeyError:
        raise ValueError(f"eviction policy must be one of {EVICTIONS}: {policy!r}") from None


class RecencyIndex:
    """The blocks one tier holds, with their footprints, in the order its policy evicts them.

    Constructing ``RecencyIndex(policy)`` gives the implementation that suits the policy
    (:class:`LruIndex` or :class:`PriorityIndex`); both are ``RecencyIndex`` instances.
    """

    policy: EvictionPolicy

    def __new__(cls, policy: EvictionPolicy | str = LRU) -> RecencyIndex:
        if cls is RecencyIndex:
            cls = LruIndex if eviction_policy(policy).by_recency else PriorityIndex
        return object.__new__(cls)

    def __init__(self, policy: EvictionPolicy | str = LRU) -> None:
        self.policy = eviction_policy(policy)

    def __contains__(self, key: object) -> bool:
        return key in self.members

    @property
    def members(self) -> Mapping[bytes, int]:
        """Read-only view: key -> footprint (for loops that cannot afford a call per key)."""
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self.members)

    def __iter__(self) -> Iterator[bytes]:
        """Keys in eviction order: the first victim first."""
        raise NotImplementedError

    def add(self, key: bytes, footprint: int) -> None:
        """Record ``key`` (stored, or stored again) as just used."""
        raise NotImplementedError

    def touch(self, key: bytes) -> None:
        """Mark ``key`` as just used; absent keys are ignored."""
        raise NotImplementedError

    def discard(self, key: bytes) -> None:
        """Forget ``key`` if present."""
        raise NotImplementedError

    def victims(self, needed: int, exclude: Container[bytes] = ()) -> list[bytes] | None:
        """Keys, first victim first, whose footprints add up to at least ``needed`` bytes.

        Keys in ``exclude`` (pinned by a reader) are skipped. Returns ``None``, having changed
        nothing, when even evicting every other block would not free enough.
        """
        raise NotImplementedError


class LruIndex(RecencyIndex):
    """``lru``: an ``OrderedDict`` in use order, least recently used first; O(1) touch."""

    def __init__(self, policy: EvictionPolicy | str = LRU) -> None:
        super().__init__(policy)
        self._order: OrderedDict[bytes, int] = OrderedDict()

    def __contains__(self, key: object) -> bool:
        return key in self._order

    @property
    def members(self) -> Mapping[bytes, int]:
        """Read-only view: key -> footprint (for loops that cannot afford a call per key)."""
        return self._order

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._order)

    def add(self, key: bytes, footprint: int) -> None:
        """Record ``key`` as the most recently used block."""
        self._order[key] = footprint
        self._order.move_to_end(key)

    def touch(self, key: bytes) -> None:
        """Mark ``key`` as just used; absent keys are ignored."""
        if key in self._order:
            self._order.move_to_end(key)

    def discard(self, key: bytes) -> None:
        """Forget ``key`` if present."""
        self._order.pop(key, None)

    def victims(self, needed: int, exclude: Container[bytes] = ()) -> list[bytes] | None:
        """Least recently used keys (not in ``exclude``) worth ``needed`` bytes, or ``None``."""
        if needed <= 0:
            return []
        chosen: list[bytes] = []
        freed = 0
        for key, footprint in self._order.items():
            if key in exclude:
                continue
            chosen.append(key)
            freed += footprint
            if freed >= needed:
                return chosen
        return None


# A heap may hold this many stale items per live one (plus a floor) before it is rebuilt: touches
# stay O(log n) and the heap's size stays O(n).
_STALE_RATIO = 2
_STALE_FLOOR = 64


class PriorityIndex(RecencyIndex):
    """Any policy: entries plus a lazy min-heap of ``(priority, stamp, key)``.

    A touch that changes an entry's priority pushes a new item instead of moving the old one; an
    item is live while its stamp is its entry's ``stamp``. :meth:`victims` pops live items in
    order and pushes every one of them back, so choosing victims changes no membership.
    """

    def __init__(self, policy: EvictionPolicy | str = LRU) -> None:
        super().__init__(policy)
        self._priority = self.policy.priority
        self._entries: dict[bytes, Entry] = {}
        self._footprints: dict[bytes, int] = {}
        # Items are ``rank + (stamp, key)``: flat tuples of ints compare faster than nested ones.
        self._heap: list[_Item] = []
        self._seq = 0
        self._clock = 0

    def __contains__(self, key: object) -> bool:
        return key in self._footprints

    @property
    def members(self) -> Mapping[bytes, int]:
        """Read-only view: key -> footprint (for loops that cannot afford a call per key)."""
        return self._footprints

    def __len__(self) -> int:
        return len(self._footprints)

    def __iter__(self) -> Iterator[bytes]:
        # The heap's own order; maintenance loops only (persist), so a sort is fine.
        ranked = sorted((e.rank, e.stamp, k) for k, e in self._entries.items())
        return iter([key for _, _, key in ranked])

    def add(self, key: bytes, footprint: int) -> None:
        """Record ``key`` as just used; a key stored again keeps its hits and insertion time."""
        self._seq += 1
        entry = self._entries.get(key)
        if entry is None:
            entry = Entry(footprint, self._seq, self._seq, 0, self._clock)
            self._entries[key] = entry
        else:
            entry.footprint, entry.last_access, entry.clock = footprint, self._seq, self._clock
        self._footprints[key] = footprint
        self._push(key, entry)

    def touch(self, key: bytes) -> None:
        """Mark ``key`` as just used (one more hit); absent keys are ignored."""
        entry = self._entries.get(key)
        if entry is None:
            return
        self._seq += 1
        entry.last_access, entry.clock = self._seq, self._clock
        entry.hits += 1
        self._push(key, entry)

    def discard(self, key: bytes) -> None:
        """Forget ``key`` if present (its heap items go stale)."""
        if self._entries.pop(key, None) is not None:
            del self._footprints[key]
            if not self._entries:
                self._heap.clear()

    def victims(self, needed: int, exclude: Container[bytes] = ()) -> list[bytes] | None:
        """Lowest-priority keys (not in ``exclude``) worth ``needed`` bytes, or ``None``.

        On success the ageing clock (if the policy has one) advances to the last victim's value.
        """
        if needed <= 0:
            return []
        heap, entries = self._heap, self._entries
        popped: list[_Item] = []
        chosen: list[bytes] = []
        freed = 0
        last: Entry | None = None
        while heap and freed < needed:
            item = heapq.heappop(heap)
            stamp, key = cast(int, item[-2]), cast(bytes, item[-1])
            entry = entries.get(key)
            if entry is None or entry.stamp != stamp:
                continue  # stale: dropping it changes nothing
            popped.append(item)
            if key in exclude:
                continue
            chosen.append(key)
            freed += entry.footprint
            last = entry
        for item in popped:
            heapq.heappush(heap, item)
        if freed < needed:
            return None
        ages = self.policy.ages
        if ages is not None and last is not None:
            self._clock = max(self._clock, ages(last))
        return chosen

    def _push(self, key: bytes, entry: Entry) -> None:
        rank = self._priority(entry)
        if rank == entry.rank and entry.stamp:
            return  # its live item still ranks it right (fifo touches): no new item
        entry.rank, entry.stamp = rank, entry.last_access
        heap = self._heap
        item: _Item = (*rank, entry.stamp, key)
        heapq.heappush(heap, item)
        if len(heap) > _STALE_RATIO * len(self._entries) + _STALE_FLOOR:
            self._heap = [(*e.rank, e.stamp, k) for k, e in self._entries.items()]
            heapq.heapify(self._heap)
