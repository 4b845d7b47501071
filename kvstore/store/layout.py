"""``TierStack``: the store's tiers in order, and which level plays which part.

Tiers are ordered fastest first. Device tiers (``hbm``) come first and take only promotions; the
first host tier after them is where new blocks start (and the arena co-located clients map); the
local tiers end at the shared tier (``redis``), which, when present, is the only one and last.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.tiers.base import SharedTier, Tier

__all__ = ["TierStack"]


class TierStack:
    """The ordered tiers of one store, checked once, with the levels every part asks about."""

    __slots__ = ("host_level", "local_levels", "shared_level", "tiers")

    def __init__(self, tiers: Sequence[Tier]) -> None:
        if not tiers:
            raise ValueError("a TieredStore needs at least one tier")
        self.tiers = list(tiers)
        odd = [tier.name for tier in self.tiers if tier.shared != isinstance(tier, SharedTier)]
        if odd:
            raise ValueError(f"tiers {odd}: a shared tier must be a SharedTier, and only one is")
        shared = [level for level, tier in enumerate(self.tiers) if tier.shared]
        if shared and (len(shared) > 1 or shared[0] != len(self.tiers) - 1 or len(tiers) == 1):
            raise ValueError("a shared tier must be the only one, last, below a local tier")
        #: Level of the shared tier, or None; local tiers are the levels above it.
        self.shared_level: int | None = shared[0] if shared else None
        self.local_levels = len(self.tiers) - len(shared)
        devices = [level for level, tier in enumerate(self.tiers) if tier.device]
        if devices != list(range(len(devices))) or len(devices) >= self.local_levels:
            raise ValueError("device tiers (hbm) must come first, above at least one host tier")
        #: The first host-memory tier: new blocks start here (device tiers above it only take
        #: promotions), and it is the arena co-located clients map and prefetch fills.
        self.host_level = len(devices)

    def __len__(self) -> int:
        return len(self.tiers)

    def __getitem__(self, level: int) -> Tier:
        return self.tiers[level]

    @property
    def local(self) -> list[Tier]:
        """The tiers the store places blocks in (all but the shared one)."""
        return self.tiers[: self.local_levels]

    @property
    def shared(self) -> SharedTier | None:
        """The shared tier, if any: the one :class:`SharedTier`, with the batch calls beyond
        ``Tier`` that lookups and write-through need, whatever its backend."""
        if self.shared_level is None:
            return None
        tier = self.tiers[self.shared_level]
        assert isinstance(tier, SharedTier)  # checked in __init__
        return tier
