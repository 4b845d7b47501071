"""Deadlines that scale with the bytes (:mod:`kvstore.tiers.redis_rate`), against a real
redis-server behind a slow link (a throttled TCP proxy, :mod:`harness.slow_link`).

An 8 MiB batched read over a link of a few MiB/s takes seconds: with the default settings it is
slow, not an outage; with the deadline fixed at ``op_timeout_s`` (the cap set to the floor: the
behaviour before) the same read marks the tier down. A link slower than ``redis.min_rate`` is
measured on smaller calls first, and the large read then gets a deadline it can meet. A small
call to a stalled Redis still fails within the floor.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness.redis_server import RedisServer
from harness.slow_link import SlowLink

from kvstore.block import BlockHeader
from kvstore.tiers.redis import RedisTier
from kvstore.tiers.redis_rate import TransferRate

MIB = 1024**2
NS = bytes(range(16))


def key(n: int) -> bytes:
    return hashlib.blake2b(n.to_bytes(8, "little"), digest_size=16).digest()


def block(n: int, size: int) -> tuple[BlockHeader, bytes]:
    payload = hashlib.shake_256(n.to_bytes(8, "little")).digest(size)
    return BlockHeader.for_payload(key(n), NS, payload), payload


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path / "redis") as running:
        yield running


async def fill(server: RedisServer, numbers: range, size: int) -> list[bytes]:
    """Blocks written straight to Redis (no slow link), as another node would have."""
    fast = RedisTier(server.url, capacity=1 << 40)
    try:
        items = [block(n, size) for n in numbers]
        assert await fast.write_many(items) == [True] * len(items)
        return [payload for _, payload in items]
    finally:
        await fast.close()


async def test_an_8_mib_read_over_a_slow_link_is_slow_not_down(server: RedisServer) -> None:
    payloads = await fill(server, range(8), MIB)
    with SlowLink(("127.0.0.1", server.port), rate=8 * MIB) as link:
        tier = RedisTier(f"redis://127.0.0.1:{link.port}/0", capacity=1 << 40)
        try:
            started = time.monotonic()
            got = await tier.read([key(n) for n in range(8)])
            took = time.monotonic() - started
            assert [bytes(b.payload) if b else None for b in got] == payloads
            assert took > 0.8  # the link really is slow: past the 0.5 s floor
            stats = tier.stats()
            assert stats["up"] == 1 and stats["outages"] == 0
            assert 0 < stats["rate_bytes_per_s"] < 9 * MIB  # measured on the way
        finally:
            await tier.close()

        # The same read with the deadline fixed at the floor, as before: an outage.
        fixed = RedisTier(
            f"redis://127.0.0.1:{link.port}/0", capacity=1 << 40, op_timeout_max_s=0.5
        )
        try:
            assert await fixed.read([key(n) for n in range(8)]) == [None] * 8
            assert fixed.stats()["outages"] == 1
        finally:
            await fixed.close()


async def test_a_link_slower_than_the_minimum_rate_is_measured_then_met(
    server: RedisServer,
) -> None:
    payloads = await fill(server, range(4), MIB)
    with SlowLink(("127.0.0.1", server.port), rate=MIB) as link:
        url = f"redis://127.0.0.1:{link.port}/0"
        # Nothing measured yet: 4 MiB at 1 MiB/s (4 s) is past what 4 MiB/s allows (1.5 s).
        fresh = RedisTier(url, capacity=1 << 40)
        try:
            assert await fresh.read([key(n) for n in range(4)]) == [None] * 4
            assert fresh.stats()["outages"] == 1
        finally:
            await fresh.close()
        tier = RedisTier(url, capacity=1 << 40)
        try:
            # Its own writes measure the link first (256 KiB each: well inside their deadline).
            for n in range(100, 104):
                assert await tier.write(*block(n, 256 * 1024))
            assert 0 < tier.stats()["rate_bytes_per_s"] < 2 * MIB
            got = await tier.read([key(n) for n in range(4)])
            assert [bytes(b.payload) if b else None for b in got] == payloads
            assert tier.stats()["outages"] == 0
        finally:
            await tier.close()


async def test_a_stalled_redis_still_fails_a_small_call_within_the_floor(
    server: RedisServer,
) -> None:
    tier = RedisTier(server.url, capacity=1 << 40, op_timeout_s=0.3)
    try:
        assert await tier.exists([key(1)]) == [False]
        server.pause()
        started = time.monotonic()
        assert await tier.exists([key(1)]) == [False]
        assert time.monotonic() - started < 0.3 + 0.5  # the floor, plus a loaded box's slack
        assert not tier.up
    finally:
        server.resume()
        await tier.close()


def test_deadlines_grow_with_the_bytes_between_floor_and_cap() -> None:
    rate = TransferRate(0.5, 30.0, 4 * MIB)
    assert rate.timeout(0) == 0.5
    assert rate.timeout(8 * MIB) == pytest.approx(2.5)
    assert rate.timeout(1 << 40) == 30.0
    rate.observe(8 * MIB, 4.0)  # a 2 MiB/s link: deadlines assume half that
    assert rate.timeout(8 * MIB) == pytest.approx(0.5 + 8.0)
    rate.missed(8 * MIB, 8.0)  # it ran out at 8 s: at most 1 MiB/s, deadlines assume half
    assert rate.timeout(8 * MIB) == pytest.approx(0.5 + 16.0)
    with pytest.raises(ValueError):
        TransferRate(1.0, 0.5, MIB)
