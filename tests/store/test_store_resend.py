"""Write-throughs Redis refuses: the bounded re-send queue, against a real redis-server that is
killed and restarted on the same port (empty, as a crashed non-persistent Redis comes back).

Every acknowledged put is afterwards either in Redis (re-sent) or counted as not shared
(``write_through_dropped``): never silently lost.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
from harness.redis_server import RedisServer
from harness.store_blocks import PAGE, key, payload

from kvstore.keys import Namespace
from kvstore.store import TieredStore
from kvstore.tiers.dram import DramTier
from kvstore.tiers.redis import RedisTier

NS = Namespace(model="test-model").fingerprint()
OTHER_NS = Namespace(model="test-model", tenant="someone-else").fingerprint()
# Generous for a loaded 2-core box: Redis restarts, backoff (capped at 0.4 s), a re-send.
WITHIN_S = 20.0


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path / "redis") as server:
        yield server


def make_store(url: str, dram_pages: int = 64, **queue: int) -> TieredStore:
    shared = RedisTier(
        url, capacity=1 << 40, op_timeout_s=0.5, reconnect_backoff_s=(0.05, 0.4), **queue
    )
    return TieredStore([DramTier(dram_pages * PAGE, page_size=PAGE), shared])


@pytest.fixture
async def node(redis_server: RedisServer) -> AsyncIterator[TieredStore]:
    store = make_store(redis_server.url)
    yield store
    await store.close()


async def poll(condition: Callable[[], bool], what: str, within: float = WITHIN_S) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {within} s"
        await asyncio.sleep(0.05)


def in_redis(server: RedisServer, numbers: range | list[int]) -> list[bool]:
    with server.client() as client:
        return [bool(client.exists(b"kvstore:v1:" + key(n).hex().encode())) for n in numbers]


def counters(store: TieredStore) -> dict[str, int]:
    return dict(store.stats()["counters"])


async def put_while_down(store: TieredStore, server: RedisServer, numbers: range) -> None:
    """Kill Redis, put ``numbers`` (acknowledged at once), wait for their copies to be refused."""
    server.kill()
    for n in numbers:
        assert (await store.put([key(n)], [payload(n)], NS)).stored == 1
    await store.drain()


async def test_refused_write_throughs_are_sent_again_when_redis_returns(
    redis_server: RedisServer, node: TieredStore
) -> None:
    await put_while_down(node, redis_server, range(8))
    assert node.shared_writer.queued_blocks == 8
    assert node.shared_writer.queued_bytes == 8 * PAGE
    assert counters(node)["write_through_queued"] == 8
    redis_server.start()
    await poll(lambda: node.shared_writer.queued_blocks == 0, "the queue drained")
    assert in_redis(redis_server, range(8)) == [True] * 8
    seen = counters(node)
    assert seen["write_through_resent"] == 8 and seen["write_through_dropped"] == 0
    # Another node reads them, bytes intact (the MAC is checked on the way in).
    other = make_store(redis_server.url)
    try:
        got = await other.get([key(n) for n in range(8)], NS)
        assert [result.payload for result in got] == [payload(n) for n in range(8)]
    finally:
        await other.close()


@pytest.mark.parametrize(
    ("bound", "kept"), [({"resend_queue_blocks": 3}, 3), ({"resend_queue_bytes": 5 * PAGE}, 5)]
)
async def test_the_queue_is_bounded_and_what_overflows_is_counted_not_shared(
    redis_server: RedisServer, bound: dict[str, int], kept: int
) -> None:
    store = make_store(redis_server.url, **bound)
    try:
        await put_while_down(store, redis_server, range(8))
        assert store.shared_writer.queued_blocks == kept
        assert counters(store)["write_through_dropped"] == 8 - kept
        redis_server.start()
        await poll(lambda: store.shared_writer.queued_blocks == 0, "the queue drained")
        # The oldest refusals were kept; every acknowledged put is shared or counted.
        assert in_redis(redis_server, range(8)) == [True] * kept + [False] * (8 - kept)
        seen = counters(store)
        assert seen["write_through_resent"] + seen["write_through_dropped"] == 8
        # Room again: a new refusal is queued, not dropped.
        redis_server.kill()
        assert (await store.put([key(50)], [payload(50)], NS)).stored == 1
        await store.drain()
        assert store.shared_writer.queued_blocks == 1
    finally:
        await store.close()
    # Closing with copies still queued counts them as not shared.
    assert counters(store)["write_through_dropped"] == 8 - kept + 1


async def test_no_queue_means_every_refusal_is_counted(redis_server: RedisServer) -> None:
    store = make_store(redis_server.url, resend_queue_blocks=0)
    try:
        await put_while_down(store, redis_server, range(3))
        assert store.shared_writer.queued_blocks == 0
        assert counters(store)["write_through_dropped"] == 3
    finally:
        await store.close()


async def test_a_delete_drops_the_queued_copy(redis_server: RedisServer, node: TieredStore) -> None:
    await put_while_down(node, redis_server, range(3))
    assert await node.delete([key(1)], NS) == 1
    assert node.shared_writer.queued_blocks == 2
    redis_server.start()
    await poll(lambda: node.shared_writer.queued_blocks == 0, "the queue drained")
    # The deleted block is not brought back by a re-send.
    assert in_redis(redis_server, range(3)) == [True, False, True]


async def test_a_stalled_redis_queues_and_puts_never_wait(
    redis_server: RedisServer, node: TieredStore
) -> None:
    redis_server.pause()  # every command would wait: the op timeout refuses them
    try:
        start = time.monotonic()
        for n in range(4):
            assert (await node.put([key(n)], [payload(n)], NS)).stored == 1
        assert time.monotonic() - start < 0.5
        await poll(lambda: node.shared_writer.queued_blocks == 4, "the copies queued")
    finally:
        redis_server.resume()
    await poll(lambda: node.shared_writer.queued_blocks == 0, "the queue drained")
    assert in_redis(redis_server, range(4)) == [True] * 4
    assert counters(node)["write_through_dropped"] == 0


async def test_a_key_put_again_replaces_its_queued_copy(redis_server: RedisServer) -> None:
    store = make_store(redis_server.url, dram_pages=1)
    try:
        redis_server.kill()
        assert (await store.put([key(1)], [payload(1)], NS)).stored == 1
        # Key 2 takes the only page: key 1 leaves this node, its copy still queued.
        assert (await store.put([key(2)], [payload(2)], NS)).stored == 1
        await store.drain()
        # Put again, under another namespace: the newer block replaces the queued one.
        assert (await store.put([key(1)], [payload(1)], OTHER_NS)).stored == 1
        await store.drain()
        assert store.shared_writer.queued_blocks == 2
        queued = store.shared_writer.queued(key(1))
        assert queued is not None and queued.namespace == OTHER_NS
        assert counters(store)["write_through_queued"] == 3
        redis_server.start()
        await poll(lambda: store.shared_writer.queued_blocks == 0, "the queue drained")
    finally:
        await store.close()
    other = make_store(redis_server.url)
    try:
        assert (await other.get([key(1)], OTHER_NS))[0].payload == payload(1)
        assert not (await other.get([key(1)], NS))[0].found
    finally:
        await other.close()
