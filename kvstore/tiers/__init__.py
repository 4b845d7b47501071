"""Storage tiers and the one place that builds the hierarchy from configuration.

Tiers, fastest first: ``dram`` (:mod:`kvstore.tiers.dram`) and ``nvme``
(:mod:`kvstore.tiers.nvme`). Each sits behind :class:`kvstore.tiers.base.Tier`.
"""

from __future__ import annotations

from kvstore.config import Config
from kvstore.tiers.base import StoredBlock, Tier
from kvstore.tiers.dram import DramTier
from kvstore.tiers.nvme import NvmeTier

__all__ = ["DramTier", "NvmeTier", "StoredBlock", "Tier", "build_tiers"]


def build_tiers(config: Config) -> list[Tier]:
    """The enabled tiers, fastest first: a tier is enabled when it has capacity (and a path)."""
    tiers: list[Tier] = []
    if config.dram.capacity:
        tiers.append(DramTier(config.dram.capacity, config.dram.page_size))
    if config.nvme.path:
        tiers.append(NvmeTier(config.nvme.path, config.nvme.capacity, config.server.workers))
    if not tiers:
        raise ValueError("no tier is enabled: give dram a capacity or nvme a path")
    return tiers
