"""What the shared-memory tests put and how they wait for the server to give arena space back:
the namespace they store under, random blocks, the dram tier's counters, and a poll until no
lease, reservation or retired byte is left (a test that ends earlier would see the previous
one's space still held)."""

from __future__ import annotations

import numpy as np

from harness.polling import poll
from kvstore import KVStoreClient, Namespace

__all__ = ["NS", "dram", "make_blocks", "wait_released"]

NS = Namespace(model="shm-test", num_layers=2, num_kv_heads=2, head_size=64, dtype="bfloat16")
#: How long the server may take to give space back, on 2 cores at load 10.
RELEASE_S = 5.0


def make_blocks(seed: int, count: int, size: int) -> tuple[list[bytes], list[bytes]]:
    """``count`` random 16-byte keys and ``size``-byte values, the same for the same ``seed``."""
    rng = np.random.default_rng(seed)
    return [rng.bytes(16) for _ in range(count)], [rng.bytes(size) for _ in range(count)]


def dram(client: KVStoreClient) -> dict[str, int]:
    """The dram tier's counters as the server reports them (``stats()["tiers"]["dram"]``)."""
    return dict(client.stats()["tiers"]["dram"])


def wait_released(client: KVStoreClient, used: int | None = None) -> dict[str, int]:
    """Poll until the server holds no leases and no reservations (and ``used`` is back); return
    the dram counters that showed it."""
    seen: dict[str, int] = {}

    def settled() -> bool:
        seen.update(dram(client))
        return (
            seen["leases"] == 0
            and seen["reserved_bytes"] == 0
            and seen["retired_bytes"] == 0
            and (used is None or seen["used"] == used)
        )

    try:
        poll(settled, RELEASE_S, "the server to give everything back")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; dram stats {seen}, expected used {used}") from None
    return seen
