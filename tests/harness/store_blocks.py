"""Keys, payloads and a small dram (+ nvme) store for the store-level tests.

Every test module that drives :class:`~kvstore.store.TieredStore` directly names blocks by a
number: ``key(n)`` and ``payload(n)`` are the same bytes in all of them, so a failure reads the
same whichever module it comes from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kvstore.store import TieredStore
from kvstore.tiers.dram import DramTier
from kvstore.tiers.nvme import NvmeTier

PAGE = 4096
MIB = 1024**2


def key(n: int) -> bytes:
    """The 16-byte key of block ``n``."""
    return n.to_bytes(4, "little") * 4


def payload(n: int, length: int = PAGE) -> bytes:
    """The bytes of block ``n`` (random, reproducible)."""
    return np.random.default_rng(n).integers(0, 256, size=length, dtype=np.uint8).tobytes()


def make_store(
    nvme_path: Path | None, *, dram_pages: int = 4, nvme_capacity: int = MIB, **kwargs: Any
) -> TieredStore:
    """A store of ``dram_pages`` one-page dram slots, over an nvme tier at ``nvme_path``."""
    tiers: list[Any] = [DramTier(dram_pages * PAGE, page_size=PAGE)]
    if nvme_path is not None:
        tiers.append(NvmeTier(nvme_path, nvme_capacity))
    return TieredStore(tiers, **kwargs)


def arena(store: TieredStore) -> DramTier:
    """``store``'s dram arena (the store must have one)."""
    tier = store.arena
    assert tier is not None
    return tier
