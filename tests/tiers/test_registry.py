"""The tier registry (``kvstore.tiers.TIERS``) and ``build_tiers``: one factory shape, one loop."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from kvstore.config import Config, DramConfig, HbmConfig, NvmeConfig, RedisConfig
from kvstore.tiers import TIERS, DramTier, NvmeTier, RedisTier, Tier, build_tiers

MIB = 1024**2


def config(
    dram: int = 0, nvme: Path | None = None, redis: str = "", hbm_device: str = ""
) -> Config:
    return Config(
        hbm=HbmConfig(capacity=MIB if hbm_device else 0, device=hbm_device or "cuda"),
        dram=DramConfig(capacity=dram),
        nvme=NvmeConfig(path=str(nvme) if nvme else ""),
        redis=RedisConfig(url=redis),
    )


async def close(tiers: list[Tier]) -> None:
    for tier in tiers:
        await tier.close()


def test_every_tier_has_one_factory_shape_in_hierarchy_order() -> None:
    assert list(TIERS) == ["hbm", "dram", "nvme", "redis"]
    for factory in TIERS.values():
        assert list(inspect.signature(factory).parameters) == ["config"]
        assert factory(config()) is None  # nothing enabled: no tier, no error


async def test_build_tiers_builds_the_enabled_ones_fastest_first(tmp_path: Path) -> None:
    tiers = build_tiers(config(dram=4 * MIB, nvme=tmp_path / "nvme", redis="redis://127.0.0.1:1"))
    try:
        assert [tier.name for tier in tiers] == ["dram", "nvme", "redis"]
        assert [type(tier) for tier in tiers] == [DramTier, NvmeTier, RedisTier]
        assert tiers[0].capacity == 4 * MIB
        assert tiers[-1].shared and tiers[-1].capacity >= 2**62  # redis: effectively unbounded
    finally:
        await close(tiers)
    only_nvme = build_tiers(config(nvme=tmp_path / "nvme2"))
    assert [tier.name for tier in only_nvme] == ["nvme"]
    await close(only_nvme)


async def test_hbm_comes_first_where_its_device_exists() -> None:
    tiers = build_tiers(config(dram=4 * MIB, hbm_device="cpu"))
    assert [tier.name for tier in tiers] == ["hbm", "dram"]
    await close(tiers)


def test_no_host_tier_is_an_error() -> None:
    for cfg in (config(), config(redis="redis://127.0.0.1:1"), config(hbm_device="cpu")):
        with pytest.raises(ValueError, match="no tier is enabled"):
            build_tiers(cfg)
