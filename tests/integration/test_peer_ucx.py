"""Peer fetch over UCX (``cluster.peer_transport``) with real ``kvstore serve`` nodes, their UCX
listeners and a real redis-server.

A node reads another's blocks over UCX where the peer advertises a listener (``auto``), counted
per transport; a UCX failure falls back to gRPC for that read (``auto``) or is a miss (``ucx``);
keys a dead holder cannot serve come from the next live holder within the same request; and
across network namespaces (tests/harness/netns_hosts.py) the UCX path is the one taken.
The UCX failure is a real one: the peer's advertised UCX address is rewritten in the index to a
port where nothing listens, so connecting is refused while its gRPC port still answers.
"""

from __future__ import annotations

import dataclasses
import signal
from pathlib import Path
from typing import TYPE_CHECKING

from harness.cluster_nodes import (
    NS,
    PREFIX,
    blocks_for,
    counters,
    grpc_client,
    holders,
    payload_keys,
    peer_env,
)
from harness.index_records import CLUSTER_SECRET, described, rewrite
from harness.netns_hosts import Host, Hosts
from harness.polling import poll

from kvstore.node.peers import holder_rank
from kvstore.protocol.ucx import ucx_unavailable_reason

if TYPE_CHECKING:
    from harness.serve import ServerProcess
    from harness.server_factory import ServerFactory

from harness.redis_server import RedisServer

if ucx_unavailable_reason() is not None:  # the ucx extra is part of the test environment
    raise ImportError(f"test_peer_ucx needs ucxx: {ucx_unavailable_reason()}")

# The UCX listener binds every interface: a server without tokens must say it allows that.
UCX = ("--ucx-listen", "127.0.0.1:0", "--allow-unauthenticated")


def node(
    factory: ServerFactory,
    url: str,
    name: str,
    transport: str = "auto",
    shared: str = "peers",
    host: Host | None = None,
) -> ServerProcess:
    env = {**peer_env(url, name, shared), "KVSTORE_CLUSTER_PEER_TRANSPORT": transport}
    if host is None:
        return factory(*UCX, env=env)
    listen = ("--ucx-listen", f"{host.address}:0", "--allow-unauthenticated")
    return factory(*listen, env=env, host=host)


def break_ucx(redis_server: RedisServer, name: str) -> None:
    """Make ``name`` advertise a UCX address where nothing listens (its gRPC port still works),
    signed under the cluster's secret as the node itself would (a description changed without
    it is ignored altogether: tests/integration/test_node_auth.py)."""
    redis = redis_server.client()
    with socket_port() as port:
        info = dataclasses.replace(described(redis, PREFIX, name), ucx=f"127.0.0.1:{port}")
        rewrite(redis, PREFIX, info, CLUSTER_SECRET)


class socket_port:
    """A loopback TCP port that nothing listens on (bound, never listening, while in use)."""

    def __enter__(self) -> int:
        import socket

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        return int(self.sock.getsockname()[1])

    def __exit__(self, *exc: object) -> None:
        self.sock.close()


def test_peer_reads_go_over_ucx_and_grpc_nodes_use_grpc(
    server_factory: ServerFactory, redis_server: RedisServer
) -> None:
    url = redis_server.url
    one = node(server_factory, url, "one")
    two = node(server_factory, url, "two", transport="grpc")
    three = node(server_factory, url, "three")
    keys, values = blocks_for(0, 6)
    with grpc_client(one) as writer:
        assert writer.put(keys, values).stored == 6
    poll(lambda: holders(url, keys).get("one") is not None, 5.0, "node one in the index")

    with grpc_client(three) as reader:
        assert reader.get(keys) == values  # bit-identical, over UCX from node one
    seen = counters(three)
    assert seen["peer_hits_ucx"] == 6
    assert seen.get("peer_hits_grpc", 0) == 0
    assert seen["peer_hits"] == 6
    assert seen.get("peer_ucx_fallbacks", 0) == 0

    with grpc_client(two) as reader:
        assert reader.get(keys[:3]) == values[:3]  # peer_transport = grpc: never UCX
    seen = counters(two)
    assert seen["peer_hits_grpc"] == 3
    assert seen.get("peer_hits_ucx", 0) == 0
    assert payload_keys(redis_server) == []


def test_a_shared_memory_reader_gets_peer_blocks_received_straight_into_its_arena(
    server_factory: ServerFactory, redis_server: RedisServer
) -> None:
    """An engine beside its node (shared memory): the node acquires the blocks, and UCX
    receives them into reserved arena pages that become the blocks, with no copy."""
    url = redis_server.url
    one = node(server_factory, url, "one")
    three = node(server_factory, url, "three")
    keys, values = blocks_for(0, 4)
    with grpc_client(one) as writer:
        assert writer.put(keys, values).stored == 4
    poll(lambda: holders(url, keys).get("one") is not None, 5.0, "node one in the index")
    with three.client(NS, data_plane="shm", timeout=3.0) as reader:
        reader.lookup(keys[:1])  # connects: attaches shared memory
        assert reader.data_plane == "shm"
        assert reader.get(keys) == values  # bit-identical, over UCX into the arena
        assert reader.get(keys) == values  # now local
    seen = counters(three)
    assert seen["peer_hits_ucx"] == 4
    assert seen["landed_blocks"] == 4
    assert seen.get("peer_ucx_fallbacks", 0) == 0
    with grpc_client(three) as reader:
        stats = reader.stats()
    assert stats["tiers"]["dram"]["reserved_bytes"] == 0
    assert stats["tiers"]["dram"]["blocks"] == 4


def test_a_ucx_failure_falls_back_to_grpc_under_auto_and_misses_under_ucx(
    server_factory: ServerFactory, redis_server: RedisServer
) -> None:
    url = redis_server.url
    one = node(server_factory, url, "one")
    keys, values = blocks_for(0, 4)
    with grpc_client(one) as writer:
        assert writer.put(keys, values).stored == 4
    poll(lambda: holders(url, keys).get("one") is not None, 5.0, "node one in the index")
    break_ucx(redis_server, "one")  # before any reader learns node one's addresses

    auto = node(server_factory, url, "auto")
    with grpc_client(auto) as reader:
        assert reader.get(keys[:2]) == values[:2]  # UCX refused: the same read over gRPC
        seen = counters(auto)
        assert seen["peer_ucx_fallbacks"] == 1
        assert seen["peer_hits_grpc"] == 2
        assert seen.get("peer_hits_ucx", 0) == 0
        assert seen.get("peer_suspected", 0) == 0  # the peer answered over gRPC
        assert reader.get(keys[2:3]) == values[2:3]  # UCX rests: straight to gRPC
        seen = counters(auto)
        assert seen["peer_ucx_fallbacks"] == 1
        assert seen["peer_hits_grpc"] == 3

    strict = node(server_factory, url, "strict", transport="ucx")
    with grpc_client(strict) as reader:
        # UCX only: the refused listener is this read's miss, within the client's deadline.
        assert reader.get(keys[3:]) == [None]
        seen = counters(strict)
        assert seen.get("peer_hits", 0) == 0
        assert seen["miss_peer_down"] == 1
        assert seen["peer_suspected"] == 1


def test_keys_a_dead_holder_cannot_serve_come_from_the_next_holder(
    server_factory: ServerFactory, redis_server: RedisServer
) -> None:
    url = redis_server.url
    one, two, three = (node(server_factory, url, name) for name in ("one", "two", "three"))
    candidates, candidate_values = blocks_for(0, 16)
    # Keys that node one ranks first for (both holders keep them in dram): asked of one first.
    chosen = [
        i for i, key in enumerate(candidates) if holder_rank(key, "one") < holder_rank(key, "two")
    ][:4]
    assert len(chosen) == 4
    keys = [candidates[i] for i in chosen]
    values = [candidate_values[i] for i in chosen]
    for holder in (one, two):
        with grpc_client(holder) as writer:
            assert writer.put(keys, values).stored == 4
    poll(lambda: set(holders(url, keys)) == {"one", "two"}, 5.0, "both holders in the index")
    one.stop(signal.SIGKILL)  # its lease still names it for a while

    with grpc_client(three) as reader:
        assert reader.get(keys) == values  # node one fails; node two serves, same request
    seen = counters(three)
    assert seen["peer_retries"] == 4
    assert seen["peer_suspected"] == 1
    assert seen["peer_hits"] == 4
    assert seen.get("miss_peer_down", 0) == 0


def test_a_node_in_another_network_namespace_reads_over_ucx(
    server_factory: ServerFactory, tmp_path: Path
) -> None:
    """Two hosts on a bridge, Redis on the bridge's address: nothing but TCP between them."""
    with Hosts(2) as hosts, RedisServer(tmp_path / "netns-redis", host=hosts.gateway) as redis:
        url = redis.url
        one = node(server_factory, url, "one", host=hosts[0])
        three = node(server_factory, url, "three", host=hosts[1])
        keys, values = blocks_for(0, 5)
        with grpc_client(one) as writer:
            assert writer.put(keys, values).stored == 5
        poll(lambda: holders(url, keys).get("one") is not None, 5.0, "node one in the index")
        with grpc_client(three) as reader:
            assert reader.get(keys) == values  # bit-identical, from the other host, over UCX
        seen = counters(three)
        assert seen["peer_hits_ucx"] == 5
        assert seen.get("peer_hits_grpc", 0) == 0
        assert payload_keys(redis) == []  # Redis holds the index only
        for server in (one, three):
            server.stop()
