"""Prompts for the retention tests: chained keys of a prompt of its own, and a flood of one-off
prompts that evicts every plain block of a small store (and none a retention still holds)."""

from __future__ import annotations

import numpy as np

from kvstore import BlockKey, ChunkHasher, KVStoreClient, Namespace, Retention

__all__ = ["BLOCK", "HOUR", "NS", "blocks", "flood"]

NS = Namespace(model="retention", num_layers=2, num_kv_heads=2, head_size=64)
BLOCK = 256 * 1024
HOUR = Retention(3600)


def blocks(seed: int, count: int) -> tuple[list[BlockKey], list[bytes]]:
    """``count`` chained keys of a prompt of its own, and their values."""
    tokens = np.random.default_rng(seed).integers(0, 50_000, 16 * count).tolist()
    keys = ChunkHasher(chunk_size=16, namespace=NS).keys(tokens)
    rng = np.random.default_rng(seed)
    return keys, [rng.integers(0, 256, BLOCK, dtype=np.uint8).tobytes() for _ in keys]


def flood(client: KVStoreClient, count: int) -> None:
    """One-off prompts, each stored once and never read again."""
    for seed in range(1000, 1000 + count):
        keys, values = blocks(seed, 4)
        client.put(keys, values)
