"""The shared ``redis`` tier on a real Redis Cluster: three masters with a replica each.

Two real ``kvstore serve`` nodes share the cluster through ``redis+cluster://``. Blocks put at one
node are read bit-identical at the other from every shard; a master SIGKILLed mid-workload is
replaced by its replica while both nodes keep serving: nothing wrong is ever returned, no call
outlives its deadline, the misses are counted in the tier's stats, and blocks written once the
replica is promoted cross nodes again.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from harness.cluster_nodes import redis_stats
from harness.polling import poll

from kvstore import ChunkHasher, KVStoreClient, Namespace
from kvstore.cluster import ClusterIndex, Holding, Layout, connect
from kvstore.errors import KVStoreError

if TYPE_CHECKING:
    from harness.serve import ServerProcess
    from harness.server_factory import ServerFactory

from harness.redis_cluster import RedisCluster

SECRET = {"KVSTORE_INTEGRITY_SECRETS": "redis cluster test secret"}
NS = Namespace(model="redis-cluster", num_layers=2, num_kv_heads=2, head_size=64)
HASHER = ChunkHasher(chunk_size=16, namespace=NS)
BLOCK_BYTES = 32 * 1024
DEADLINE_S = 2.0
# What a call may take past its deadline: the client's own bookkeeping, never a Redis wait.
SLACK_S = 0.5
# Blocks put this long after the replica's promotion must cross nodes again.
RECOVER_S = 6.0


def blocks_for(first_token: int, count: int) -> tuple[list[bytes], list[bytes]]:
    """``count`` chained keys of a prompt starting at ``first_token``, and random payloads."""
    keys = HASHER.keys(list(range(first_token, first_token + 16 * count)))
    rng = np.random.default_rng(first_token)
    return keys, [rng.integers(0, 256, BLOCK_BYTES, dtype=np.uint8).tobytes() for _ in keys]


def serving(node: ServerProcess) -> bool:
    with grpc.insecure_channel(node.target) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=DEADLINE_S
        )
    return bool(health.status == health_pb2.HealthCheckResponse.SERVING)


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[RedisCluster]:
    with RedisCluster(tmp_path / "cluster", masters=3, replicas=1) as cluster:
        yield cluster


def two_nodes(factory: ServerFactory, cluster: RedisCluster) -> tuple[ServerProcess, ...]:
    flags = ("--redis-url", cluster.url)
    env = {**SECRET, "KVSTORE_REDIS_OP_TIMEOUT_S": "0.5"}
    return factory(*flags, env=env), factory(*flags, env=env)


def test_shared_tier_spans_every_shard(
    server_factory: ServerFactory, redis_cluster: RedisCluster
) -> None:
    node1, node2 = two_nodes(server_factory, redis_cluster)
    keys, values = blocks_for(0, 48)
    # The keys land on every master, so every shard carries some of the blocks.
    names = [b"kvstore:v1:" + key.hex().encode() for key in keys]
    assert len({redis_cluster.master_of(name).port for name in names}) == 3
    with node1.client(NS) as one, node2.client(NS) as two:
        assert one.put(keys, values).stored == 48
        poll(lambda: two.lookup(keys) == 48, 30.0, "write-through to the cluster")
        assert two.lookup_tiers(keys).tiers == ["redis"] * 48
        assert two.get(keys) == values
        assert redis_stats(two)["read_errors"] == 0


@dataclass
class Workload:
    """Puts at node 1 and gets at node 2, one new block each step, every call timed."""

    one: KVStoreClient
    two: KVStoreClient
    values: dict[int, bytes] = field(default_factory=dict)
    put_at: dict[int, float] = field(default_factory=dict)
    # (when the block was put, whether the get at node 2 returned it)
    gets: list[tuple[float, bool]] = field(default_factory=list)
    wrong: list[int] = field(default_factory=list)
    slowest: float = 0.0
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def timed(self, call: Callable[[], Any]) -> Any:
        start = time.monotonic()
        try:
            return call()
        except KVStoreError as exc:
            self.errors.append(f"{type(exc).__name__}: {exc}")
            return None
        finally:
            self.slowest = max(self.slowest, time.monotonic() - start)

    def run(self) -> None:
        index = 0
        next_get = 0
        while not self.stop.is_set():
            keys, values = blocks_for(1_000_000 + index * 16, 1)
            self.values[index] = values[0]
            self.put_at[index] = time.monotonic()
            self.timed(lambda k=keys, v=values: self.one.put(k, v, timeout=DEADLINE_S))
            index += 1
            # Read at node 2 what node 1 put a moment ago (its write-through is asynchronous).
            while next_get < index and self.put_at[next_get] < time.monotonic() - 0.5:
                got = self.timed(
                    lambda n=next_get: self.two.get(
                        blocks_for(1_000_000 + n * 16, 1)[0], timeout=DEADLINE_S
                    )
                )
                value = None if got is None else got[0]
                if value is not None and value != self.values[next_get]:
                    self.wrong.append(next_get)
                self.gets.append((self.put_at[next_get], value is not None))
                next_get += 1
            time.sleep(0.01)


def test_master_failover_mid_workload(
    server_factory: ServerFactory, redis_cluster: RedisCluster
) -> None:
    node1, node2 = two_nodes(server_factory, redis_cluster)
    # Node 2 reads every block from Redis: it never held one (it puts nothing, gets each once).
    with node1.client(NS) as one, node2.client(NS) as two:
        work = Workload(one, two)
        thread = threading.Thread(target=work.run, daemon=True)
        thread.start()
        poll(lambda: len(work.gets) >= 20, 60.0, "the workload under way")
        # The node the URL names: the servers' clients were bootstrapped from it.
        victim = redis_cluster.kill_master(redis_cluster.nodes[0])
        killed_at = time.monotonic()
        redis_cluster.wait_promoted(victim)
        promoted_at = time.monotonic()
        assert serving(node1) and serving(node2)
        # The workload runs on until blocks put RECOVER_S after the promotion were read across.
        recovered = promoted_at + RECOVER_S
        poll(lambda: sum(put > recovered for put, _ in work.gets) >= 20, 60.0, "reads after it")
        work.stop.set()
        thread.join(10.0)
        assert not thread.is_alive()
        stats1, stats2 = redis_stats(one), redis_stats(two)

    misses = [put for put, hit in work.gets if not hit]
    after = [hit for put, hit in work.gets if put > promoted_at + RECOVER_S]
    last_miss = max(misses, default=killed_at)
    print(
        f"failover: promoted {promoted_at - killed_at:.2f} s after the kill; "
        f"{len(work.gets)} gets, {len(misses)} misses; last missed block put "
        f"{last_miss - promoted_at:+.2f} s from promotion; slowest call {work.slowest:.2f} s "
        f"(deadline {DEADLINE_S} s); errors {len(work.errors)}; node1 {stats1}; node2 {stats2}"
    )
    assert work.wrong == []
    assert work.slowest <= DEADLINE_S + SLACK_S
    assert work.errors == []
    assert after and all(after), "blocks put after the promotion must cross nodes again"
    assert node1.running and node2.running
    # Every miss is counted: Redis refused node 1's write-through (then re-sent), or node 2
    # skipped the read (the dead master's keys) or had it fail.
    counted = stats1["writes_dropped"] + stats2["read_errors"] + stats2["reads_skipped"]
    assert 0 < len(misses) <= counted
    # Only the dead master's slots went down, never the whole tier.
    assert stats1["node_outages"] >= 1 and stats2["node_outages"] >= 1
    assert stats1["outages"] == 0 and stats2["outages"] == 0
    assert stats1["up"] == 1 and stats2["up"] == 1


def test_cluster_index_survives_a_master_failover(
    server_factory: ServerFactory, redis_cluster: RedisCluster
) -> None:
    url = redis_cluster.url
    env = {
        **SECRET,
        "KVSTORE_CLUSTER_ENABLED": "1",
        "KVSTORE_CLUSTER_NODE_ID": "n",
        "KVSTORE_CLUSTER_LEASE_TTL_S": "1.5",
        "KVSTORE_CLUSTER_PUBLISH_INTERVAL_S": "0.05",
    }
    node = server_factory("--redis-url", url, env=env)
    before, before_values = blocks_for(0, 24)  # entries on every shard
    after, after_values = blocks_for(50_000, 8)

    def leading(keys: list[bytes], via: str = url) -> int:
        found = holders(via, keys)
        return found["n"].leading if "n" in found else 0

    with node.client(NS) as client:
        assert client.put(before, before_values).stored == 24
        poll(lambda: leading(before) == 24, 10.0, "the blocks in the index")
        victim = redis_cluster.kill_master(redis_cluster.nodes[0])
        heir = redis_cluster.wait_promoted(victim)
        assert serving(node)
        assert client.put(after, after_values).stored == 8
        # The node keeps its URL (naming the dead master); the reader asks the promoted one.
        live = f"redis+cluster://127.0.0.1:{heir.port}/0"
        poll(lambda: leading(before + after, live) == 32, 15.0, "the index after the failover")
        assert client.get(before + after) == before_values + after_values
    assert node.running


def holders(url: str, keys: list[bytes]) -> dict[str, Holding]:
    """What a router would learn from the index about ``keys`` (a fresh client each time)."""

    async def ask() -> dict[str, Holding]:
        client = connect(url, 2.0)
        try:
            return await ClusterIndex(client, Layout("kvstore:cluster:v1:")).holders(keys)
        finally:
            await client.aclose()

    return asyncio.run(ask())


def test_manual_failover_mid_workload(
    server_factory: ServerFactory, redis_cluster: RedisCluster
) -> None:
    node1, node2 = two_nodes(server_factory, redis_cluster)
    with node1.client(NS) as one, node2.client(NS) as two:
        work = Workload(one, two)
        thread = threading.Thread(target=work.run, daemon=True)
        thread.start()
        poll(lambda: len(work.gets) >= 20, 60.0, "the workload under way")
        # A lossless switch: the old master turns replica and answers MOVED for its slots.
        (replica,) = redis_cluster.replicas_of(redis_cluster.nodes[0])
        redis_cluster.failover(replica)
        switched_at = time.monotonic()
        assert redis_cluster.roles()[redis_cluster.nodes[0].port][0] == "slave"
        assert serving(node1) and serving(node2)
        # The workload runs on until blocks put RECOVER_S after the switch were read across.
        recovered = switched_at + RECOVER_S
        poll(lambda: sum(put > recovered for put, _ in work.gets) >= 20, 60.0, "reads after it")
        work.stop.set()
        thread.join(10.0)
        assert not thread.is_alive()
        stats1, stats2 = redis_stats(one), redis_stats(two)

    misses = [put for put, hit in work.gets if not hit]
    after = [hit for put, hit in work.gets if put > switched_at + RECOVER_S]
    print(
        f"manual failover: {len(work.gets)} gets, {len(misses)} misses; slowest call "
        f"{work.slowest:.2f} s; node1 {stats1}; node2 {stats2}"
    )
    assert work.wrong == []
    assert work.slowest <= DEADLINE_S + SLACK_S
    assert work.errors == []
    assert after and all(after)
    counted = stats1["writes_dropped"] + stats2["read_errors"] + stats2["reads_skipped"]
    assert len(misses) <= counted
