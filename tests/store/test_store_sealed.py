"""Sealed gets (:meth:`TieredStore.get` with ``sealed``): what a node serves another node's peer
fetch. Every hit carries its packed wire header, whose MAC under the store's keyring covers exactly
the bytes returned; a block from nvme goes out with the MAC it was stored with; a dram block whose
bytes changed since its put (a client writing the shared arena) is a ``corrupt`` miss, never
signed."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
from harness.store_blocks import PAGE, arena, key, make_store, payload

from kvstore.block import CorruptBlockError, Keyring, installed_keyring, verify_sealed
from kvstore.keys import Namespace
from kvstore.store import TieredStore

NS = Namespace(model="sealed-test").fingerprint()
RING = Keyring([b"cluster secret"]).for_tenant("a")


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[TieredStore]:
    s = make_store(tmp_path / "nvme", dram_pages=2, keyring=RING)
    yield s
    await s.close()


async def test_hits_come_sealed_under_the_store_s_keyring(store: TieredStore) -> None:
    keys = [key(n) for n in range(4)]
    await store.put(keys, [payload(n) for n in range(4)], NS)
    assert store.lookup(keys, NS).tiers == ["nvme", "nvme", "dram", "dram"]  # two demoted
    results = await store.get([*keys, key(99)], NS, sealed=True)
    for n, result in enumerate(results[:4]):
        assert result.payload is not None and bytes(result.payload) == payload(n)
        assert result.sealed_header is not None
        verify_sealed(key(n), NS, result.sealed_header, result.payload, RING)
        with pytest.raises(CorruptBlockError):  # another tenant's ring refuses it
            verify_sealed(key(n), NS, result.sealed_header, result.payload, RING.for_tenant("b"))
    assert results[4].payload is None and results[4].sealed_header is None
    assert all(r.sealed_header is None for r in await store.get(keys, NS))  # unsealed: none


async def test_a_dram_block_changed_since_its_put_is_a_corrupt_miss(store: TieredStore) -> None:
    await store.put([key(1)], [payload(1)], NS)
    tier = arena(store)
    ((offset, size),) = tier.extents(key(1))
    tier.range_view(offset, size)[:PAGE] = np.frombuffer(payload(2), dtype=np.uint8)
    before = store.stats()["counters"]["miss_corrupt"]
    assert [r.payload for r in await store.get([key(1)], NS, sealed=True)] == [None]
    assert store.stats()["counters"]["miss_corrupt"] == before + 1


async def test_a_store_signs_with_its_keyring_else_the_process_s(tmp_path: Path) -> None:
    own, default = make_store(tmp_path / "own", keyring=RING), make_store(None)
    try:
        assert own.keyring is RING
        assert all(tier.keyring is RING for tier in own.tiers)
        assert default.keyring is installed_keyring()
    finally:
        await own.close()
        await default.close()
