"""The ``redis`` tier against a real redis-server: data path, sharing between nodes, outages.

Redis Cluster is not started here (a six-node cluster takes too long to bring up in a unit test);
cluster mode is only checked to build the right client and to fail soft against a non-cluster
server.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator, Awaitable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
from harness.ports import free_port
from harness.redis_server import RedisServer
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from kvstore.block import HEADER_BYTES, BlockHeader
from kvstore.tiers.redis import RedisTier

T = TypeVar("T")
NAMESPACE = bytes(range(16))
OP_TIMEOUT = 0.3
# Scheduling and connection set-up on a loaded 2-core CI box, on top of the op timeout.
SLACK = 0.3
BACKOFF = (0.05, 0.4)


def key(n: int) -> bytes:
    return hashlib.blake2b(n.to_bytes(8, "little"), digest_size=16).digest()


def block(n: int, size: int = 1000) -> tuple[BlockHeader, bytes]:
    payload = (n.to_bytes(4, "little") * (size // 4 + 1))[:size]
    return BlockHeader.for_payload(key(n), NAMESPACE, payload), payload


def make_tier(url: str, **options: object) -> RedisTier:
    settings: dict[str, object] = {
        "capacity": 1 << 30,
        "op_timeout_s": OP_TIMEOUT,
        "reconnect_backoff_s": BACKOFF,
    }
    settings.update(options)
    return RedisTier(url, **settings)  # type: ignore[arg-type]


async def timed(awaitable: Awaitable[T]) -> tuple[T, float]:
    start = time.monotonic()
    result = await awaitable
    return result, time.monotonic() - start


async def wait_until_up(tier: RedisTier, within: float = 5.0) -> float:
    start = time.monotonic()
    while not tier.up:
        assert time.monotonic() - start < within, f"tier still down after {within} s"
        await asyncio.sleep(0.02)
    return time.monotonic() - start


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path / "redis") as running:
        yield running


@pytest.fixture
async def tier(server: RedisServer) -> AsyncIterator[RedisTier]:
    created = make_tier(server.url)
    yield created
    await created.close()


async def test_round_trip(tier: RedisTier) -> None:
    header, payload = block(1)
    assert await tier.write(header, payload)
    [stored] = await tier.read([header.key])
    assert stored is not None
    assert stored.header == header
    assert bytes(stored.payload) == payload
    stats = tier.stats()
    assert stats["blocks_written"] == 1
    assert stats["used"] == tier.footprint(len(payload)) == HEADER_BYTES + len(payload)
    assert stats["up"] == 1


async def test_batch_read_keeps_order_with_misses(tier: RedisTier) -> None:
    blocks = [block(n, size=100 + n) for n in range(4)]
    assert await tier.write_many([blocks[0], blocks[2]]) == [True, True]
    got = await tier.read([key(0), key(1), key(2), key(3), key(0)])
    assert [None if b is None else bytes(b.payload) for b in got] == [
        blocks[0][1],
        None,
        blocks[2][1],
        None,
        blocks[0][1],
    ]
    assert await tier.read([]) == []


async def test_write_many_and_exists(tier: RedisTier) -> None:
    items = [block(n) for n in range(10)]
    assert await tier.write_many(items) == [True] * 10
    assert await tier.exists([key(0), key(99), key(9)]) == [True, False, True]
    assert tier.stats()["blocks"] == 10


async def test_ttl_is_applied(server: RedisServer) -> None:
    expiring = make_tier(server.url, ttl_s=120)
    forever = make_tier(server.url, ttl_s=None, key_prefix="other:")
    try:
        assert await expiring.write(*block(1))
        assert await forever.write(*block(1))
        raw = server.client()
        assert 110 < raw.pttl(b"kvstore:v1:" + key(1).hex().encode()) / 1000 <= 120
        assert raw.ttl(b"other:" + key(1).hex().encode()) == -1  # exists, no expiry
    finally:
        await expiring.close()
        await forever.close()


async def test_a_node_forgets_the_blocks_redis_expired(server: RedisServer) -> None:
    # Redis drops a block after its TTL and tells no one: the node's ledger of what it wrote
    # must forget it too, or a node writing through for months records every block it ever
    # wrote (issue 41's soak). A retained block (a longer TTL, or one lengthened) stays.
    tier = make_tier(server.url, ttl_s=0.3)
    try:
        assert await tier.write_many([block(n) for n in range(5)]) == [True] * 5
        assert await tier.write_many([block(9)], ttl_s=60) == [True]
        assert await tier.write(*block(8))
        assert await tier.extend([key(8)], 60) == 1
        assert tier.stats()["blocks"] == 7
        deadline = time.monotonic() + 10
        while tier.stats()["blocks"] > 2:
            assert time.monotonic() < deadline, tier.stats()
            await asyncio.sleep(0.05)
        assert tier.used == 2 * tier.footprint(1000)
        assert await tier.exists([key(0), key(8), key(9)]) == [False, True, True]
    finally:
        await tier.close()


async def test_corrupt_values_are_misses_deleted_and_counted(
    tier: RedisTier, server: RedisServer
) -> None:
    raw = server.client()

    def raw_get(name: bytes) -> bytes:
        value = raw.get(name)
        assert isinstance(value, bytes)
        return value

    for n in range(3):
        assert await tier.write(*block(n))
    name = [b"kvstore:v1:" + key(n).hex().encode() for n in range(4)]
    flipped = bytearray(raw_get(name[0]))
    flipped[-1] ^= 0x01  # one flipped payload bit
    raw.set(name[0], bytes(flipped))
    raw.set(name[1], raw_get(name[2]))  # a valid block, but of another key
    raw.set(name[2], raw_get(name[2])[: HEADER_BYTES + 10])  # truncated
    raw.set(name[3], b"not a block")
    assert await tier.read([key(n) for n in range(4)]) == [None] * 4
    assert raw.exists(*name) == 0
    assert tier.stats()["corrupt_blocks"] == 4


async def test_two_nodes_see_each_others_blocks(server: RedisServer) -> None:
    node1, node2 = make_tier(server.url), make_tier(server.url)
    try:
        header, payload = block(7)
        assert await node1.write(header, payload)
        assert await node2.exists([header.key]) == [True]
        [seen] = await node2.read([header.key])
        assert seen is not None and bytes(seen.payload) == payload
        await node2.remove([header.key])
        assert await node1.read([header.key]) == [None]
        # node1 saw its block disappear and stopped counting it
        assert node1.used == 0
    finally:
        await node1.close()
        await node2.close()


async def test_remove_and_accounting(tier: RedisTier) -> None:
    assert await tier.write_many([block(1), block(2)]) == [True, True]
    await tier.remove([key(1), key(42)])  # an absent key is ignored
    gone, kept = await tier.read([key(1), key(2)])
    assert gone is None and kept is not None
    assert tier.used == tier.footprint(1000)
    assert list(tier.scan()) == []


async def assert_down_and_fast(tier: RedisTier, bound: float) -> None:
    """Every call returns a miss / drop within ``bound`` seconds and nothing raises."""
    reads, elapsed = await timed(tier.read([key(1), key(2)]))
    assert reads == [None, None] and elapsed < bound, elapsed
    stored, elapsed = await timed(tier.write(*block(3)))
    assert not stored and elapsed < bound, elapsed
    present, elapsed = await timed(tier.exists([key(1)]))
    assert present == [False] and elapsed < bound, elapsed
    _, elapsed = await timed(tier.remove([key(1)]))
    assert elapsed < bound, elapsed
    assert not tier.up and tier.stats()["up"] == 0


async def test_killed_redis_is_an_outage_then_recovers(
    tier: RedisTier, server: RedisServer
) -> None:
    assert await tier.write(*block(1))
    server.kill()
    # The first call finds out (reset or refused connection), bounded by the timeout.
    [got], elapsed = await timed(tier.read([key(1)]))
    assert got is None and elapsed < OP_TIMEOUT + SLACK, elapsed
    # Once down, no call touches the network.
    await assert_down_and_fast(tier, bound=0.05)
    stats = tier.stats()
    assert stats["outages"] == 1 and stats["writes_dropped"] >= 1 and stats["read_errors"] == 1
    server.restart()
    await wait_until_up(tier)
    assert tier.stats()["outages"] == 1
    header, payload = block(5)
    assert await tier.write(header, payload)
    [back] = await tier.read([header.key])
    assert back is not None and bytes(back.payload) == payload


async def test_stalled_redis_bounds_every_call(tier: RedisTier, server: RedisServer) -> None:
    header, payload = block(1)
    assert await tier.write(header, payload)
    server.pause()
    try:
        # Concurrent calls that all hit the stall: each one is bounded by the op timeout.
        started = time.monotonic()
        results = await asyncio.gather(
            tier.read([key(1)]), tier.write(*block(2)), tier.exists([key(1)]), tier.read([key(3)])
        )
        assert time.monotonic() - started < OP_TIMEOUT + SLACK
        assert list(results) == [[None], False, [False], [None]]
        assert tier.stats()["outages"] == 1
        await assert_down_and_fast(tier, bound=0.05)
        # Reconnect attempts against a stalled server keep failing: still down.
        await asyncio.sleep(3 * OP_TIMEOUT)  # sleep: time for several reconnect attempts
        assert not tier.up
    finally:
        server.resume()
    await wait_until_up(tier)
    [back] = await tier.read([header.key])  # a stall loses no data
    assert back is not None and bytes(back.payload) == payload


async def test_redis_down_at_start_never_raises(tmp_path: Path) -> None:
    port = free_port()
    tier = make_tier(f"redis://127.0.0.1:{port}/0")
    try:
        [got], elapsed = await timed(tier.read([key(1)]))
        assert got is None and elapsed < OP_TIMEOUT + SLACK
        await assert_down_and_fast(tier, bound=0.05)
        with RedisServer(tmp_path, port=port):
            await wait_until_up(tier)
            assert await tier.write(*block(1))
    finally:
        await tier.close()
    assert tier._link._reconnect_task is None


async def test_close_while_down_stops_reconnecting(tmp_path: Path) -> None:
    tier = make_tier(f"redis://127.0.0.1:{free_port()}/0")
    await tier.read([key(1)])
    task = tier._link._reconnect_task
    assert task is not None and not task.done()
    await tier.close()
    assert task.done()
    assert await tier.read([key(1)]) == [None]


def test_url_selects_single_server_or_cluster() -> None:
    # Construction is lazy: no server needs to listen.
    assert isinstance(RedisTier("redis://127.0.0.1:1/2", capacity=1)._link._client, Redis)
    cluster = RedisTier("redis+cluster://127.0.0.1:7000", capacity=1)._link._client
    assert isinstance(cluster, RedisCluster)
    assert list(cluster.nodes_manager.startup_nodes) == ["127.0.0.1:7000"]
    with pytest.raises(ValueError, match="redis\\+cluster://"):
        RedisTier("http://127.0.0.1:6379", capacity=1)
    with pytest.raises(ValueError, match="op_timeout_s"):
        RedisTier("redis://127.0.0.1", capacity=1, op_timeout_s=0)
    with pytest.raises(ValueError, match="reconnect_backoff_s"):
        RedisTier("redis://127.0.0.1", capacity=1, reconnect_backoff_s=(2.0, 1.0))


async def test_cluster_url_against_a_plain_server_fails_soft(server: RedisServer) -> None:
    tier = make_tier(f"redis+cluster://127.0.0.1:{server.port}")
    try:
        [got], elapsed = await timed(tier.read([key(1)]))
        assert got is None and elapsed < OP_TIMEOUT + SLACK
        assert not await tier.write(*block(1))
        assert not tier.up
    finally:
        await tier.close()
