"""``TieredStore`` with an ``hbm`` tier above dram and nvme.

The hbm tier runs on a CPU tensor here (its code is device-independent but for the copies; the
tier tests cover CUDA where a device exists). What is checked is the store's use of a device tier:
new blocks start in dram, blocks read ``promote_after_reads`` times (the policy; default 2) move
up into hbm and blocks read fewer times stay below it, the arena and prefetch stay dram, and
evicting from hbm never loses a block.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
from harness.store_blocks import PAGE, key, payload

from kvstore.config import ConfigError, load_config
from kvstore.keys import Namespace
from kvstore.policy import Policy
from kvstore.server.app import build_store
from kvstore.store import TieredStore
from kvstore.tiers.dram import DramLease, DramTier
from kvstore.tiers.hbm import HbmTier
from kvstore.tiers.nvme import NvmeTier

NS = Namespace(model="hbm-test").fingerprint()


def tiers_of(store: TieredStore, numbers: list[int]) -> list[str]:
    return store.lookup([key(n) for n in numbers], NS).tiers


async def read(store: TieredStore, numbers: list[int], times: int = 1) -> None:
    """Get ``numbers`` ``times`` times, each get's background promotions finished."""
    for _ in range(times):
        got = await store.get([key(n) for n in numbers], NS)
        assert [bytes(g.payload or b"") for g in got] == [payload(n) for n in numbers]
        await store.drain()


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


async def test_puts_land_in_dram_and_a_second_read_promotes_into_hbm(store: TieredStore) -> None:
    await store.put([key(1), key(2)], [payload(1), payload(2)], NS)
    assert tiers_of(store, [1, 2]) == ["dram", "dram"]
    assert store.arena is store.tiers[1]
    got = await store.get([key(1)], NS)
    assert (got[0].tier, got[0].payload) == ("dram", payload(1))
    await store.drain()
    assert tiers_of(store, [1, 2]) == ["dram", "dram"]  # read once: not hot enough for hbm
    await read(store, [1])
    assert tiers_of(store, [1, 2]) == ["hbm", "dram"]
    got = await store.get([key(1)], NS)
    assert (got[0].tier, bytes(got[0].payload or b"")) == ("hbm", payload(1))
    assert store.stats()["tiers"]["hbm"]["hits"] == 1


async def test_promote_after_reads_is_the_policy(tmp_path: Path) -> None:
    store = TieredStore(
        [
            HbmTier(2 * PAGE, page_size=PAGE, device="cpu"),
            DramTier(PAGE, page_size=PAGE),
            NvmeTier(tmp_path / "nvme", 1024**2),
        ],
        policy=Policy(promote_after_reads=3),
    )
    await store.put([key(1)], [payload(1)], NS)
    await store.put([key(2)], [payload(2)], NS)  # pushes 1 out of the one-page dram into nvme
    assert tiers_of(store, [1, 2]) == ["nvme", "dram"]
    await read(store, [1])  # read from nvme: promoted into dram only
    assert tiers_of(store, [1, 2]) == ["dram", "nvme"]
    await read(store, [1])
    assert tiers_of(store, [1]) == ["dram"]
    await read(store, [1])  # the third read
    assert tiers_of(store, [1]) == ["hbm"]
    await store.close()


async def test_blocks_read_once_do_not_churn_a_small_pool(store: TieredStore) -> None:
    await store.put([key(1), key(2)], [payload(1), payload(2)], NS)
    await read(store, [1, 2], times=2)
    assert tiers_of(store, [1, 2]) == ["hbm", "hbm"]  # the pool (two pages) is full of hot blocks
    numbers = list(range(10, 16))
    for n in numbers:  # a stream of blocks, each read once
        await store.put([key(n)], [payload(n)], NS)
        await read(store, [n])
    assert tiers_of(store, [1, 2]) == ["hbm", "hbm"]  # still there: nothing evicted them
    assert store.stats()["tiers"]["hbm"]["evictions"] == 0


async def test_blocks_in_one_or_several_arena_runs_promote_intact(store: TieredStore) -> None:
    await store.put([key(n) for n in range(1, 5)], [payload(n) for n in range(1, 5)], NS)
    await store.delete([key(2), key(4)], NS)
    await store.put([key(9)], [payload(9, 2 * PAGE)], NS)  # pages 2 and 4: two runs
    await read(store, [1], times=2)  # one run: copied from the arena pages themselves
    got = await store.get([key(9)], NS)
    assert bytes(got[0].payload or b"") == payload(9, 2 * PAGE)
    await store.drain()
    await store.get([key(9)], NS)
    await store.drain()
    assert tiers_of(store, [1, 9]) == ["dram", "hbm"]  # 9 took both hbm pages, evicting 1
    got = await store.get([key(9), key(1)], NS)
    assert [(g.tier, bytes(g.payload or b"")) for g in got] == [
        ("hbm", payload(9, 2 * PAGE)),
        ("dram", payload(1)),
    ]


async def test_read_counts_live_and_die_with_the_index_entry(tmp_path: Path) -> None:
    store = TieredStore(
        [HbmTier(2 * PAGE, page_size=PAGE, device="cpu"), DramTier(PAGE, page_size=PAGE)]
    )
    await store.put([key(1)], [payload(1)], NS)
    await read(store, [1])
    await store.put([key(2)], [payload(2)], NS)  # the one-page dram drops 1: it leaves the store
    assert tiers_of(store, [1]) == [""]
    await store.put([key(1)], [payload(1)], NS)
    await read(store, [1])  # counted from zero again: one read, not two
    assert tiers_of(store, [1]) == ["dram"]
    await store.close()


def test_promote_after_reads_setting() -> None:
    env = {"KVSTORE_NVME_PATH": "", "KVSTORE_DRAM_CAPACITY": "1MiB"}
    assert load_config(env=env).hbm.promote_after_reads == 2
    three = load_config(env={**env, "KVSTORE_HBM_PROMOTE_AFTER_READS": "3"})
    assert build_store(three).policy.promote_after_reads == 3
    with pytest.raises(ConfigError, match=r"hbm.promote_after_reads must be .*>= 1.*got 0"):
        load_config(env={**env, "KVSTORE_HBM_PROMOTE_AFTER_READS": "0"})
    with pytest.raises(ConfigError, match=r"hbm.promote_after_reads.*'two'.*whole number"):
        load_config(env={**env, "KVSTORE_HBM_PROMOTE_AFTER_READS": "two"})


async def test_a_full_hbm_evicts_without_losing_blocks(store: TieredStore) -> None:
    numbers = [1, 2, 3]
    await store.put([key(n) for n in numbers], [payload(n) for n in numbers], NS)
    for n in numbers:  # each second read promotes; the third evicts the least recent from hbm
        await read(store, [n], times=2)
    assert tiers_of(store, numbers) == ["dram", "hbm", "hbm"]
    got = await store.get([key(n) for n in numbers], NS)
    assert [bytes(g.payload or b"") for g in got] == [payload(n) for n in numbers]


async def test_prefetch_and_leases_target_dram_even_for_hbm_blocks(store: TieredStore) -> None:
    await store.put([key(1)], [payload(1)], NS)
    await read(store, [1], times=2)
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
    await read(store, [1], times=2)
    await store.put([key(2)], [payload(2)], NS)  # evicts 1 from dram into nvme; hbm keeps it
    assert tiers_of(store, [1, 2]) == ["hbm", "dram"]
    assert await store.persist(5.0) >= 1
    await store.close()
    reopened = TieredStore([DramTier(PAGE, page_size=PAGE), NvmeTier(tmp_path / "nvme", 1024**2)])
    assert reopened.load_index() == 2
    got = await reopened.get([key(1), key(2)], NS)
    assert [bytes(g.payload or b"") for g in got] == [payload(1), payload(2)]
    await reopened.close()
