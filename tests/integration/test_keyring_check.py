"""Nodes sharing a Redis compare their integrity keyrings at start (kvstore.server.keyring_check).

Two real ``kvstore serve`` processes on one real redis-server: with the defaults each generates
its own ``integrity.key``, so the second says so in one line naming ``integrity.secrets`` and runs
without the shared tier (its lookups promise nothing its reads would refuse); with the same
secrets they share blocks as before. The record itself (join, rotation, two nodes joining at
once, a node that left, Redis unreachable, junk in the record) is driven in-process against the
same real redis-server.
"""

from __future__ import annotations

import asyncio
import logging
import time
import urllib.request
from typing import TYPE_CHECKING

import pytest
import redis
from harness.polling import apoll

from kvstore import ChunkHasher, Namespace
from kvstore.block import Keyring
from kvstore.cli.stats import format_stats
from kvstore.server import keyring_check
from kvstore.server.keyring_check import KeyringRecord, check_shared_keyring, record_key
from kvstore.tiers.dram import DramTier
from kvstore.tiers.redis import RedisTier

if TYPE_CHECKING:
    from harness.redis_server import RedisServer
    from harness.server_factory import ServerFactory

NS = Namespace(model="keyring-check", num_layers=2, num_kv_heads=2, head_size=64)
HASHER = ChunkHasher(chunk_size=16, namespace=NS)
PREFIX = "kvstore:v1:"  # redis.key_prefix's default
SETTING = "integrity.secrets"
TIMEOUT_S = 30.0


def blocks(seed: int, count: int) -> tuple[list[bytes], list[bytes]]:
    keys = HASHER.keys(list(range(seed * 1000, seed * 1000 + 16 * count)))
    return keys, [bytes([seed + i]) * 4096 for i in range(count)]


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return str(response.read().decode())


def lines_naming(log: str, what: str) -> list[str]:
    return [line for line in log.splitlines() if what in line]


def test_nodes_with_their_own_generated_keys_say_so_and_promise_nothing(
    server_factory: ServerFactory, redis_server: RedisServer
) -> None:
    # The defaults: no secret configured, each node generates integrity.key in its nvme dir.
    first = server_factory("--redis-url", redis_server.url)
    second = server_factory("--redis-url", redis_server.url)
    assert lines_naming(first.stderr(), SETTING) == [], first.stderr()
    (line,) = lines_naming(second.stderr(), SETTING)
    assert "shares no secret with 1 node(s)" in line and "WITHOUT the shared tier" in line, line
    assert "ERROR" in line
    keys, values = blocks(1, 6)
    with first.client(NS) as client:
        assert client.put(keys, values).stored == 6
    redis_server.wait_for_blocks(keys)
    with second.client(NS) as client:
        stats = client.stats()
        assert "redis" not in stats["tiers"]
        assert stats["counters"]["keyring_mismatched_nodes"] == 1
        assert "shared tier: OFF: integrity keyring shares no secret with 1 node(s)" in "\n".join(
            format_stats(stats)
        )
        # No promise of blocks its reads would refuse: not the 6 of 6 it reported before.
        assert client.lookup_tiers(keys).hits == 0
        assert client.get(keys) == [None] * 6
        # Its own blocks stay local: nothing it signs reaches the tier the first node reads.
        own, own_values = blocks(2, 2)
        assert client.put(own, own_values).stored == 2
    with first.client(NS) as client:
        assert client.get(keys) == values
        stats = client.stats()
        assert stats["tiers"]["redis"]["corrupt_blocks"] == 0
        assert stats["counters"]["keyring_mismatched_nodes"] == 0
    metric = 'kvstore_shared_keyring_mismatched_nodes{tenant=""}'
    assert f"{metric} 1.0" in scrape(second.metrics_url)
    assert f"{metric} 0.0" in scrape(first.metrics_url)
    raw = redis_server.client()
    assert raw.exists(*(PREFIX + key.hex() for key in own)) == 0
    # Only the first node is in the record.
    assert raw.zcard(record_key(PREFIX)) == 1
    raw.close()


def test_nodes_with_the_same_secrets_share_blocks_as_before(
    server_factory: ServerFactory, redis_server: RedisServer
) -> None:
    env = {"KVSTORE_INTEGRITY_SECRETS": "keyring-check-cluster"}
    first = server_factory("--redis-url", redis_server.url, env=env)
    # Rotation under way: the second signs with a new secret and still lists the old one.
    second = server_factory(
        "--redis-url",
        redis_server.url,
        env={"KVSTORE_INTEGRITY_SECRETS": "keyring-check-new,keyring-check-cluster"},
    )
    assert lines_naming(first.stderr(), SETTING) == []
    assert "matches the 0 other node(s)" in first.stderr()
    (warning,) = lines_naming(second.stderr(), SETTING)
    assert "not every signing secret" in warning and "WARNING" in warning, warning
    keys, values = blocks(3, 4)
    with first.client(NS) as client:
        assert client.put(keys, values).stored == 4
    redis_server.wait_for_blocks(keys)
    with second.client(NS) as client:
        assert client.lookup_tiers(keys).tiers == ["redis"] * 4
        assert client.get(keys) == values
    # A node that stops leaves the record: the next is compared with the first alone.
    second.stop()
    third = server_factory("--redis-url", redis_server.url, env=env)
    assert "matches the 1 other node(s)" in third.stderr(), third.stderr()
    assert lines_naming(third.stderr(), SETTING) == []
    with third.client(NS) as client:
        assert client.get(keys) == values
    raw = redis_server.client()
    assert raw.zcard(record_key(PREFIX)) == 2
    third.stop()
    assert raw.zcard(record_key(PREFIX)) == 1
    raw.close()


def ring(*secrets: str) -> Keyring:
    return Keyring([secret.encode() for secret in secrets])


async def test_rotation_is_compatible_and_a_disjoint_ring_is_not(
    redis_server: RedisServer,
) -> None:
    rings = (("s-a",), ("s-b", "s-a"), ("s-a", "s-b"), ("s-c",), ("s-c", "s-b"))
    records = [KeyringRecord(redis_server.url, PREFIX, ring(*secrets)) for secrets in rings]
    try:
        verdicts = [await record.join() for record in records]
        assert [v.joined for v in verdicts] == [True, True, True, False, False]
        # Signs s-b, which the first cannot verify: compatible, with a warning.
        assert [p.signs for p in verdicts[1].partial] == [records[0].fingerprint]
        assert not verdicts[1].mismatched
        assert not verdicts[2].partial and not verdicts[2].mismatched  # the rotation done right
        assert len(verdicts[3].mismatched) == 3  # shares nothing with anyone
        # ("s-c", "s-b") shares s-b with the second and third ring, nothing with the first.
        assert [p.signs for p in verdicts[4].mismatched] == [records[0].fingerprint]
        line = records[4].mismatch_line(verdicts[4], detached=True)
        assert SETTING in line and "\n" not in line
        assert not any(secret in line for secrets in rings for secret in secrets)
    finally:
        for record in records:
            await record.close()


async def test_two_nodes_joining_at_once_are_never_both_in(redis_server: RedisServer) -> None:
    for attempt in range(20):
        prefix = f"race{attempt}:"
        one = KeyringRecord(redis_server.url, prefix, ring("x"))
        two = KeyringRecord(redis_server.url, prefix, ring("y"))
        try:
            a, b = await asyncio.gather(one.join(), two.join())
            assert sorted([a.joined, b.joined]) == [False, True]
        finally:
            await one.close()
            await two.close()


async def test_a_node_that_left_no_longer_counts_and_junk_is_ignored(
    redis_server: RedisServer,
) -> None:
    raw = redis.Redis.from_url(redis_server.url)
    key = record_key(PREFIX)
    far = 10**15  # never expires
    raw.zadd(key, {"not an entry": far, "kvstore-keyring-v1 x h s": far, "x" * 5000: far})
    gone = KeyringRecord(redis_server.url, PREFIX, ring("old"))
    assert (await gone.join()).joined
    await gone.close()
    fresh = KeyringRecord(redis_server.url, PREFIX, ring("new"))
    try:
        verdict = await fresh.join()
        assert verdict.joined and verdict.others == 0
        assert raw.zscore(key, fresh.entry) is not None
        assert 0 < raw.pttl(key) <= 60_000
    finally:
        await fresh.close()
        raw.close()


async def test_redis_unreachable_keeps_the_shared_tier_and_says_so(
    unused_target: str, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"redis://{unused_target}/0"
    dram = DramTier(1024**2)
    shared = RedisTier(url, capacity=1024**2)
    tiers, record = await check_shared_keyring([dram, shared], ring("k"))
    try:
        assert tiers == [dram, shared]
        assert record is not None and not record.joined
        (line,) = [r.getMessage() for r in caplog.records if "not compared" in r.getMessage()]
        assert "ConnectionError" in line and unused_target in line
    finally:
        if record is not None:
            await record.close()
        await shared.close()
        await dram.close()


async def test_a_mismatch_leaves_the_shared_tier_out(redis_server: RedisServer) -> None:
    first = KeyringRecord(redis_server.url, PREFIX, ring("one"))
    assert (await first.join()).joined
    dram = DramTier(1024**2)
    shared = RedisTier(redis_server.url, capacity=1024**2)
    try:
        tiers, record = await check_shared_keyring([dram, shared], ring("two"), "team")
        assert tiers == [dram] and record is not None
        assert record.detached and record.mismatched == 1 and not record.joined
    finally:
        await first.close()
        await dram.close()


async def test_a_mismatch_found_after_start_is_one_error_line(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(keyring_check, "REFRESH_S", 0.05)
    caplog.set_level(logging.INFO, logger=keyring_check.__name__)
    redis_server.kill()
    late = KeyringRecord(redis_server.url, PREFIX, ring("late"))
    assert not (await late.join()).reached
    joins = late.join
    refreshes: list[object] = []

    async def counted(timeout_s: float) -> keyring_check.Verdict:
        refreshes.append(None)
        return await joins(timeout_s)

    monkeypatch.setattr(late, "join", counted)
    late.start()  # what check_shared_keyring does where Redis did not answer
    try:
        redis_server.start()
        first = KeyringRecord(redis_server.url, PREFIX, ring("first"))
        assert (await first.join()).joined
        deadline = time.monotonic() + TIMEOUT_S
        while not [r for r in caplog.records if r.levelname == "ERROR"]:
            assert time.monotonic() < deadline, "no error line"
            await asyncio.sleep(0.02)
        seen = len(refreshes)
        await apoll(lambda: len(refreshes) >= seen + 3, TIMEOUT_S, "three more refreshes")
        (line,) = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert SETTING in line and "corrupt_blocks" in line and not late.joined
        await first.close()
        # The other node left: the next refresh joins, and says so.
        while not late.joined:
            assert time.monotonic() < deadline, "never joined"
            await asyncio.sleep(0.02)
        assert any("matches the 0 other node(s)" in r.getMessage() for r in caplog.records)
    finally:
        await late.close()


async def test_what_a_record_entry_says_reaches_the_log_tamed(redis_server: RedisServer) -> None:
    # Anyone able to write to Redis can add a well-formed entry: it is compared like any other,
    # and what it names is printed without its control characters.
    (evil,) = ring("evil").fingerprints()
    raw = redis.Redis.from_url(redis_server.url)
    raw.zadd(record_key(PREFIX), {f"kvstore-keyring-v1 id \x1b[2Jhost {evil} {evil}": 10**15})
    record = KeyringRecord(redis_server.url, PREFIX, ring("good"))
    try:
        verdict = await record.join()
        assert not verdict.joined
        line = record.mismatch_line(verdict, detached=True)
        assert "__2Jhost signs " + evil in line and "\x1b" not in line
    finally:
        await record.close()
        raw.close()
