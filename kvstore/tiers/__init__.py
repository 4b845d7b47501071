"""Storage tiers and the one place that builds the hierarchy from configuration.

Tiers, fastest first: ``hbm`` (:mod:`kvstore.tiers.hbm`, where CUDA exists and it is configured),
``dram`` (:mod:`kvstore.tiers.dram`), ``nvme`` (:mod:`kvstore.tiers.nvme`) and the cluster-wide
``redis`` (:mod:`kvstore.tiers.redis`). Each sits behind :class:`kvstore.tiers.base.Tier`.

:data:`TIERS` names each tier's factory, in hierarchy order; every factory has one shape,
``(config) -> Tier | None`` (``None`` where the configuration leaves it off), and
:func:`build_tiers` calls them in one loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvstore.config import Config
from kvstore.tiers.base import StoredBlock, Tier
from kvstore.tiers.dram import DramTier
from kvstore.tiers.nvme import NvmeTier
from kvstore.tiers.redis import RedisTier

__all__ = [
    "TIERS",
    "DramTier",
    "NvmeTier",
    "RedisTier",
    "StoredBlock",
    "Tier",
    "TierFactory",
    "build_tiers",
]

logger = logging.getLogger(__name__)

# Redis evicts by itself (TTL and maxmemory policy) and no node knows how full it is, so the
# store is told it is effectively unbounded.
_REDIS_CAPACITY = 2**62

#: Builds one tier from the whole configuration, or returns ``None`` where it is not enabled.
TierFactory = Callable[[Config], Tier | None]


def _hbm_tier(config: Config) -> Tier | None:
    """The hbm tier if configured and its device exists; a warning (and no tier) otherwise."""
    hbm = config.hbm
    if not hbm.capacity:
        return None
    if hbm.device.startswith("cuda"):
        try:
            import torch

            available = torch.cuda.is_available()
        except ImportError:
            available = False
        if not available:
            logger.warning("hbm.capacity is set but there is no CUDA device: hbm tier off")
            return None
    from kvstore.tiers.hbm import HbmTier

    return HbmTier(hbm.capacity, hbm.page_size, hbm.device)


def _dram_tier(config: Config) -> Tier | None:
    """The dram tier, if it has a capacity."""
    if not config.dram.capacity:
        return None
    dram = config.dram
    return DramTier(
        dram.capacity,
        dram.page_size,
        force_cuda_check=dram.force_cuda_check,
        verify_reads=dram.verify_reads,
        prefault=dram.prefault,
    )


def _nvme_tier(config: Config) -> Tier | None:
    """The nvme tier, if it has a path."""
    if not config.nvme.path:
        return None
    return NvmeTier(config.nvme.path, config.nvme.capacity, config.server.workers)


def _redis_tier(config: Config) -> Tier | None:
    """The shared tier, if it has a URL: the store writes through to it, never evicts there."""
    redis = config.redis
    # With cluster.shared_data = peers, Redis holds only the cluster index: no payload tier.
    if not redis.url or config.cluster.shared_data == "peers":
        return None
    return RedisTier(
        redis.url,
        capacity=_REDIS_CAPACITY,
        ttl_s=redis.ttl_s,
        key_prefix=redis.key_prefix,
        op_timeout_s=redis.op_timeout_s,
        op_timeout_max_s=redis.op_timeout_max_s,
        min_rate=redis.min_rate,
        max_connections=redis.max_connections,
        resend_queue_bytes=redis.resend_queue_bytes,
        resend_queue_blocks=redis.resend_queue_blocks,
    )


#: Every tier by name, fastest first (the order of the hierarchy); the shared tier is last.
TIERS: dict[str, TierFactory] = {
    "hbm": _hbm_tier,
    "dram": _dram_tier,
    "nvme": _nvme_tier,
    "redis": _redis_tier,
}


def build_tiers(config: Config) -> list[Tier]:
    """The enabled tiers, fastest first: a tier is enabled when it has capacity (and a path).

    Raises ``ValueError`` when no host tier (dram or nvme) is enabled: device and shared tiers
    only sit above and below one.
    """
    tiers = [tier for factory in TIERS.values() if (tier := factory(config)) is not None]
    if not any(not tier.device and not tier.shared for tier in tiers):
        raise ValueError("no tier is enabled: give dram a capacity or nvme a path")
    return tiers
