"""``TieredStore`` with the shared ``redis`` tier, against a real redis-server.

Write-through, reads of blocks other nodes wrote, namespaces in the shared tier, and the rule that
the store never places blocks in (or evicts them from) the shared tier itself.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator

import pytest
from harness.redis_server import RedisServer
from harness.store_blocks import PAGE, key, payload

import kvstore.store.shared_writer as shared_writer_module
from kvstore.block import encode_header
from kvstore.keys import Namespace
from kvstore.protocol.rates import RATE_KEY
from kvstore.store import TieredStore
from kvstore.tiers.dram import DramLease, DramTier
from kvstore.tiers.redis import RedisTier

NS = Namespace(model="test-model").fingerprint()
OTHER_NS = Namespace(model="test-model", tenant="someone-else").fingerprint()


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server


def make_store(url: str, dram_pages: int = 4) -> TieredStore:
    shared = RedisTier(url, capacity=1 << 40, op_timeout_s=0.5, reconnect_backoff_s=(0.05, 0.4))
    return TieredStore([DramTier(dram_pages * PAGE, page_size=PAGE), shared])


@pytest.fixture
async def node(redis_server: RedisServer) -> AsyncIterator[TieredStore]:
    redis_server.client().flushall()
    store = make_store(redis_server.url)
    yield store
    await store.close()


@pytest.fixture
async def other_node(redis_server: RedisServer) -> AsyncIterator[TieredStore]:
    store = make_store(redis_server.url)
    yield store
    await store.close()


async def test_put_writes_through_and_another_node_reads_and_promotes(
    node: TieredStore, other_node: TieredStore
) -> None:
    await node.put([key(1), key(2)], [payload(1), payload(2)], NS)
    await node.drain()
    assert other_node.lookup([key(1), key(2)], NS).hits == 0  # not in its local index
    found = await other_node.lookup_shared([key(1), key(2), key(3)], NS)
    assert (found.hits, found.tiers) == (2, ["redis", "redis", ""])
    results = await other_node.get([key(1), key(2), key(3)], NS)
    assert [r.tier for r in results] == ["redis", "redis", ""]
    assert [bytes(r.payload) for r in results[:2] if r.payload is not None] == [
        payload(1),
        payload(2),
    ]
    await other_node.drain()
    assert other_node.lookup([key(1), key(2)], NS).tiers == ["dram", "dram"]
    assert other_node.stats()["tiers"]["redis"]["hits"] == 2


async def test_lookup_shared_continues_past_local_hits(
    node: TieredStore, other_node: TieredStore
) -> None:
    await node.put([key(1), key(2)], [payload(1), payload(2)], NS)
    await node.drain()
    await other_node.put([key(0)], [payload(0)], NS)
    found = await other_node.lookup_shared([key(0), key(1), key(2), key(9)], NS)
    assert (found.hits, found.tiers) == (3, ["dram", "redis", "redis", ""])


async def test_namespace_mismatch_in_the_shared_tier_is_a_miss(
    node: TieredStore, other_node: TieredStore
) -> None:
    await node.put([key(5)], [payload(5)], OTHER_NS)
    await node.drain()
    results = await other_node.get([key(5)], NS)
    assert not results[0].found
    await other_node.drain()
    assert other_node.lookup([key(5)], NS).tiers == [""]
    assert other_node.stats()["counters"]["namespace_mismatches"] == 1
    # The right namespace still reads it.
    assert (await other_node.get([key(5)], OTHER_NS))[0].payload == payload(5)


async def test_write_through_does_not_block_put(
    redis_server: RedisServer, node: TieredStore
) -> None:
    redis_server.pause()  # a stalled Redis: every command would wait for the op timeout
    try:
        start = time.monotonic()
        result = await node.put([key(1)], [payload(1)], NS)
        elapsed = time.monotonic() - start
        assert result.stored == 1
        assert elapsed < 0.2, f"put waited {elapsed:.2f} s on a stalled redis"
        assert (await node.get([key(1)], NS))[0].tier == "dram"
        await node.drain()  # the write-through gives up after its op timeout
        assert node.stats()["tiers"]["redis"]["writes_dropped"] == 1
    finally:
        redis_server.resume()


async def test_shared_tier_is_never_placed_into_or_evicted(
    redis_server: RedisServer, node: TieredStore
) -> None:
    numbers = range(10)  # dram holds 4: the rest are evicted from the store locally
    for n in numbers:
        await node.put([key(n)], [payload(n)], NS)
    await node.drain()
    stats = node.stats()
    assert stats["tiers"]["redis"]["evictions"] == 0
    assert stats["tiers"]["redis"]["indexed_blocks"] == 0
    assert stats["tiers"]["dram"]["evictions"] == 6
    assert node.lookup([key(n) for n in numbers], NS).tiers.count("dram") == 4
    client = redis_server.client()
    assert all(client.exists(b"kvstore:v1:" + key(n).hex().encode()) for n in numbers)
    # Evicted locally, still served from the shared copy.
    assert (await node.get([key(0)], NS))[0].tier == "redis"


async def test_delete_removes_the_shared_copy(node: TieredStore) -> None:
    await node.put([key(1)], [payload(1)], NS)
    await node.drain()
    assert await node.delete([key(1)], NS) == 1
    assert not (await node.get([key(1)], NS))[0].found


async def test_shared_block_with_wrong_header_key_is_dropped(
    redis_server: RedisServer, node: TieredStore
) -> None:
    # A value stored under key 7 whose header names key 8: verification rejects it.
    header = encode_header(key(8), NS, payload(8))
    redis_server.client().set(b"kvstore:v1:" + key(7).hex().encode(), header + payload(8))
    assert not (await node.get([key(7)], NS))[0].found  # counted before the read returns
    assert node.stats()["tiers"]["redis"]["corrupt_blocks"] == 1


def test_a_shared_tier_must_be_last(redis_server: RedisServer) -> None:
    shared = RedisTier(redis_server.url, capacity=1 << 40)
    with pytest.raises(ValueError, match="shared tier"):
        TieredStore([shared, DramTier(4 * PAGE, page_size=PAGE)])


async def test_write_through_backlog_is_bounded(
    redis_server: RedisServer, node: TieredStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Room for two blocks in flight: while Redis stalls, the third put's copy is not kept.
    monkeypatch.setattr(shared_writer_module, "_WRITE_THROUGH_BACKLOG_BYTES", 2 * PAGE)
    redis_server.pause()
    try:
        for n in range(3):
            assert (await node.put([key(20 + n)], [payload(20 + n)], NS)).stored == 1
        assert node.stats()["counters"]["write_through_dropped"] == 1
        await node.drain()
    finally:
        redis_server.resume()
    # Once the backlog has drained, write-through accepts blocks again.
    assert (await node.put([key(30)], [payload(30)], NS)).stored == 1
    assert node.stats()["counters"]["write_through_dropped"] == 1


async def test_reads_from_redis_are_timed_for_the_load_plan(
    node: TieredStore, other_node: TieredStore
) -> None:
    """What the vLLM connector weighs a Redis hit by: the store's measured Redis read rate, from
    gets and from the shared-memory path's leases (a promotion) alike."""
    await node.put([key(1), key(2), key(3)], [payload(1), payload(2), payload(3)], NS)
    await node.drain()
    assert other_node.stats()["tiers"]["redis"][RATE_KEY] == 0
    leased = await other_node.acquire([key(1), key(2)], NS)
    assert all(isinstance(item, DramLease) for item in leased)
    other_node.release([item for item in leased if isinstance(item, DramLease)])
    assert other_node.stats()["tiers"]["redis"][RATE_KEY] > 0
    assert (await other_node.get([key(3)], NS))[0].tier == "redis"
    assert other_node.stats()["tiers"]["redis"][RATE_KEY] > 0
