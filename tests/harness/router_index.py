"""A router in front of cluster nodes, in tests: the namespace and chunking the nodes publish as
their key scheme, the environment that makes a ``kvstore serve`` such a node, prompts, blocks
put on a node, and how many leading chunks the index says each node holds.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np

from harness.cluster_nodes import cluster_env
from kvstore import ChunkHasher, Namespace
from kvstore.cluster import ClusterIndex, Layout, connect

__all__ = [
    "CHUNK",
    "HASHER",
    "NS",
    "PREFIX",
    "index_leading",
    "namespace_json",
    "node_env",
    "store",
    "tokens",
]

NS = Namespace(model="router-test", num_layers=2, num_kv_heads=2, head_size=64)
CHUNK = 16
HASHER = ChunkHasher(chunk_size=CHUNK, namespace=NS)
PREFIX = "kvstore:cluster:v1:"


def namespace_json() -> str:
    fields = dataclasses.asdict(NS)
    for name in ("lora_id", "cache_salt", "tp_rank"):
        del fields[name]
    return json.dumps(fields)


def node_env(url: str, node: str) -> dict[str, str]:
    """The environment of a node the router tests put behind a router: :func:`cluster_env`'s
    (the default lease), publishing the key scheme the router names chunks by."""
    return {
        **cluster_env(url, node, lease_ttl_s=None),
        "KVSTORE_KEYS_CHUNK_SIZE": str(CHUNK),
        "KVSTORE_KEYS_NAMESPACE": namespace_json(),
        "KVSTORE_HASH_SECRET": "",
    }


def tokens(first: int, chunks: int) -> list[int]:
    return list(range(first, first + CHUNK * chunks))


def store(node: Any, prompt: list[int]) -> list[bytes]:
    keys = HASHER.keys(prompt)
    values = [np.full(4096, i, dtype=np.uint8).tobytes() for i in range(len(keys))]
    with node.client(NS) as client:
        assert client.put(keys, values).stored == len(keys)
    return [bytes(k) for k in keys]


def index_leading(url: str, keys: list[bytes]) -> dict[str, int]:
    async def ask() -> dict[str, int]:
        client = connect(url, 2.0)
        try:
            found = await ClusterIndex(client, Layout(PREFIX)).holders(keys)
            return {node: holding.leading for node, holding in found.items()}
        finally:
            await client.aclose()

    import asyncio

    return asyncio.run(ask())
