"""A rogue node in the cluster index never gets a forged byte served (issue 28, items 1 and 2).

The rogue is a real ``kvstore serve`` that registers in the same index Redis, claims keys and
holds payloads that do not match them, but lacks the cluster's integrity secret (it has one of its
own). Its description in the index is signed under its own secret, so readers ignore it: it is
never asked (``peer_unverified_nodes``), over gRPC or UCX, and the keys it claims come from node
one or are plain misses. Where the rogue's description does pass (the test signs it with the
cluster's secret: the worst case, e.g. a rogue that took over an address a real node described),
it is asked, but it cannot check the reader's authenticator nor prove itself, so it refuses the
read; the reader suspects it and the next holder serves the keys within the same request. Either
way no block of the rogue is installed or served (``peer_corrupt_blocks`` stays 0: the blocks'
own MACs, verified on every peer read, are the last line: tests/test_peer_blocks.py), and the
reading node keeps serving throughout.
"""

from __future__ import annotations

import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

from harness.cluster_nodes import NS, PREFIX, blocks_for, counters, grpc_client, holders, peer_env
from harness.index_records import CLUSTER_SECRET, described, rewrite
from harness.netns_hosts import Host, Hosts
from harness.polling import poll
from harness.rogue_peer import put, rogue_first
from prometheus_client.parser import text_string_to_metric_families

if TYPE_CHECKING:
    from harness.serve import ServerProcess
    from harness.server_factory import ServerFactory

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


def check_ignored(reader: ServerProcess, shared: list[bytes], own: list[bytes]) -> None:
    """``reader`` read ``shared`` from node one alone, never asking the rogue (its description
    is not signed under the cluster's secret); ``own`` (only the rogue claims them) are plain
    misses, asked of nobody."""
    seen = counters(reader)
    assert seen["peer_unverified_nodes"] == 1
    assert seen["peer_requests"] == 1  # node one, once
    assert seen["peer_hits"] == len(shared)
    assert seen.get("peer_retries", 0) == 0
    assert seen["peer_corrupt_blocks"] == 0
    assert peer_corrupt_metric(reader) == 0
    with grpc_client(reader) as client:
        assert client.get(own) == [None] * len(own)
    seen = counters(reader)
    assert seen["peer_requests"] == 1
    assert seen.get("miss_peer_down", 0) == 0
    assert seen["peer_unverified_nodes"] == 1  # logged and counted once, not per read
    assert reader.stderr().count("ignoring node 'rogue'") == 1
    assert "Traceback" not in reader.stderr()


def pass_rogue_off(redis_server: RedisServer) -> None:
    """Sign the rogue's description with the cluster's secret (the worst case)."""
    redis = redis_server.client()
    rewrite(redis, PREFIX, described(redis, PREFIX, "rogue"), CLUSTER_SECRET)


def check_refused_by_rogue(
    reader: ServerProcess, rogue: ServerProcess, shared: list[bytes], own: list[bytes]
) -> None:
    """``reader`` asked the rogue first (its description passed): the rogue refused the read, it
    is suspect, and node one served every key in the same request; ``own`` are misses."""
    seen = counters(reader)
    assert seen["peer_hits"] == len(shared)
    assert seen["peer_retries"] == len(shared)
    assert seen["peer_suspected"] == 1
    assert seen["peer_corrupt_blocks"] == 0
    assert seen.get("peer_unverified_nodes", 0) == 0
    assert "refused a peer read" in rogue.stderr()  # it cannot check the authenticator
    assert "node rogue refused the request" in reader.stderr()
    with grpc_client(reader) as client:
        assert client.get(own) == [None] * len(own)
    assert counters(reader)["peer_corrupt_blocks"] == 0


def test_a_rogue_holder_is_refused_over_grpc(
    server_factory: ServerFactory, redis_server: RedisServer
) -> None:
    url = redis_server.url
    one = start(server_factory, url, "one", "grpc")
    rogue = start(server_factory, url, "rogue", "grpc", rogue=True)
    shared, shared_values, own = claim(redis_server, one, rogue)

    three = start(server_factory, url, "three", "grpc")
    with grpc_client(three) as reader:
        assert reader.get(shared) == shared_values  # all from node one
    check_ignored(three, shared, own)

    pass_rogue_off(redis_server)
    four = start(server_factory, url, "four", "grpc")
    with grpc_client(four) as reader:
        # The rogue is asked first for every key: it refuses, and node one serves them.
        assert reader.get(shared) == shared_values
    check_refused_by_rogue(four, rogue, shared, own)


def test_a_rogue_holder_on_another_host_is_refused_over_ucx(
    server_factory: ServerFactory, tmp_path: Path
) -> None:
    """Every node on a host of its own; UCX only, so no gRPC read can stand in for a refused
    UCX one. An engine beside the reader (shared memory) acquires the keys: the node receives
    them straight into reserved arena pages, from node one only."""
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
        check_ignored(three, shared, own)
        with grpc_client(three) as reader:
            assert reader.stats()["tiers"]["dram"]["blocks"] == len(shared)
            assert reader.stats()["tiers"]["dram"]["reserved_bytes"] == 0

        pass_rogue_off(redis)
        four = start(server_factory, url, "four", "ucx", host=hosts[2])
        with grpc_client(four) as reader:
            assert reader.get(shared) == shared_values
        check_refused_by_rogue(four, rogue, shared, own)
        assert counters(four)["peer_hits_ucx"] == len(shared)
        for server in (one, rogue, three, four):
            server.stop()
