"""No acknowledged write-through silently lost when a Redis Cluster master dies under load.

A real Redis Cluster (3 masters + 3 replicas) and two real ``kvstore serve`` nodes. Writer threads
put fresh blocks at node 1 without pause while a master is SIGKILLed and its replica promoted; a
reader thread asks the cluster index (:meth:`ClusterIndex.holders` under a ``wait_for``) through
the failover. Afterwards, once node 1's re-send queue has drained, every block node 1
acknowledged is read at node 2, which never held one: each is bit-identical or counted by node 1
as not shared. No call outlives its deadline and no node logs ``Unclosed ClusterNode``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
from harness.polling import poll

from kvstore import ChunkHasher, KVStoreClient, Namespace
from kvstore.cluster import ClusterIndex, Layout, connect
from kvstore.errors import KVStoreError

if TYPE_CHECKING:
    from harness.server_factory import ServerFactory

from harness.redis_cluster import RedisCluster

SECRET = {"KVSTORE_INTEGRITY_SECRETS": "redis cluster write-through secret"}
NS = Namespace(model="redis-cluster-wt", num_layers=2, num_kv_heads=2, head_size=64)
HASHER = ChunkHasher(chunk_size=16, namespace=NS)
BLOCK_BYTES = 16 * 1024
WRITERS = 3
DEADLINE_S = 2.0
# What a call may take past its deadline: scheduling on a loaded box, never a Redis wait.
SLACK_S = 0.5
INDEX_TIMEOUT_S = 0.5


def block(writer: int, n: int) -> tuple[bytes, bytes]:
    """Key and payload of writer ``writer``'s ``n``-th block (reproducible, so checkable)."""
    (key,) = HASHER.keys(
        list(range(writer * 10_000_000 + n * 16, writer * 10_000_000 + n * 16 + 16))
    )
    seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
    return key, np.random.default_rng(seed).integers(0, 256, BLOCK_BYTES, np.uint8).tobytes()


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[RedisCluster]:
    with RedisCluster(tmp_path / "cluster", masters=3, replicas=1) as cluster:
        yield cluster


class Writers:
    """``WRITERS`` threads putting fresh blocks at one node; what it acknowledged, and how long
    each put took."""

    def __init__(self, client: KVStoreClient) -> None:
        self.client = client
        self.acknowledged: list[tuple[int, int]] = []
        self.slowest = 0.0
        self.errors: list[str] = []
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(w,)) for w in range(WRITERS)]

    def _run(self, writer: int) -> None:
        n = 0
        while not self.stop.is_set():
            key, value = block(writer, n)
            start = time.monotonic()
            try:
                stored = self.client.put([key], [value], timeout=DEADLINE_S).stored
            except KVStoreError as exc:
                stored = 0
                with self._lock:
                    self.errors.append(f"{type(exc).__name__}: {exc}")
            with self._lock:
                self.slowest = max(self.slowest, time.monotonic() - start)
                if stored:
                    self.acknowledged.append((writer, n))
            n += 1
            time.sleep(0.002)


class IndexReader:
    """A router's view: ``holders`` under a ``wait_for`` of :data:`INDEX_TIMEOUT_S`, in a loop."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.slowest = 0.0
        self.calls = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()))

    async def _run(self) -> None:
        client = connect(self.url, INDEX_TIMEOUT_S)
        index = ClusterIndex(client, Layout("kvstore:cluster:v1:"))
        keys = [block(9, n)[0] for n in range(48)]  # every slot range
        try:
            while not self.stop.is_set():
                start = time.monotonic()
                # An error or a timeout is fine (the index is a hint); its duration is not.
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(index.holders(keys), INDEX_TIMEOUT_S)
                self.slowest = max(self.slowest, time.monotonic() - start)
                self.calls += 1
                await asyncio.sleep(0.01)
        finally:
            await client.aclose()


def healthy(client: KVStoreClient) -> bool:
    stats = client.stats()["tiers"]["redis"]
    return bool(stats["up"]) and stats["down_nodes"] == 0


def read_back(
    client: KVStoreClient, names: list[tuple[int, int]], wrong: list[tuple[int, int]]
) -> list[tuple[int, int]]:
    """Read ``names``' blocks at ``client``; the names not found (wrong bytes go to ``wrong``)."""
    missing: list[tuple[int, int]] = []
    for start in range(0, len(names), 64):
        batch = names[start : start + 64]
        pairs = [block(w, n) for w, n in batch]
        got = client.get([key for key, _ in pairs], timeout=30.0)
        for name, (_, value), payload in zip(batch, pairs, got, strict=True):
            if payload is None:
                missing.append(name)
            elif payload != value:
                wrong.append(name)
    return missing


def shared_counters(client: KVStoreClient) -> dict[str, Any]:
    return dict(client.stats()["counters"])


def wait_drained(node: KVStoreClient) -> None:
    """Until the node ``node`` talks to holds no copy on its way to Redis (re-send queue and
    backlog empty)."""

    def drained() -> bool:
        counters = shared_counters(node)
        return (
            counters["shared_write_queue_blocks"] == 0
            and counters["shared_write_backlog_bytes"] == 0
        )

    poll(drained, 60.0, "node 1's re-send queue drained")


def test_no_acknowledged_write_through_lost_when_a_master_dies(
    server_factory: ServerFactory, redis_cluster: RedisCluster
) -> None:
    flags = ("--redis-url", redis_cluster.url)
    # Cluster nodes too: their leases and index entries ride the same failover.
    env = {
        **SECRET,
        "KVSTORE_REDIS_OP_TIMEOUT_S": "0.5",
        "KVSTORE_CLUSTER_ENABLED": "1",
        "KVSTORE_CLUSTER_LEASE_TTL_S": "3",
    }
    node1 = server_factory(*flags, env={**env, "KVSTORE_CLUSTER_NODE_ID": "one"})
    node2 = server_factory(*flags, env={**env, "KVSTORE_CLUSTER_NODE_ID": "two"})
    with node1.client(NS) as one, node2.client(NS) as two:
        # Node 2 has met the cluster before the kill: a client bootstraps only from the URL's
        # node (the one killed) and the nodes it has seen.
        assert two.get([block(8, 0)[0]]) == [None]
        writers = Writers(one)
        reader = IndexReader(redis_cluster.url)
        for thread in [*writers.threads, reader.thread]:
            thread.start()
        try:
            poll(lambda: len(writers.acknowledged) >= 50, 60.0, "puts under way")
            # The node the URL names: the servers' clients were bootstrapped from it.
            victim = redis_cluster.kill_master(redis_cluster.nodes[0])
            redis_cluster.wait_promoted(victim)
            # Puts go on across the promotion (their copies to the dead master's slots queued).
            promoted = len(writers.acknowledged)
            poll(lambda: len(writers.acknowledged) >= promoted + 100, 60.0, "puts after it")
        finally:
            writers.stop.set()
            reader.stop.set()
            for thread in [*writers.threads, reader.thread]:
                thread.join(30.0)
        assert not any(t.is_alive() for t in [*writers.threads, reader.thread])

        wait_drained(one)
        counters = shared_counters(one)
        stats1 = dict(one.stats()["tiers"]["redis"])
        # Read back everything node 1 acknowledged, at node 2 (which holds none of it). Node 2
        # learns of the failover on its first read (a miss while it does): keys it could not
        # read are asked again once it serves every slot.
        acknowledged = sorted(writers.acknowledged)
        wrong: list[tuple[int, int]] = []
        missing = acknowledged
        for _ in range(3):
            poll(lambda: healthy(two), 30.0, "node 2's shared tier serving every slot")
            missing = read_back(two, missing, wrong)
        stats2 = dict(two.stats()["tiers"]["redis"])
    print(
        f"write-through failover: {len(acknowledged)} puts acknowledged, {len(missing)} not "
        f"readable at node 2, not shared {counters['write_through_dropped']}, queued "
        f"{counters['write_through_queued']}, re-sent {counters['write_through_resent']}; "
        f"slowest put {writers.slowest:.2f} s; holders {reader.calls} calls, slowest "
        f"{reader.slowest:.2f} s; node1 {stats1}; node2 {stats2}"
    )
    assert wrong == []
    assert len(acknowledged) > 100
    # Every acknowledged put is readable from the other node, or reported as not shared.
    assert len(missing) <= counters["write_through_dropped"], missing[:10]
    # The failover was felt (copies refused, then sent again) and only the dead master's slots
    # were ever skipped: the tier as a whole never went down.
    assert counters["write_through_queued"] > 0 and counters["write_through_resent"] > 0
    assert stats1["outages"] == 0 and stats1["node_outages"] >= 1
    assert writers.errors == [] and writers.slowest <= DEADLINE_S + SLACK_S
    assert reader.slowest <= INDEX_TIMEOUT_S + SLACK_S
    for node in (node1, node2):
        assert node.running
        log = node.stderr()
        for noise in ("Unclosed ClusterNode", "Traceback"):
            at = log.find(noise)
            assert at < 0, log[max(0, at - 2000) : at + 1000]


def test_a_dead_replica_delays_its_masters_writes_without_losing_them(
    server_factory: ServerFactory, redis_cluster: RedisCluster
) -> None:
    flags = ("--redis-url", redis_cluster.url)
    env = {**SECRET, "KVSTORE_REDIS_OP_TIMEOUT_S": "0.5"}
    node1, node2 = server_factory(*flags, env=env), server_factory(*flags, env=env)
    with node1.client(NS) as one, node2.client(NS) as two:
        assert two.get([block(8, 0)[0]]) == [None]
        writers = Writers(one)
        for thread in writers.threads:
            thread.start()
        try:
            poll(lambda: len(writers.acknowledged) >= 50, 60.0, "puts under way")
            (replica,) = redis_cluster.replicas_of(redis_cluster.nodes[0])
            assert replica.process is not None
            replica.process.kill()
            replica.process.wait()
            replica.process = None
            # cluster-node-timeout is 1 s: the replica is flagged failed; puts go on past that.
            poll(lambda: replica.port not in redis_cluster.roles(), 60.0, "the replica failed")
            flagged = len(writers.acknowledged)
            poll(lambda: len(writers.acknowledged) >= flagged + 100, 60.0, "puts after it")
        finally:
            writers.stop.set()
            for thread in writers.threads:
                thread.join(30.0)

        wait_drained(one)
        counters = shared_counters(one)
        stats1 = dict(one.stats()["tiers"]["redis"])
        acknowledged = sorted(writers.acknowledged)
        wrong: list[tuple[int, int]] = []
        missing = read_back(two, acknowledged, wrong)
    print(
        f"dead replica: {len(acknowledged)} puts acknowledged, {len(missing)} not readable at "
        f"node 2, not shared {counters['write_through_dropped']}, re-sent "
        f"{counters['write_through_resent']}; node1 {stats1}"
    )
    assert wrong == [] and len(acknowledged) > 100
    assert len(missing) <= counters["write_through_dropped"], missing[:10]
    # The master kept serving: its writes waited for an acknowledgement, never the whole tier.
    assert stats1["outages"] == 0 and stats1["up"] == 1
    assert writers.errors == [] and writers.slowest <= DEADLINE_S + SLACK_S
