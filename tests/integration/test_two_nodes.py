"""Two ``kvstore serve`` nodes, each with its own dram and nvme, sharing one real redis-server.

A block put at one node reaches Redis by write-through and is found and read at the other; a Redis
crash leaves both nodes serving from their local tiers, and a restarted Redis carries new blocks
between them again.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import pytest
from harness.cluster_nodes import redis_stats

from kvstore import ChunkHasher, Namespace

if TYPE_CHECKING:
    from harness.server_factory import ServerFactory

from harness.polling import poll
from harness.redis_server import RedisServer

# Every node sharing a Redis needs the same integrity secret (else it rejects the others' blocks).
CLUSTER_SECRET = {"KVSTORE_INTEGRITY_SECRETS": "two-node test secret"}
NS = Namespace(model="two-nodes", num_layers=2, num_kv_heads=2, head_size=64)
HASHER = ChunkHasher(chunk_size=16, namespace=NS)
BLOCK_BYTES = 64 * 1024


def blocks_for(first_token: int, count: int) -> tuple[list[bytes], list[bytes]]:
    """``count`` chained keys of a prompt starting at ``first_token``, and random payloads."""
    keys = HASHER.keys(list(range(first_token, first_token + 16 * count)))
    rng = np.random.default_rng(first_token)
    return keys, [rng.integers(0, 256, BLOCK_BYTES, dtype=np.uint8).tobytes() for _ in keys]


@pytest.mark.each_plane
def test_two_nodes_share_blocks_and_survive_a_redis_outage(
    server_factory: ServerFactory, redis_server: RedisServer
) -> None:
    node1 = server_factory("--redis-url", redis_server.url, env=CLUSTER_SECRET)
    node2 = server_factory("--redis-url", redis_server.url, env=CLUSTER_SECRET)
    with node1.client(NS) as one, node2.client(NS) as two:
        # Put at node 1, found and read bit-identical at node 2.
        keys, values = blocks_for(0, 4)
        assert one.put(keys, values).stored == 4
        poll(lambda: two.lookup(keys) == 4, 5.0, "write-through to redis")
        assert two.lookup_tiers(keys).tiers == ["redis"] * 4
        assert two.get(keys) == values
        # Node 2 promoted them into its own dram.
        poll(lambda: two.lookup_tiers(keys).tiers == ["dram"] * 4, 5.0, "promotion at node 2")

        # Redis crashes: both nodes keep serving from their local tiers.
        redis_server.kill()
        local_keys, local_values = blocks_for(1000, 3)
        for client in (one, two):
            assert client.put(local_keys, local_values).stored == 3
            assert client.get(local_keys) == local_values
            assert client.get(keys) == values
            missing, _ = blocks_for(5000, 2)
            start = time.monotonic()
            assert client.lookup(local_keys + missing) == 3
            assert time.monotonic() - start < 1.0
        poll(lambda: all(redis_stats(c)["up"] == 0 for c in (one, two)), 5.0, "redis marked down")
        for client in (one, two):
            assert redis_stats(client)["writes_dropped"] > 0

        # Redis comes back (empty): new blocks propagate again.
        redis_server.restart()
        poll(lambda: all(redis_stats(c)["up"] == 1 for c in (one, two)), 15.0, "redis reconnect")
        new_keys, new_values = blocks_for(2000, 2)
        assert two.put(new_keys, new_values).stored == 2
        poll(lambda: one.lookup(new_keys) == 2, 5.0, "write-through after the restart")
        assert one.get(new_keys) == new_values
