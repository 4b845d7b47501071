"""Retention per request (:mod:`kvstore.retention`) in every tier of a ``TieredStore``.

Real LMDB directories, a real redis-server, the hbm tier on a CPU tensor. The rule checked
everywhere: a flood of one-off blocks that evicts a plain block leaves a retained one where it is;
only a retained put that finds a tier full of retained blocks evicts one early (counted); a block
asked to stay in memory never reaches nvme or Redis; one asked not to be stored is stored nowhere.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from harness.redis_server import RedisServer
from harness.store_blocks import PAGE, key, make_store, payload
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import CollectorRegistry

from kvstore.errors import InvalidRequestError
from kvstore.keys import Namespace
from kvstore.policy import Policy
from kvstore.retention import KEEP, Retention
from kvstore.server.budget import InflightBudget
from kvstore.server.durations import Durations
from kvstore.server.metrics import StoreCollector
from kvstore.server.tenancy import Tenant, Tenants
from kvstore.store import TieredStore
from kvstore.store.prefetch import Prefetcher
from kvstore.tiers.dram import DramTier
from kvstore.tiers.hbm import HbmTier
from kvstore.tiers.nvme import NvmeTier
from kvstore.tiers.redis import RedisTier
from kvstore.types import PutResult

NS = Namespace(model="retention-test").fingerprint()
HOUR = Retention(3600)


async def put(
    store: TieredStore, numbers: range | list[int], retention: Retention = KEEP
) -> PutResult:
    return await store.put(
        [key(n) for n in numbers], [payload(n) for n in numbers], NS, retention=retention
    )


async def flood(store: TieredStore, start: int, count: int) -> None:
    """One-off blocks, each put once and never read (what evicts a plain prefix today)."""
    for n in range(start, start + count):
        await put(store, [n])


def tier_of(store: TieredStore, n: int) -> str | None:
    return store.tier_of(key(n))


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[TieredStore]:
    s = make_store(tmp_path / "nvme", dram_pages=4, nvme_capacity=256 * 1024)
    yield s
    await s.close()


async def test_flood_evicts_a_plain_prefix_but_not_a_retained_one(store: TieredStore) -> None:
    await put(store, [1, 2])
    await put(store, [3, 4], HOUR)
    await flood(store, 100, 200)  # far more than dram and nvme hold together
    assert tier_of(store, 1) is None and tier_of(store, 2) is None
    assert tier_of(store, 3) == "dram" and tier_of(store, 4) == "dram"
    got = await store.get([key(3), key(4)], NS)
    assert [bytes(g.payload or b"") for g in got] == [payload(3), payload(4)]
    dram = store.stats()["tiers"]["dram"]
    assert dram["retained_blocks"] == 2 and dram["retained_bytes"] == 2 * PAGE
    assert dram["retained_evicted_early"] == 0


async def test_retention_runs_out(store: TieredStore) -> None:
    await put(store, [1], Retention(0.2))
    deadline = time.monotonic() + 10
    while store.stats()["tiers"]["dram"]["retained_blocks"] and time.monotonic() < deadline:
        await asyncio.sleep(0.02)  # polling for the window to close (no read: no refresh)
    assert store.stats()["tiers"]["dram"]["retained_blocks"] == 0
    await flood(store, 100, 200)
    assert tier_of(store, 1) is None


async def test_a_read_starts_the_window_again(store: TieredStore) -> None:
    await put(store, [1], Retention(0.5))
    until = store._index.retained_until(key(1))
    await asyncio.sleep(0.01)  # sleep: time passes, so the read's new window ends later
    await store.get([key(1)], NS)
    assert store._index.retained_until(key(1)) > until


async def test_a_put_of_stored_blocks_retains_them(store: TieredStore) -> None:
    await put(store, [1])
    result = await put(store, [1], HOUR)
    assert result.already_present == 1
    await flood(store, 100, 200)
    assert tier_of(store, 1) == "dram"


async def test_quota_full_of_retained_blocks_evicts_early_counted(store: TieredStore) -> None:
    await put(store, range(1, 5), Retention(100))  # the whole arena, retained
    await put(store, [5])  # a plain put finds no room in dram: it goes to nvme
    assert tier_of(store, 5) == "nvme"
    assert all(tier_of(store, n) == "dram" for n in range(1, 5))
    await put(store, [6], Retention(200))  # a retained one evicts the soonest-expiring
    assert tier_of(store, 6) == "dram"
    assert tier_of(store, 1) == "nvme"  # demoted, still retained there
    await store.drain()  # each retained put copies its blocks to nvme in the background
    stats = store.stats()["tiers"]
    assert stats["dram"]["retained_evicted_early"] == 1
    assert stats["nvme"]["retained_blocks"] == 5  # a copy on disk of every retained block
    await flood(store, 100, 200)
    assert tier_of(store, 1) == "nvme"


async def test_nvme_keeps_retained_blocks_through_a_flood(tmp_path: Path) -> None:
    store = TieredStore([NvmeTier(tmp_path / "nvme", 256 * 1024)])
    try:
        await put(store, [1])
        await put(store, [2], HOUR)
        await flood(store, 100, 200)
        assert tier_of(store, 1) is None
        assert tier_of(store, 2) == "nvme"
        nvme = store.stats()["tiers"]["nvme"]
        assert nvme["retained_blocks"] == 1 and nvme["evictions"] > 100
    finally:
        await store.close()


async def test_hbm_keeps_retained_blocks_through_a_flood_of_hot_ones(tmp_path: Path) -> None:
    store = TieredStore(
        [
            HbmTier(2 * PAGE, page_size=PAGE, device="cpu"),
            DramTier(8 * PAGE, page_size=PAGE),
            NvmeTier(tmp_path / "nvme", 1024**2),
        ]
    )
    try:
        await put(store, [1], HOUR)
        for _ in range(2):  # read twice: promoted into hbm
            await store.get([key(1)], NS)
            await store.drain()
        assert tier_of(store, 1) == "hbm"
        for n in range(100, 110):  # hot blocks that would take hbm over
            await put(store, [n])
            for _ in range(2):
                await store.get([key(n)], NS)
                await store.drain()
        assert tier_of(store, 1) == "hbm"
        assert store.stats()["tiers"]["hbm"]["retained_blocks"] == 1
    finally:
        await store.close()


async def test_fast_only_never_reaches_nvme(store: TieredStore) -> None:
    await put(store, [1, 2], Retention(tiers="fast"))
    await flood(store, 100, 200)
    assert tier_of(store, 1) is None and tier_of(store, 2) is None
    assert store.stats()["counters"]["fast_only_dropped"] == 2


async def test_fast_only_is_not_persisted_at_shutdown(store: TieredStore) -> None:
    await put(store, [1], Retention(tiers="fast"))
    await put(store, [2])
    assert await store.persist(5.0) == 1
    assert tier_of(store, 1) == "dram" and key(1) not in store._index.levels[1]


async def test_fast_only_put_with_a_full_arena_is_dropped_not_written_to_nvme(
    store: TieredStore,
) -> None:
    await put(store, range(1, 5), HOUR)
    result = await put(store, [9], Retention(tiers="fast"))
    assert result.dropped == 1 and tier_of(store, 9) is None


async def test_not_stored_is_stored_nowhere(store: TieredStore) -> None:
    result = await put(store, [1, 2], Retention(tiers="none"))
    assert (result.stored, result.already_present, result.dropped) == (0, 0, 0)
    assert store.lookup([key(1), key(2)], NS).hits == 0
    assert store.stats()["counters"]["put_not_stored"] == 1
    assert store.stats()["blocks"] == 0


async def test_retention_over_the_maximum_is_refused_naming_the_setting(tmp_path: Path) -> None:
    store = make_store(tmp_path / "nvme", policy=Policy(max_retention_s=60))
    try:
        with pytest.raises(InvalidRequestError, match=r"policy\.max_retention_s"):
            await put(store, [1], Retention(61))
        assert store.lookup([key(1)], NS).hits == 0
        await put(store, [1], Retention(60))
    finally:
        await store.close()


def test_retention_values_are_checked() -> None:
    with pytest.raises(InvalidRequestError, match="'all', 'fast', 'none'"):
        Retention(tiers="slow")
    with pytest.raises(InvalidRequestError, match=">= 0"):
        Retention(-1)
    with pytest.raises(InvalidRequestError, match="finite"):
        Retention(float("nan"))


# -- the shared tier -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
async def shared(redis_server: RedisServer) -> AsyncIterator[TieredStore]:
    redis_server.client().flushall()
    tier = RedisTier(redis_server.url, capacity=1 << 40, ttl_s=60)
    s = TieredStore([DramTier(4 * PAGE, page_size=PAGE), tier])
    yield s
    await s.close()


def redis_name(n: int) -> bytes:
    return b"kvstore:v1:" + key(n).hex().encode()


async def test_redis_ttl_covers_the_retention(shared: TieredStore, redis_server: RedisServer):
    await put(shared, [1])
    await put(shared, [2], Retention(600))
    await shared.drain()
    client = redis_server.client()
    assert 0 < client.pttl(redis_name(1)) <= 60_000
    assert 60_000 < client.pttl(redis_name(2)) <= 600_000
    assert shared.stats()["tiers"]["redis"]["retained_blocks_written"] == 1


async def test_fast_only_and_not_stored_never_reach_redis(
    shared: TieredStore, redis_server: RedisServer
) -> None:
    await put(shared, [1], Retention(600, tiers="fast"))
    await put(shared, [2], Retention(tiers="none"))
    await shared.drain()
    client = redis_server.client()
    assert client.exists(redis_name(1)) == 0 and client.exists(redis_name(2)) == 0
    assert tier_of(shared, 1) == "dram"


async def test_metrics_export_retained_blocks_and_early_evictions(store: TieredStore) -> None:
    await put(store, range(1, 5), Retention(100))
    await put(store, [6], Retention(200))  # evicts block 1 early
    tenants = Tenants.single(Tenant("", store, Prefetcher(store), InflightBudget(1 << 20)))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(tenants, "9.9", Durations()))
    text = generate_latest(registry).decode()
    assert 'kvstore_tier_retained_blocks{tenant="",tier="dram"} 4.0' in text
    assert f'kvstore_tier_retained_bytes{{tenant="",tier="dram"}} {4.0 * PAGE}' in text
    assert 'kvstore_tier_retained_evicted_early_total{tenant="",tier="dram"} 1.0' in text
    assert 'kvstore_tier_retained_blocks{tenant="",tier="nvme"} 1.0' in text


async def test_a_retained_put_of_a_stored_block_lengthens_its_redis_ttl(
    shared: TieredStore, redis_server: RedisServer
) -> None:
    await put(shared, [3])  # plain: the tier's TTL
    await shared.drain()
    client = redis_server.client()
    assert 0 < client.pttl(redis_name(3)) <= 60_000
    result = await put(shared, [3], Retention(900))  # found stored: nothing written again
    assert (result.stored, result.already_present) == (0, 1)
    await shared.drain()
    assert 600_000 < client.pttl(redis_name(3)) <= 900_000
    assert shared.stats()["tiers"]["redis"]["retained_blocks_extended"] == 1
    # A shorter retention later never shortens it.
    await put(shared, [3], Retention(120))
    await shared.drain()
    assert client.pttl(redis_name(3)) > 600_000
