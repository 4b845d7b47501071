"""``StoreCounters``: what the store counts, and the ``Stats`` report built from it."""

from __future__ import annotations

from collections import Counter
from typing import Any

from kvstore.store.index import BlockIndex
from kvstore.store.layout import TierStack

__all__ = ["StoreCounters"]


class StoreCounters:
    """Store-wide counters (``puts``, ``hits``...), and per tier its hits and evictions."""

    def __init__(self) -> None:
        self.values: Counter[str] = Counter()
        #: Blocks served, by the name of the tier that served them.
        self.tier_hits: Counter[str] = Counter()
        #: Blocks evicted, by the name of the tier they left.
        self.evictions: Counter[str] = Counter()

    def add(self, name: str, amount: int = 1) -> None:
        """Add ``amount`` to counter ``name`` (creating it, even at 0)."""
        self.values[name] += amount

    def report(self, stack: TierStack, index: BlockIndex) -> dict[str, Any]:
        """Per-tier usage and counters, plus store-wide counters (the ``Stats`` answer)."""
        tiers = {}
        for level, tier in enumerate(stack.tiers):
            entry = tier.stats()
            entry["hits"] = self.tier_hits[tier.name]
            entry["evictions"] = self.evictions[tier.name]
            entry["indexed_blocks"] = len(index.levels[level])
            tiers[tier.name] = entry
        return {"tiers": tiers, "counters": dict(self.values), "blocks": len(index)}
