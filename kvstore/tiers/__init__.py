"""Storage tiers and the one place that builds the hierarchy from configuration.

Tiers, fastest first: ``hbm`` (:mod:`kvstore.tiers.hbm`, where CUDA exists and it is configured),
``dram`` (:mod:`kvstore.tiers.dram`), ``nvme`` (:mod:`kvstore.tiers.nvme`) and the cluster-wide
``redis`` (:mod:`kvstore.tiers.redis`). Each sits behind :class:`kvstore.tiers.base.Tier`.
"""

from __future__ import annotations

import logging

from kvstore.config import Config, HbmConfig
from kvstore.tiers.base import StoredBlock, Tier
from kvstore.tiers.dram import DramTier
from kvstore.tiers.nvme import NvmeTier
from kvstore.tiers.redis import RedisTier

__all__ = ["DramTier", "NvmeTier", "RedisTier", "StoredBlock", "Tier", "build_tiers"]

logger = logging.getLogger(__name__)

# Redis evicts by itself (TTL and maxmemory policy) and no node knows how full it is, so the
# store is told it is effectively unbounded.
_REDIS_CAPACITY = 2**62


def build_tiers(config: Config) -> list[Tier]:
    """The enabled tiers, fastest first: a tier is enabled when it has capacity (and a path)."""
    tiers: list[Tier] = []
    hbm = _hbm_tier(config.hbm)
    if hbm is not None:
        tiers.append(hbm)
    if config.dram.capacity:
        dram = config.dram
        tiers.append(
            DramTier(dram.capacity, dram.page_size, force_cuda_check=dram.force_cuda_check)
        )
    if config.nvme.path:
        tiers.append(NvmeTier(config.nvme.path, config.nvme.capacity, config.server.workers))
    if len(tiers) == (hbm is not None):
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


def _hbm_tier(config: HbmConfig) -> Tier | None:
    """The hbm tier if configured and its device exists; a warning (and no tier) otherwise."""
    if not config.capacity:
        return None
    if config.device.startswith("cuda"):
        try:
            import torch

            available = torch.cuda.is_available()
        except ImportError:
            available = False
        if not available:
            logger.warning("hbm.capacity is set but there is no CUDA device: hbm tier off")
            return None
    from kvstore.tiers.hbm import HbmTier

    return HbmTier(config.capacity, config.page_size, config.device)
