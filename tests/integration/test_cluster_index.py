"""The cluster index with two real ``kvstore serve`` nodes and a real redis-server.

Each node publishes which blocks it holds in which tier (:mod:`kvstore.cluster`); a reader
(:class:`ClusterIndex`, what a router uses) sees them within the publish interval, sees a
demotion change the tier, stops seeing a node stopped cleanly at once and a killed node once its
lease expires, never counts a restarted node's entries of its earlier boot, and gets a full
republish after Redis comes back empty.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from harness.cluster_nodes import (
    LEASE_TTL_S,
    NS,
    PREFIX,
    blocks_for,
    cluster_env,
    holders,
)
from harness.polling import poll

from kvstore.cluster import Holding, Layout

if TYPE_CHECKING:
    from harness.server_factory import ServerFactory

from harness.redis_cluster import RedisCluster
from harness.redis_server import RedisServer


def test_index_follows_blocks_tiers_and_node_lifecycles(
    server_factory: ServerFactory, redis_server: RedisServer
) -> None:
    url = redis_server.url
    # Node a's dram holds 16 blocks: the filler below demotes its first blocks to nvme.
    a = server_factory(env=cluster_env(url, "a"), dram_capacity="1MiB")
    b = server_factory(env=cluster_env(url, "b"))
    first, first_values = blocks_for(0, 4)
    second, second_values = blocks_for(10_000, 3)
    with a.client(NS) as one, b.client(NS) as two:
        assert one.put(first, first_values).stored == 4
        assert two.put(second, second_values).stored == 3
        poll(lambda: len(holders(url, first + second)) == 2, 5.0, "both nodes in the index")
        found = holders(url, first + second)
        assert set(found) == {"a", "b"}
        assert found["a"].leading == 4
        assert found["a"].tiers == ["dram"] * 4 + [""] * 3
        assert found["b"].leading == 0
        assert found["b"].tiers == [""] * 4 + ["dram"] * 3

        # Demotion: filling a's dram moves its oldest blocks to nvme, and the index says so.
        filler, filler_values = blocks_for(50_000, 24)
        assert one.put(filler, filler_values).stored == 24
        assert one.lookup_tiers(first).tiers == ["nvme"] * 4
        poll(
            lambda: holders(url, first).get("a", Holding(0, [])).tiers == ["nvme"] * 4,
            5.0,
            "the demotion in the index",
        )

    # A clean stop takes b out of the index before the process exits.
    b.stop(signal.SIGTERM)
    assert holders(url, first + second).keys() == {"a"}

    # A crash leaves a's entries in Redis; its lease expiring makes them stop counting.
    a.stop(signal.SIGKILL)
    raw = redis_server.client()
    entry = Layout(PREFIX).entry
    assert raw.hget(entry(first[0]), "a") == b"1:nvme"
    poll(lambda: not holders(url, first + filler), LEASE_TTL_S + 5.0, "a's lease expiry")

    # Restarted on the same disk: epoch 2. What it kept on nvme is published again; what died
    # with its dram is still in Redis under epoch 1 and never counts.
    a.start()
    poll(lambda: "a" in holders(url, first), 5.0, "node a republished after its restart")
    stale = [key for key in filler if raw.hget(entry(key), "a") == b"1:dram"]
    assert stale, "some filler blocks should have been only in a's dram when it was killed"
    assert holders(url, stale) == {}
    assert holders(url, first)["a"].tiers == ["nvme"] * 4
    assert raw.hget(entry(first[0]), "a") == b"2:nvme"
    a.stop(signal.SIGTERM)
    assert holders(url, first + filler) == {}
    assert raw.hget(entry(first[0]), "a") is None  # a clean stop removes the entries too


def test_redis_outage_keeps_serving_and_republishes_in_full(
    server_factory: ServerFactory, redis_server: RedisServer
) -> None:
    url = redis_server.url
    node = server_factory(env=cluster_env(url, "n"))
    before, before_values = blocks_for(0, 3)
    during, during_values = blocks_for(20_000, 2)
    with node.client(NS) as client:
        assert client.put(before, before_values).stored == 3
        poll(lambda: "n" in holders(url, before), 5.0, "blocks in the index")

        redis_server.kill()
        assert client.put(during, during_values).stored == 2
        assert client.get(before + during) == before_values + during_values

        redis_server.restart()  # empty: everything must be published again
        poll(
            lambda: holders(url, before + during).get("n", Holding(0, [])).leading == 5,
            LEASE_TTL_S + 10.0,
            "the full republish after Redis came back",
        )
    assert node.running
    node.stop(signal.SIGTERM)
    assert "Redis unreachable" in node.stderr() or "publishing failed" in node.stderr()


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[str]:
    """A real three-shard Redis Cluster (no replicas); yields its ``redis+cluster://`` URL."""
    with RedisCluster(tmp_path / "cluster", masters=3, replicas=0) as cluster:
        yield cluster.url


def test_index_on_a_redis_cluster(server_factory: ServerFactory, redis_cluster: str) -> None:
    node = server_factory(env=cluster_env(redis_cluster, "c"))
    keys, values = blocks_for(0, 24)  # keys in many slots, so on all three shards
    with node.client(NS) as client:
        assert client.put(keys, values).stored == 24
        poll(
            lambda: holders(redis_cluster, keys).get("c", Holding(0, [])).leading == 24,
            10.0,
            "the blocks in the cluster's index",
        )
    assert holders(redis_cluster, keys)["c"].tiers == ["dram"] * 24
    node.stop(signal.SIGTERM)
    assert holders(redis_cluster, keys) == {}
