"""Storage tiers and the one place that builds the hierarchy from configuration.

Tiers, fastest first: ``dram`` (:mod:`kvstore.tiers.dram`), ``nvme`` (:mod:`kvstore.tiers.nvme`)
and the cluster-wide ``redis`` (:mod:`kvstore.tiers.redis`). Each sits behind
:class:`kvstore.tiers.base.Tier`.
"""

from __future__ import annotations

from kvstore.config import Config
from kvstore.tiers.base import StoredBlock, Tier
from kvstore.tiers.dram import DramTier
from kvstore.tiers.nvme import NvmeTier
from kvstore.tiers.redis import RedisTier

__all__ = ["DramTier", "NvmeTier", "RedisTier", "StoredBlock", "Tier", "build_tiers"]

# Redis evicts by itself (TTL and maxmemory policy) and no node knows how full it is, so the
# store is told it is effectively unbounded.
_REDIS_CAPACITY = 2**62


def build_tiers(config: Config) -> list[Tier]:
    """The enabled tiers, fastest first: a tier is enabled when it has capacity (and a path)."""
    tiers: list[Tier] = []
    if config.dram.capacity:
        tiers.append(DramTier(config.dram.capacity, config.dram.page_size))
    if config.nvme.path:
        tiers.append(NvmeTier(config.nvme.path, config.nvme.capacity, config.server.workers))
    if not tiers:
        raise ValueError("no tier is enabled: give dram a capacity or nvme a path")
    if config.redis.url:
        # Last, and shared: the store writes through to it and never places or evicts there.
        tiers.append(
            RedisTier(
                config.redis.url,
                capacity=_REDIS_CAPACITY,
                ttl_s=config.redis.ttl_s,
                key_prefix=config.redis.key_prefix,
                op_timeout_s=config.redis.op_timeout_s,
            )
        )
    return tiers
