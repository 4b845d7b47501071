"""``TieredStore`` with an ``hbm`` tier above dram and nvme.

The hbm tier runs on a CPU tensor here (its code is device-independent but for the copies; the
tier tests cover CUDA where a device exists). What is checked is the store's use of a device tier:
new blocks start in dram, blocks read again move up into hbm, the arena and prefetch stay dram,
and evicting from hbm never loses a block.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
from store_blocks import PAGE, key, payload

from kvstore.keys import Namespace
from kvstore.store import TieredStore
from kvstore.tiers.dram import DramLease, DramTier
from kvstore.tiers.hbm import HbmTier
from kvstore.tiers.nvme import NvmeTier

NS = Namespace(model="hbm-test").fingerprint()


def tiers_of(store: TieredStore, numbers: list[int]) -> list[str]:
    return store.lookup([key(n) for n in numbers], NS).tiers


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[TieredStore]:
    s = TieredStore(
        [
            HbmTier(2 * PAGE, page_size=PAGE, device="cpu"),
            DramTier(4 * PAGE, page_size=PAGE),
            NvmeTier(tmp_path / "nvme", 1024**2),
        ]
    )
    yield s
    await s.close()


def test_device_tiers_must_come_first(tmp_path: Path) -> None:
    hbm = HbmTier(PAGE, page_size=PAGE, device="cpu")
    with pytest.raises(ValueError, match="device tiers"):
        TieredStore([DramTier(4 * PAGE, page_size=PAGE), hbm])
    with pytest.raises(ValueError, match="device tiers"):
        TieredStore([hbm])  # no host tier to put new blocks in


async def test_puts_land_in_dram_and_reads_promote_into_hbm(store: TieredStore) -> None:
    await store.put([key(1), key(2)], [payload(1), payload(2)], NS)
    assert tiers_of(store, [1, 2]) == ["dram", "dram"]
    assert store.arena is store.tiers[1]
    got = await store.get([key(1)], NS)
    assert (got[0].tier, got[0].payload) == ("dram", payload(1))
    await store.drain()
    assert tiers_of(store, [1, 2]) == ["hbm", "dram"]
    got = await store.get([key(1)], NS)
    assert (got[0].tier, bytes(got[0].payload or b"")) == ("hbm", payload(1))
    assert store.stats()["tiers"]["hbm"]["hits"] == 1


async def test_a_full_hbm_evicts_without_losing_blocks(store: TieredStore) -> None:
    numbers = [1, 2, 3]
    await store.put([key(n) for n in numbers], [payload(n) for n in numbers], NS)
    for n in numbers:  # each read promotes; the third evicts the least recent from hbm
        await store.get([key(n)], NS)
        await store.drain()
    assert tiers_of(store, numbers) == ["dram", "hbm", "hbm"]
    got = await store.get([key(n) for n in numbers], NS)
    assert [bytes(g.payload or b"") for g in got] == [payload(n) for n in numbers]


async def test_prefetch_and_leases_target_dram_even_for_hbm_blocks(store: TieredStore) -> None:
    await store.put([key(1)], [payload(1)], NS)
    await store.get([key(1)], NS)
    await store.drain()
    assert tiers_of(store, [1]) == ["hbm"]
    # Push key 1 out of dram (LRU) while it stays in hbm: 4 newer blocks fill the arena.
    await store.put([key(n) for n in range(10, 14)], [payload(n) for n in range(10, 14)], NS)
    assert key(1) not in store.tiers[1]
    assert key(1) in store.tiers[0]
    assert await store.promote([key(1)], NS) == ["ready"]
    assert key(1) in store.tiers[1]
    acquired = await store.acquire([key(1)], NS)
    lease = acquired[0]
    assert isinstance(lease, DramLease)
    arena = store.tiers[1]
    assert isinstance(arena, DramTier)
    data = b"".join(bytes(arena.range_view(offset, size)) for offset, size in lease.ranges)
    assert data == payload(1)
    store.release([lease])


async def test_shared_memory_writes_go_to_the_arena(store: TieredStore) -> None:
    reserved = await store.reserve([key(5)], [PAGE], NS)
    reservation = reserved[0]
    assert reservation is not None and reservation != "present"
    arena = store.tiers[1]
    assert isinstance(arena, DramTier)
    offset, size = reservation.ranges[0]
    arena.range_view(offset, size)[:] = np.frombuffer(payload(5), dtype=np.uint8)
    assert (await store.commit([(key(5), reservation)], NS)).stored == 1
    assert tiers_of(store, [5]) == ["dram"]


async def test_graceful_shutdown_saves_hbm_only_blocks(tmp_path: Path) -> None:
    hbm = HbmTier(2 * PAGE, page_size=PAGE, device="cpu")
    dram = DramTier(PAGE, page_size=PAGE)
    store = TieredStore([hbm, dram, NvmeTier(tmp_path / "nvme", 1024**2)])
    await store.put([key(1)], [payload(1)], NS)
    await store.get([key(1)], NS)
    await store.drain()
    await store.put([key(2)], [payload(2)], NS)  # evicts 1 from dram into nvme; hbm keeps it
    assert tiers_of(store, [1, 2]) == ["hbm", "dram"]
    assert await store.persist(5.0) >= 1
    await store.close()
    reopened = TieredStore([DramTier(PAGE, page_size=PAGE), NvmeTier(tmp_path / "nvme", 1024**2)])
    assert reopened.load_index() == 2
    got = await reopened.get([key(1), key(2)], NS)
    assert [bytes(g.payload or b"") for g in got] == [payload(1), payload(2)]
    await reopened.close()
