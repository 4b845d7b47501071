"""Eviction policy: which blocks leave a tier when it needs room.

The policy only orders keys; it never touches bytes. Each tier gets one :class:`RecencyIndex`
(least recently used first). :meth:`RecencyIndex.victims` answers "which blocks must go to free
this many bytes" and, like every eviction decision here, either returns a complete answer or
``None`` having changed nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterator, Mapping

__all__ = ["RecencyIndex"]


class RecencyIndex:
    """The blocks one tier holds, with their footprints, least recently used first."""

    def __init__(self) -> None:
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
        """Least recently used keys whose footprints add up to at least ``needed`` bytes.

        Keys in ``exclude`` (pinned by a reader) are skipped. Returns ``None`` when even evicting
        every other block would not free enough.
        """
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
