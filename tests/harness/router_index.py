"""A router in front of cluster nodes, in tests: the namespace and chunking the nodes publish as
their key scheme, the environment that makes a ``kvstore serve`` such a node, prompts, blocks
put on a node, and how many leading chunks the index says each node holds.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np

from kvstore import ChunkHasher, Namespace
from kvstore.cluster import ClusterIndex, Layout, connect

__all__ = [
    "CHUNK",
    "HASHER",
    "NS",
    "PREFIX",
    "cluster_env",
    "index_leading",
    "namespace_json",
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


def cluster_env(url: str, node: str) -> dict[str, str]:
    return {
        "KVSTORE_CLUSTER_ENABLED": "1",
        "KVSTORE_CLUSTER_URL": url,
        "KVSTORE_CLUSTER_NODE_ID": node,
        "KVSTORE_CLUSTER_PUBLISH_INTERVAL_S": "0.05",
        # The key scheme the nodes publish, which the router names chunks by.
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
