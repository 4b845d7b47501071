"""A rogue node in the cluster index never gets a forged byte served (issue 28, item 1).

The rogue is a real ``kvstore serve`` that registers in the same index Redis, claims keys and
serves payloads that do not match them, but lacks the cluster's integrity secret (it has one of its
own). Every block a node reads from a peer arrives with its keyed MAC and is verified before it is
installed or served, over gRPC and over UCX (into a private buffer, or straight into reserved
arena pages): the rogue's blocks are misses counted as corrupt from a peer
(``peer_corrupt_blocks``, ``kvstore_tier_corrupt_blocks{tier="peer"}``), the rogue is suspect
(asked again only once it restarts, whatever its lease does) and the next holder serves the keys
within the same request. The reading node keeps serving throughout.
"""

from __future__ import annotations

import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

from netns_hosts import Host, Hosts
from prometheus_client.parser import text_string_to_metric_families
from test_cluster_index import NS, PREFIX, blocks_for, holders, poll
from test_peer_fetch import counters, grpc_client, peer_env

from kvstore.cluster.layout import Layout
from kvstore.cluster.peers import holder_rank

if TYPE_CHECKING:
    from conftest import ServerFactory, ServerProcess

from harness.redis_server import RedisServer

ROGUE_SECRET = "not the cluster's secret"


def start(
    factory: ServerFactory,
    url: str,
    name: str,
    transport: str,
    *,
    rogue: bool = False,
    host: Host | None = None,
) -> ServerProcess:
    env = {**peer_env(url, name, "peers"), "KVSTORE_CLUSTER_PEER_TRANSPORT": transport}
    if rogue:
        env["KVSTORE_INTEGRITY_SECRETS"] = ROGUE_SECRET
    if transport == "grpc":
        return factory(env=env)
    address = host.address if host is not None else "127.0.0.1"
    # The UCX listener binds beyond loopback: a server without tokens must say it allows that.
    # /metrics listens on the host's address too, for the test in the root namespace to scrape.
    flags = ("--ucx-listen", f"{address}:0", "--metrics-listen", f"{address}:0")
    return factory(*flags, "--allow-unauthenticated", env=env, host=host)


def forged(values: list[bytes]) -> list[bytes]:
    return [bytes(b ^ 0x5A for b in value) for value in values]


def rogue_first(count: int) -> tuple[list[bytes], list[bytes]]:
    """Keys for which the rogue comes before node ``one`` in every reader's holder order."""
    keys, values = blocks_for(30_000, 4 * count)
    first = [i for i, key in enumerate(keys) if holder_rank(key, "rogue") < holder_rank(key, "one")]
    chosen = first[:count]
    assert len(chosen) == count
    return [keys[i] for i in chosen], [values[i] for i in chosen]


def put(node: ServerProcess, keys: list[bytes], values: list[bytes]) -> None:
    with grpc_client(node) as writer:
        assert writer.put(keys, values).stored == len(keys)


def peer_corrupt_metric(node: ServerProcess) -> float:
    with urllib.request.urlopen(node.metrics_url, timeout=10) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvstore_tier_corrupt_blocks_total" and sample.labels == {
                "tier": "peer",
                "tenant": "",
            }:
                return sample.value
    raise AssertionError("no kvstore_tier_corrupt_blocks_total{tier='peer'} series")


def wait_for_lease_renewal(redis_server: RedisServer, node: str) -> None:
    """Return once ``node`` has renewed its lease (its time to live went up between two looks)."""
    client = redis_server.client()
    lease = Layout(PREFIX).lease(node)
    seen = [client.pttl(lease)]

    def renewed() -> bool:
        seen.append(client.pttl(lease))
        return seen[-1] > seen[-2] + 50

    poll(renewed, 5.0, f"node {node} renewing its lease")


def claim(
    redis_server: RedisServer,
    one: ServerProcess,
    rogue: ServerProcess,
) -> tuple[list[bytes], list[bytes], list[bytes]]:
    """Node one and the rogue both hold ``shared`` (the rogue forged, and asked first); only the
    rogue holds ``own`` (forged). Returns ``shared``, its true values and ``own``."""
    shared, shared_values = rogue_first(4)
    own, own_values = blocks_for(60_000, 3)
    put(one, shared, shared_values)
    put(rogue, shared, forged(shared_values))
    put(rogue, own, forged(own_values))
    url = redis_server.url
    poll(lambda: set(holders(url, shared)) == {"one", "rogue"}, 5.0, "both holders in the index")
    poll(lambda: "rogue" in holders(url, own), 5.0, "the rogue's claims in the index")
    return shared, shared_values, own


def check_refused(
    reader: ServerProcess, redis_server: RedisServer, keys: list[bytes], own: list[bytes]
) -> None:
    """``reader``'s first peer read of ``keys`` met the rogue: it refused the rogue's blocks,
    suspected it and read them from node one; then ``own`` (only the rogue holds them) is not
    even asked of the rogue, though it renews its lease."""
    seen = counters(reader)
    assert seen["peer_corrupt_blocks"] == len(keys)
    assert seen["peer_retries"] == len(keys)
    assert seen["peer_hits"] == len(keys)
    assert seen["peer_suspected"] == 1
    assert peer_corrupt_metric(reader) == len(keys)
    wait_for_lease_renewal(redis_server, "rogue")
    asked = seen["peer_requests"]
    with grpc_client(reader) as client:
        assert client.get(own) == [None] * len(own)
    seen = counters(reader)
    assert seen["peer_requests"] == asked
    assert seen["miss_peer_down"] == len(own)
    assert seen.get("miss_corrupt", 0) == 0
    assert "Traceback" not in reader.stderr()


def test_a_rogue_holder_is_refused_over_grpc(
    server_factory: ServerFactory, redis_server: RedisServer
) -> None:
    url = redis_server.url
    one = start(server_factory, url, "one", "grpc")
    rogue = start(server_factory, url, "rogue", "grpc", rogue=True)
    shared, shared_values, own = claim(redis_server, one, rogue)

    three = start(server_factory, url, "three", "grpc")
    with grpc_client(three) as reader:
        # The rogue is asked first for every key: refused, and node one serves them.
        assert reader.get(shared) == shared_values
    check_refused(three, redis_server, shared, own)

    # A reader that only the rogue can serve: misses, counted as corrupt blocks from a peer.
    four = start(server_factory, url, "four", "grpc")
    with grpc_client(four) as reader:
        assert reader.get(own) == [None] * len(own)
        assert reader.get(shared) == shared_values  # the rogue is suspect: node one serves
    seen = counters(four)
    assert seen["miss_corrupt"] == len(own)
    assert seen["peer_corrupt_blocks"] == len(own)
    assert seen["peer_suspected"] == 1
    assert seen["peer_hits"] == len(shared)


def test_a_rogue_holder_on_another_host_is_refused_over_ucx(
    server_factory: ServerFactory, tmp_path: Path
) -> None:
    """Every node on a host of its own; UCX only, so no gRPC read can stand in for a refused
    UCX one. An engine beside the reader (shared memory) acquires the keys: the node receives
    them straight into reserved arena pages, which the rogue's blocks never become."""
    with Hosts(3) as hosts, RedisServer(tmp_path / "netns-redis", host=hosts.gateway) as redis:
        url = redis.url
        one = start(server_factory, url, "one", "ucx", host=hosts[0])
        rogue = start(server_factory, url, "rogue", "ucx", rogue=True, host=hosts[1])
        shared, shared_values, own = claim(redis, one, rogue)
        three = start(server_factory, url, "three", "ucx", host=hosts[2])
        with three.client(NS, data_plane="shm", timeout=5.0) as reader:
            reader.lookup(shared[:1])  # connects: attaches shared memory
            assert reader.data_plane == "shm"
            assert reader.get(shared) == shared_values
            assert reader.get(shared) == shared_values  # now local
        seen = counters(three)
        assert seen["peer_hits_ucx"] == len(shared)
        assert seen["landed_blocks"] == len(shared)
        check_refused(three, redis, shared, own)
        with grpc_client(three) as reader:
            assert reader.stats()["tiers"]["dram"]["blocks"] == len(shared)
            # The pages the rogue's blocks were received into are given back, never installed.
            poll(
                lambda: reader.stats()["tiers"]["dram"]["reserved_bytes"] == 0,
                10.0,
                "the refused blocks' pages given back",
            )

        # Into a buffer of the reader's own (a gRPC get on the reading node), from the rogue only.
        four = start(server_factory, url, "four", "ucx", host=hosts[2])
        with grpc_client(four) as reader:
            assert reader.get(own) == [None] * len(own)
        seen = counters(four)
        assert seen["miss_corrupt"] == len(own)
        assert seen["peer_corrupt_blocks"] == len(own)
        assert seen["peer_suspected"] == 1
        assert seen.get("peer_hits", 0) == 0
        for server in (one, rogue, three, four):
            server.stop()
