"""Tests of :mod:`kvstore.store.landing`: a remote source receiving blocks straight into reserved
pages of the dram arena during a promotion (an acquire), which then become blocks in place.

The remote source here is a real :class:`~kvstore.store.remote.RemoteSource` of its own (the
cluster's peers need Redis and other nodes: tests/integration/test_peer_ucx.py covers them); the
store and its arena are real, read back through the arena's memfd as a client that mapped it.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from harness.store_blocks import PAGE, arena, key, make_store, payload

from kvstore.keys import Namespace
from kvstore.store import TieredStore, landing
from kvstore.store.remote import Landing
from kvstore.tiers.dram import DramLease

NS = Namespace(model="landing-test").fingerprint()


class Source:
    """Serves ``blocks``, into the landing's buffers where it offers them. Keys in ``fail`` are
    received into a buffer and then lost (a failed transfer: abandoned); keys in ``refuse`` are
    received and then not served (a check that failed)."""

    name = "peer"

    def __init__(self, blocks: dict[bytes, bytes]) -> None:
        self.blocks = blocks
        self.fail: set[bytes] = set()
        self.refuse: set[bytes] = set()
        self.landings: list[Landing | None] = []
        self.offered: list[bool] = []

    async def read(
        self, keys: Sequence[bytes], namespace: bytes, landing: Landing | None = None
    ) -> tuple[list[bytes | None], dict[int, str]]:
        self.landings.append(landing)
        lengths = [len(self.blocks[k]) for k in keys]
        buffers: list[Any] = [None] * len(keys)
        if landing is not None:
            buffers = await landing.buffers(keys, lengths)
        self.offered += [buffer is not None for buffer in buffers]
        payloads: list[Any] = []
        for k, buffer in zip(keys, buffers, strict=True):
            data = self.blocks[k]
            if buffer is None:
                payloads.append(None if k in self.fail | self.refuse else data)
                continue
            assert len(buffer) == len(data)
            np.frombuffer(memoryview(buffer), dtype=np.uint8)[:] = np.frombuffer(data, np.uint8)
            if k in self.fail:
                assert landing is not None
                landing.abandon([k])
                payloads.append(None)
            else:
                payloads.append(None if k in self.refuse else buffer)
        return payloads, {}


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[TieredStore]:
    s = make_store(None, dram_pages=8)
    yield s
    await s.close()


def mapped(store: TieredStore, lease: DramLease) -> bytes:
    fd = arena(store).fd
    return b"".join(os.pread(fd, size, offset) for offset, size in lease.ranges)


async def test_an_acquire_receives_remote_blocks_in_place_and_serves_them(
    store: TieredStore,
) -> None:
    blocks = {key(n): payload(n, 2 * PAGE) for n in range(3)}
    source = Source(blocks)
    store.set_remote_source(source)
    keys = list(blocks)
    acquired = await store.acquire(keys, NS)
    assert all(isinstance(item, DramLease) for item in acquired)
    assert [mapped(store, item) for item in acquired if isinstance(item, DramLease)] == [
        blocks[k] for k in keys
    ]
    assert source.offered == [True, True, True]
    counters = store.stats()["counters"]
    assert counters["landed_blocks"] == 3
    assert counters["promotions"] == 3
    store.release([item for item in acquired if isinstance(item, DramLease)])
    assert arena(store).stats()["reserved_bytes"] == 0
    # Held here now, checksummed: a get reads them from dram, not from the source again.
    got = await store.get(keys, NS)
    assert [bytes(r.payload) for r in got if r.payload is not None] == [blocks[k] for k in keys]
    assert {r.tier for r in got} == {"dram"}
    assert len(source.landings) == 1


async def test_a_get_never_lands_remote_blocks_in_the_arena(store: TieredStore) -> None:
    """A get hands its payloads to the caller at once: they must not be uninstalled pages."""
    blocks = {key(n): payload(n) for n in range(2)}
    source = Source(blocks)
    store.set_remote_source(source)
    got = await store.get(list(blocks), NS)
    assert [r.payload for r in got] == list(blocks.values())
    assert source.landings == [None]
    await store.drain()
    counters = store.stats()["counters"]
    assert counters.get("landed_blocks", 0) == 0
    # The source is no tier of the stack: its measured read rate rides in the counters.
    assert counters["peer_read_bytes_per_s"] > 0 and "peer_read_latency_us" in counters


async def test_blocks_not_served_give_their_pages_back_and_a_failed_transfer_only_later(
    store: TieredStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocks = {key(n): payload(n) for n in range(3)}
    lost, refused, good = list(blocks)
    source = Source(blocks)
    source.fail, source.refuse = {lost}, {refused}
    store.set_remote_source(source)
    monkeypatch.setattr(landing, "ABANDON_S", 3600.0)
    acquired = await store.acquire([lost, refused, good], NS)
    assert acquired[0] is None and acquired[1] is None
    assert isinstance(acquired[2], DramLease)
    assert mapped(store, acquired[2]) == blocks[good]
    store.release([acquired[2]])
    # The refused block's pages came back at once; the lost one's stay reserved (a late byte of
    # its transfer must not land in a block that reuses them).
    assert arena(store).stats()["reserved_bytes"] == PAGE
    assert store.stats()["counters"]["landed_blocks"] == 1

    monkeypatch.setattr(landing, "ABANDON_S", 0.0)
    source.fail = {key(9)}
    blocks[key(9)] = payload(9)
    assert (await store.acquire([key(9)], NS)) == [None]
    for _ in range(3):
        await asyncio.sleep(0)  # the abandoned pages come back on the loop's next turn
    assert arena(store).stats()["reserved_bytes"] == PAGE  # only the first lost block's


async def test_a_block_the_arena_cannot_take_whole_is_received_elsewhere_and_copied(
    tmp_path: Path,
) -> None:
    store = make_store(None, dram_pages=2)
    try:
        blocks = {key(1): payload(1, 3 * PAGE), key(2): payload(2, PAGE)}
        source = Source(blocks)
        store.set_remote_source(source)
        acquired = await store.acquire(list(blocks), NS)
        assert source.offered[:2] == [False, True]  # 3 pages never fit a 2-page arena
        assert acquired[0] == blocks[key(1)]  # served as bytes, as any block without room
        assert isinstance(acquired[1], DramLease)
        assert mapped(store, acquired[1]) == blocks[key(2)]
        store.release([acquired[1]])
    finally:
        await store.close()
