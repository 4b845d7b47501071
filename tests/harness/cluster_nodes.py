"""Cluster nodes in tests: the namespace and chained blocks the cluster-index and peer tests put,
the environment that makes a ``kvstore serve`` a cluster node (and one that reads its peers),
and what a router would learn from the index.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np

from harness.redis_server import RedisServer
from harness.serve import ServerProcess
from kvstore import ChunkHasher, KVStoreClient, Namespace
from kvstore.cluster import ClusterIndex, Holding, Layout, connect

__all__ = [
    "BLOCK_BYTES",
    "HASHER",
    "LEASE_TTL_S",
    "NS",
    "PAYLOAD_PREFIX",
    "PREFIX",
    "blocks_for",
    "cluster_env",
    "counters",
    "grpc_client",
    "holders",
    "payload_keys",
    "peer_env",
    "redis_stats",
]

NS = Namespace(model="cluster-index", num_layers=2, num_kv_heads=2, head_size=64)
HASHER = ChunkHasher(chunk_size=16, namespace=NS)
BLOCK_BYTES = 64 * 1024
PREFIX = "kvstore:cluster:v1:"
LEASE_TTL_S = 1.5


def blocks_for(first_token: int, count: int) -> tuple[list[bytes], list[bytes]]:
    """``count`` chained keys of a prompt starting at ``first_token``, and random payloads."""
    keys: list[bytes] = list(HASHER.keys(list(range(first_token, first_token + 16 * count))))
    rng = np.random.default_rng(first_token)
    return keys, [rng.integers(0, 256, BLOCK_BYTES, dtype=np.uint8).tobytes() for _ in keys]


def cluster_env(url: str, node: str, lease_ttl_s: float | None = LEASE_TTL_S) -> dict[str, str]:
    """The environment that makes a ``kvstore serve`` the cluster node ``node`` of the index at
    ``url``, publishing every 50 ms; its lease lasts ``lease_ttl_s`` (``None``: the default's),
    short by default so that the tests of a node that stops see its lease end soon."""
    env = {
        "KVSTORE_CLUSTER_ENABLED": "1",
        "KVSTORE_CLUSTER_URL": url,
        "KVSTORE_CLUSTER_NODE_ID": node,
        "KVSTORE_CLUSTER_PUBLISH_INTERVAL_S": "0.05",
    }
    if lease_ttl_s is not None:
        env["KVSTORE_CLUSTER_LEASE_TTL_S"] = str(lease_ttl_s)
    return env


def holders(url: str, keys: Sequence[bytes]) -> dict[str, Holding]:
    """What a router would learn from the index about ``keys``."""

    async def ask() -> dict[str, Holding]:
        client = connect(url, 2.0)
        try:
            return await ClusterIndex(client, Layout(PREFIX)).holders(keys)
        finally:
            await client.aclose()

    return asyncio.run(ask())


PAYLOAD_PREFIX = "kvstore:v1:"


def peer_env(url: str, node: str, shared_data: str) -> dict[str, str]:
    return {
        **cluster_env(url, node),
        "KVSTORE_REDIS_URL": url,
        "KVSTORE_CLUSTER_SHARED_DATA": shared_data,
        # Nodes sharing a Redis share the secrets its blocks are signed with.
        "KVSTORE_INTEGRITY_SECRETS": "peer-fetch-test-secret",
    }


def grpc_client(node: ServerProcess) -> KVStoreClient:
    # gRPC only: the reading node must get the block from its peer, not from shared memory.
    client: KVStoreClient = node.client(NS, data_plane="grpc", timeout=3.0)
    return client


def counters(node: ServerProcess) -> dict[str, int]:
    with grpc_client(node) as client:
        return dict(client.stats()["counters"])


def payload_keys(redis_server: RedisServer) -> list[bytes]:
    """Block payloads in Redis: the prefix and a hex key (not the nodes' keyring record)."""
    names = redis_server.client().scan_iter(match=PAYLOAD_PREFIX + "*")
    hex_digits = set(b"0123456789abcdef")
    return [name for name in names if set(name[len(PAYLOAD_PREFIX) :]) <= hex_digits]


def redis_stats(client: KVStoreClient) -> dict[str, Any]:
    return dict(client.stats()["tiers"]["redis"])
