"""The store's placement and admission rules (``kvstore.policy``), on real tiers.

Chains age suffix first; ``nvme_admission="hit"`` keeps one-hit wonders off the disk;
``shared_write="back"`` sends a block to Redis (a real redis-server) only when it leaves the node.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from harness.redis_server import RedisServer
from harness.store_blocks import PAGE, key, payload

from kvstore.config import ConfigError, load_config
from kvstore.keys import Namespace
from kvstore.policy import Policy
from kvstore.store import TieredStore
from kvstore.tiers.dram import DramTier
from kvstore.tiers.nvme import NvmeTier
from kvstore.tiers.redis import RedisTier

NS = Namespace(model="policy-test").fingerprint()


def tiers_of(store: TieredStore, numbers: list[int]) -> list[str]:
    return store.lookup([key(n) for n in numbers], NS).tiers


# -- the rules themselves ------------------------------------------------------------------------


def test_policy_rejects_unknown_values() -> None:
    with pytest.raises(ValueError, match="shared_write"):
        Policy(shared_write="sometimes")
    with pytest.raises(ValueError, match="nvme_admission"):
        Policy(nvme_admission="maybe")


def test_admission_and_recency_order() -> None:
    assert Policy().admit_on_demotion(persistent_target=True, hits=0)
    picky = Policy(nvme_admission="hit")
    assert not picky.admit_on_demotion(persistent_target=True, hits=0)
    assert picky.admit_on_demotion(persistent_target=True, hits=1)
    assert picky.admit_on_demotion(persistent_target=False, hits=0)  # only disk writes are spared
    assert Policy.recency_order([b"a", b"b", b"c"]) == [b"c", b"b", b"a"]


def test_config_section(tmp_path: Path) -> None:
    path = tmp_path / "kvstore.toml"
    path.write_text('[policy]\nshared_write = "back"\nnvme_admission = "hit"\n')
    config = load_config(path, env={})
    assert (config.policy.shared_write, config.policy.nvme_admission) == ("back", "hit")
    env = {"KVSTORE_POLICY_NVME_ADMISSION": "sometimes"}
    with pytest.raises(ConfigError, match=r"policy\.nvme_admission"):
        load_config(env=env)


# -- chains age suffix first ---------------------------------------------------------------------


async def test_a_full_tier_evicts_the_suffix_of_a_chain_before_its_prefix() -> None:
    store = TieredStore([DramTier(3 * PAGE, page_size=PAGE)])
    chain = [0, 1, 2]
    await store.put([key(n) for n in chain], [payload(n) for n in chain], NS)
    await store.put([key(9)], [payload(9)], NS)
    # Plain LRU would have evicted key 0 and with it every hit of the chain.
    assert tiers_of(store, chain) == ["dram", "dram", ""]
    assert store.lookup([key(n) for n in chain], NS).hits == 2
    # A get of the chain ages it the same way: the prefix stays the most recent.
    await store.get([key(0), key(1)], NS)
    await store.put([key(10)], [payload(10)], NS)
    assert tiers_of(store, [0, 1, 9, 10]) == ["dram", "dram", "", "dram"]
    await store.close()


async def store_after_reads(eviction: str) -> TieredStore:
    """Three blocks in a three-page dram tier, block 0 read three times, then a fourth put."""
    store = TieredStore([DramTier(3 * PAGE, page_size=PAGE)], policy=Policy(eviction=eviction))
    for n in (0, 1, 2):
        await store.put([key(n)], [payload(n)], NS)
    for _ in range(3):
        await store.get([key(0)], NS)
    await store.get([key(1)], NS)
    await store.get([key(2)], NS)
    await store.put([key(3)], [payload(3)], NS)
    return store


@pytest.mark.parametrize(
    ("eviction", "evicted"),
    [
        ("lru", 0),  # least recently read, however often it was read before
        ("fifo", 0),  # stored first
        ("lfu-aging", 1),  # read least often (once, like 2, but earlier)
    ],
)
async def test_the_configured_eviction_policy_picks_the_victim(eviction: str, evicted: int) -> None:
    store = await store_after_reads(eviction)
    tiers = tiers_of(store, [0, 1, 2, 3])
    assert tiers[evicted] == ""
    assert tiers.count("dram") == 3
    await store.close()


# -- nvme admission --------------------------------------------------------------------------------


async def test_hit_admission_keeps_blocks_nobody_read_off_the_disk(tmp_path: Path) -> None:
    store = TieredStore(
        [DramTier(2 * PAGE, page_size=PAGE), NvmeTier(tmp_path / "nvme", 1024**2)],
        policy=Policy(nvme_admission="hit"),
    )
    for n in (1, 2):
        await store.put([key(n)], [payload(n)], NS)
    got = await store.get([key(1)], NS)  # 1 is read once; 2 never
    assert got[0].payload == payload(1)
    await store.put([key(3)], [payload(3)], NS)  # evicts 2 (LRU): refused by nvme
    await store.put([key(4)], [payload(4)], NS)  # evicts 1: it was read, so it is demoted
    assert tiers_of(store, [1, 2, 3, 4]) == ["nvme", "", "dram", "dram"]
    counters = store.stats()["counters"]
    assert counters["demotions_refused"] == 1
    assert counters["demotions"] == 1
    assert bytes((await store.get([key(1)], NS))[0].payload or b"") == payload(1)
    await store.close()


async def test_default_admission_demotes_everything(tmp_path: Path) -> None:
    store = TieredStore([DramTier(2 * PAGE, page_size=PAGE), NvmeTier(tmp_path / "nvme", 1024**2)])
    for n in (1, 2, 3, 4):
        await store.put([key(n)], [payload(n)], NS)
    assert tiers_of(store, [1, 2, 3, 4]) == ["nvme", "nvme", "dram", "dram"]
    await store.close()


# -- write-back to the shared tier -----------------------------------------------------------------


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
async def write_back_node(redis_server: RedisServer) -> AsyncIterator[TieredStore]:
    redis_server.client().flushall()
    shared = RedisTier(redis_server.url, capacity=1 << 40, op_timeout_s=0.5)
    store = TieredStore(
        [DramTier(2 * PAGE, page_size=PAGE), shared], policy=Policy(shared_write="back")
    )
    yield store
    await store.close()


async def test_write_back_sends_a_block_to_redis_only_when_it_leaves_the_node(
    write_back_node: TieredStore, redis_server: RedisServer
) -> None:
    store = write_back_node
    await store.put([key(1), key(2)], [payload(1), payload(2)], NS)
    await store.drain()
    assert redis_server.client().dbsize() == 0  # nothing written through
    await store.put([key(3)], [payload(3)], NS)  # the chain [1, 2] ages suffix first: 2 leaves
    await store.drain()
    assert redis_server.client().dbsize() == 1
    assert store.stats()["counters"]["written_back"] == 1
    assert tiers_of(store, [1, 2, 3]) == ["dram", "", "dram"]
    # The node reads its evicted block back from Redis, bit-identical.
    result = (await store.get([key(2)], NS))[0]
    assert (result.tier, bytes(result.payload or b"")) == ("redis", payload(2))
