"""Tests of :class:`kvstore.store.TieredStore` over a real DRAM arena and a real LMDB directory.

Placement (put lands in DRAM, LRU demotion to NVMe, promotion of NVMe hits), the lookup index,
namespaces, request validation that never alters what is stored, pins, deletion, counters,
restarts on the same NVMe directory and corrupted NVMe blocks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import pytest
import torch
from harness.lmdb_rot import rot_in_file
from harness.store_blocks import MIB, PAGE, key, make_store, payload

from kvstore.block import HEADER_BYTES
from kvstore.errors import CapacityError, InvalidRequestError, NamespaceMismatchError
from kvstore.keys import ChunkHasher, Namespace
from kvstore.store import TieredStore
from kvstore.tiers.nvme import NvmeTier

NS = Namespace(model="test-model").fingerprint()
OTHER_NS = Namespace(model="test-model", tenant="someone-else").fingerprint()


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[TieredStore]:
    s = make_store(tmp_path / "nvme")
    yield s
    await s.close()


async def put_blocks(store: TieredStore, numbers: Sequence[int], length: int = PAGE) -> None:
    for n in numbers:
        result = await store.put([key(n)], [payload(n, length)], NS)
        assert result.stored == 1


async def get_bytes(store: TieredStore, numbers: Sequence[int]) -> list[bytes | None]:
    results = await store.get([key(n) for n in numbers], NS)
    return [None if r.payload is None else bytes(r.payload) for r in results]


def tiers_of(store: TieredStore, numbers: Sequence[int], namespace: bytes = NS) -> list[str]:
    return store.lookup([key(n) for n in numbers], namespace).tiers


async def snapshot(store: TieredStore, numbers: Sequence[int]) -> tuple[Any, ...]:
    """What a request must not change: placement, usage and bytes.

    The bytes are read from the tiers directly, because a get through the store would promote.
    """
    placement = tiers_of(store, numbers)
    stats = store.stats()
    usage = {name: (t["used"], t["blocks"]) for name, t in stats["tiers"].items()}
    by_name = {tier.name: tier for tier in store.tiers}
    data = []
    for n, name in zip(numbers, placement, strict=True):
        block = (await by_name[name].read([key(n)]))[0] if name else None
        data.append(None if block is None else bytes(block.payload))
    return placement, usage, stats["blocks"], data


# --- placement ------------------------------------------------------------------------------


async def test_put_lands_in_dram(store: TieredStore) -> None:
    result = await store.put([key(1)], [payload(1, 5000)], NS)
    assert (result.stored, result.already_present, result.dropped) == (1, 0, 0)
    assert store.lookup([key(1)], NS).tiers == ["dram"]
    [got] = await store.get([key(1)], NS)
    assert got.found and got.tier == "dram"
    assert bytes(got.payload or b"") == payload(1, 5000)
    assert store.stats()["tiers"]["nvme"]["blocks"] == 0


async def test_put_accepts_numpy_and_torch_values(store: TieredStore) -> None:
    array = np.arange(1000, dtype=np.float32)
    tensor = torch.arange(2000, dtype=torch.bfloat16)
    await store.put([key(1), key(2)], [array, tensor], NS)
    first, second = await get_bytes(store, [1, 2])
    assert first == array.tobytes()
    assert second is not None
    assert torch.equal(torch.frombuffer(bytearray(second), dtype=torch.bfloat16), tensor)


async def test_dram_full_demotes_lru_to_nvme(store: TieredStore) -> None:
    await put_blocks(store, range(4))  # dram holds exactly four pages
    assert tiers_of(store, range(4)) == ["dram"] * 4
    await get_bytes(store, [0])  # key 0 becomes most recently used; key 1 is now LRU
    await put_blocks(store, [4])
    assert tiers_of(store, range(5)) == ["dram", "nvme", "dram", "dram", "dram"]
    stats = store.stats()
    assert stats["tiers"]["dram"]["evictions"] == 1
    assert stats["counters"]["demotions"] == 1
    assert stats["tiers"]["nvme"]["blocks"] == 1
    assert stats["blocks"] == 5
    assert await get_bytes(store, range(5)) == [payload(n) for n in range(5)]


async def test_demotion_makes_room_for_a_multi_page_block(store: TieredStore) -> None:
    await put_blocks(store, range(4))
    await store.put([key(9)], [payload(9, 3 * PAGE)], NS)  # needs three LRU blocks to leave
    assert tiers_of(store, [0, 1, 2, 3, 9]) == ["nvme", "nvme", "nvme", "dram", "dram"]
    assert await get_bytes(store, [9]) == [payload(9, 3 * PAGE)]


async def test_nvme_hit_is_returned_and_promoted_after_drain(store: TieredStore) -> None:
    await put_blocks(store, range(5))  # key 0 demoted
    assert tiers_of(store, [0]) == ["nvme"]
    [got] = await store.get([key(0)], NS)
    assert got.tier == "nvme"
    assert bytes(got.payload or b"") == payload(0)
    await store.drain()
    # Promoted into dram (evicting dram's LRU, key 1); the nvme copy is kept (inclusive).
    assert tiers_of(store, [0, 1]) == ["dram", "nvme"]
    stats = store.stats()
    assert stats["counters"]["promotions"] == 1
    assert stats["tiers"]["nvme"]["indexed_blocks"] == 2
    assert stats["tiers"]["nvme"]["hits"] == 1
    [again] = await store.get([key(0)], NS)
    assert again.tier == "dram"
    assert bytes(again.payload or b"") == payload(0)


async def test_demoting_a_promoted_block_reuses_its_nvme_copy(store: TieredStore) -> None:
    await put_blocks(store, range(5))
    await get_bytes(store, [0])
    await store.drain()
    nvme_blocks_before = store.stats()["tiers"]["nvme"]["blocks"]
    demotions_before = store.stats()["counters"]["demotions"]
    await put_blocks(store, [5, 6, 7, 8])  # pushes key 0 out of dram again
    assert tiers_of(store, [0]) == ["nvme"]
    stats = store.stats()
    # Keys 2, 3 and 4 were demoted (written); key 0 was already there, so not re-written.
    assert stats["counters"]["demotions"] - demotions_before == 3
    assert stats["tiers"]["nvme"]["blocks"] == nvme_blocks_before + 3
    assert await get_bytes(store, [0]) == [payload(0)]


async def test_lookup_counts_leading_hits_and_reports_each_tier(store: TieredStore) -> None:
    await put_blocks(store, range(5))  # key 0 in nvme, 1..4 in dram
    result = store.lookup([key(0), key(1), key(77), key(3)], NS)
    assert result.hits == 2
    assert result.tiers == ["nvme", "dram", "", "dram"]
    assert store.lookup([key(77), key(1)], NS).hits == 0
    assert store.lookup([key(n) for n in range(5)], NS).hits == 5
    assert store.lookup([key(4)], NS).tiers == ["dram"]


async def test_get_reports_found_and_missing_per_key(store: TieredStore) -> None:
    await put_blocks(store, range(5))
    results = await store.get([key(77), key(0), key(2), key(2)], NS)
    assert [r.found for r in results] == [False, True, True, True]
    assert [r.tier for r in results] == ["", "nvme", "dram", "dram"]
    assert bytes(results[1].payload or b"") == payload(0)
    assert bytes(results[2].payload or b"") == bytes(results[3].payload or b"") == payload(2)


async def test_put_of_present_key_keeps_the_stored_block(store: TieredStore) -> None:
    await put_blocks(store, [1])
    result = await store.put([key(1), key(2)], [payload(99), payload(2)], NS)
    assert (result.stored, result.already_present) == (1, 1)
    assert await get_bytes(store, [1, 2]) == [payload(1), payload(2)]


# --- namespaces -----------------------------------------------------------------------------


async def test_namespace_mismatch_on_put_stores_nothing_from_the_batch(store: TieredStore) -> None:
    await put_blocks(store, [1])
    before = await snapshot(store, [1])
    with pytest.raises(NamespaceMismatchError, match="namespace"):
        await store.put([key(5), key(1), key(6)], [payload(5), payload(50), payload(6)], OTHER_NS)
    assert await snapshot(store, [1]) == before
    assert store.lookup([key(5)], OTHER_NS).hits == 0
    assert store.lookup([key(6)], NS).hits == 0
    assert [r.found for r in await store.get([key(5), key(6)], OTHER_NS)] == [False, False]
    assert store.stats()["blocks"] == 1
    assert await get_bytes(store, [1]) == [payload(1)]


async def test_get_and_lookup_under_another_namespace_are_misses(store: TieredStore) -> None:
    await put_blocks(store, range(5))  # key 0 in nvme, the rest in dram
    assert store.lookup([key(1), key(2)], OTHER_NS).hits == 0
    assert store.lookup([key(0), key(1)], OTHER_NS).tiers == ["", ""]
    counters = store.stats()["counters"]
    results = await store.get([key(0), key(1), key(2)], OTHER_NS)
    assert [r.found for r in results] == [False, False, False]
    await store.drain()
    after = store.stats()["counters"]
    assert after["namespace_mismatches"] - counters.get("namespace_mismatches", 0) == 3
    assert after["misses"] - counters.get("misses", 0) == 3
    assert after.get("hits", 0) == counters.get("hits", 0)
    # A foreign get neither promoted nor disturbed anything.
    assert tiers_of(store, range(5)) == ["nvme", "dram", "dram", "dram", "dram"]
    assert await get_bytes(store, range(5)) == [payload(n) for n in range(5)]


async def test_same_tokens_in_two_namespaces_get_different_keys(store: TieredStore) -> None:
    tokens = list(range(32))
    mine = ChunkHasher(chunk_size=16, namespace=Namespace(model="a")).keys(tokens)
    theirs = ChunkHasher(chunk_size=16, namespace=Namespace(model="b")).keys(tokens)
    ns_a, ns_b = Namespace(model="a").fingerprint(), Namespace(model="b").fingerprint()
    await store.put(mine, [payload(1), payload(2)], ns_a)
    await store.put(theirs, [payload(3), payload(4)], ns_b)
    assert [bytes(r.payload or b"") for r in await store.get(mine, ns_a)] == [
        payload(1),
        payload(2),
    ]
    assert [bytes(r.payload or b"") for r in await store.get(theirs, ns_b)] == [
        payload(3),
        payload(4),
    ]
    assert store.lookup(mine, ns_b).hits == 0


# --- bad requests change nothing ------------------------------------------------------------


BAD_PUTS: dict[str, tuple[type[Exception], Any]] = {
    "oversized value": (CapacityError, lambda: ([key(10)], [payload(10, 3 * PAGE + 1)], NS)),
    "empty key list": (InvalidRequestError, lambda: ([], [], NS)),
    "short key": (InvalidRequestError, lambda: ([key(10), b"k" * 15], [b"a", b"b"], NS)),
    "long key": (InvalidRequestError, lambda: ([b"k" * 17], [b"a"], NS)),
    "short namespace": (InvalidRequestError, lambda: ([key(10)], [b"a"], NS[:15])),
    "long namespace": (InvalidRequestError, lambda: ([key(10)], [b"a"], NS + b"x")),
    "fewer values": (InvalidRequestError, lambda: ([key(10), key(11)], [b"a"], NS)),
    "more values": (InvalidRequestError, lambda: ([key(10)], [b"a", b"b"], NS)),
    "empty value": (InvalidRequestError, lambda: ([key(10), key(11)], [b"a", b""], NS)),
    "too many keys": (
        InvalidRequestError,
        lambda: ([key(n) for n in range(10, 19)], [b"a"] * 9, NS),
    ),
    "not a buffer": (InvalidRequestError, lambda: ([key(10)], [12345], NS)),
}


@pytest.mark.parametrize("case", sorted(BAD_PUTS))
async def test_bad_put_is_refused_and_changes_nothing(tmp_path: Path, case: str) -> None:
    store = make_store(tmp_path / "nvme", max_block_bytes=3 * PAGE, max_keys_per_request=8)
    try:
        await put_blocks(store, range(6))  # keys 0, 1 in nvme
        before = await snapshot(store, range(6))
        error, request = BAD_PUTS[case]
        keys, values, namespace = request()
        with pytest.raises(error):
            await store.put(keys, values, namespace)
        assert await snapshot(store, range(6)) == before
        assert store.lookup([key(10)], NS).hits == 0
        assert await get_bytes(store, range(6)) == [payload(n) for n in range(6)]
    finally:
        await store.close()


async def test_bad_get_lookup_delete_are_refused(store: TieredStore) -> None:
    await put_blocks(store, range(5))
    before = await snapshot(store, range(5))
    for bad_keys in ([], [b"short"], [key(1), b"x" * 17]):
        with pytest.raises(InvalidRequestError):
            await store.get(bad_keys, NS)
        with pytest.raises(InvalidRequestError):
            store.lookup(bad_keys, NS)
        with pytest.raises(InvalidRequestError):
            await store.delete(bad_keys)
    with pytest.raises(InvalidRequestError, match="namespace"):
        await store.get([key(1)], b"short")
    with pytest.raises(InvalidRequestError, match="namespace"):
        store.lookup([key(1)], b"")
    assert await snapshot(store, range(5)) == before


async def test_batch_larger_than_all_tiers_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    store = make_store(tmp_path / "nvme", nvme_capacity=128 * 1024)
    try:
        await put_blocks(store, range(6))
        before = await snapshot(store, range(6))
        capacity = sum(tier.capacity for tier in store.tiers)
        count = capacity // store.tiers[1].footprint(PAGE) + 1
        numbers = range(100, 100 + count)
        with pytest.raises(CapacityError, match="all tiers"):
            await store.put([key(n) for n in numbers], [payload(n) for n in numbers], NS)
        assert await snapshot(store, range(6)) == before
        assert store.lookup([key(100)], NS).hits == 0
    finally:
        await store.close()


async def test_value_no_tier_can_hold_is_refused(tmp_path: Path) -> None:
    store = make_store(None, dram_pages=2)
    try:
        await put_blocks(store, [1])
        with pytest.raises(CapacityError, match="no tier can hold"):
            await store.put([key(2)], [payload(2, 2 * PAGE + 1)], NS)
        assert await get_bytes(store, [1, 2]) == [payload(1), None]
    finally:
        await store.close()


# --- pins, delete, eviction from the store ---------------------------------------------------


async def test_pinned_blocks_are_not_evicted(store: TieredStore) -> None:
    await put_blocks(store, range(4))
    store.pin([key(0), key(1)])  # the two least recently used
    await put_blocks(store, [4, 5])
    assert tiers_of(store, range(6)) == ["dram", "dram", "nvme", "nvme", "dram", "dram"]
    store.pin([key(0)])  # reference counted: two pins on key 0
    store.unpin([key(0), key(1)])
    await put_blocks(store, [6])
    assert tiers_of(store, [0, 1]) == ["dram", "nvme"]
    store.unpin([key(0)])
    await put_blocks(store, [7])
    assert tiers_of(store, [0]) == ["nvme"]
    assert await get_bytes(store, range(8)) == [payload(n) for n in range(8)]


async def test_put_skips_a_tier_full_of_pinned_blocks(store: TieredStore) -> None:
    await put_blocks(store, range(4))
    store.pin([key(n) for n in range(4)])
    await put_blocks(store, [4])
    assert tiers_of(store, range(5)) == ["dram"] * 4 + ["nvme"]
    assert await get_bytes(store, [4]) == [payload(4)]


async def test_put_is_dropped_when_every_block_is_pinned() -> None:
    store = make_store(None, dram_pages=2)
    try:
        await put_blocks(store, [0, 1])
        store.pin([key(0), key(1)])
        result = await store.put([key(2)], [payload(2)], NS)
        assert (result.stored, result.dropped) == (0, 1)
        assert store.stats()["counters"]["put_dropped"] == 1
        assert tiers_of(store, [0, 1, 2]) == ["dram", "dram", ""]
        assert await get_bytes(store, [0, 1, 2]) == [payload(0), payload(1), None]
    finally:
        await store.close()


async def test_delete_removes_from_every_tier(store: TieredStore) -> None:
    await put_blocks(store, range(5))
    await get_bytes(store, [0])
    await store.drain()  # key 0 now in dram and nvme
    nvme = store.tiers[1]
    assert isinstance(nvme, NvmeTier)
    assert key(0) in nvme
    nvme_used = nvme.used
    assert await store.delete([key(0), key(3), key(404)]) == 2
    assert key(0) not in nvme
    assert nvme.used == nvme_used - nvme.footprint(PAGE)
    assert tiers_of(store, [0, 3]) == ["", ""]
    assert await get_bytes(store, [0, 3, 2]) == [None, None, payload(2)]
    assert await store.delete([key(0)]) == 0
    assert store.stats()["counters"]["deletes"] == 2
    # The key is free again, even for another namespace.
    await store.put([key(0)], [payload(50)], OTHER_NS)
    [got] = await store.get([key(0)], OTHER_NS)
    assert bytes(got.payload or b"") == payload(50)


async def test_delete_while_promotion_is_pending(store: TieredStore) -> None:
    await put_blocks(store, range(5))
    [got] = await store.get([key(0)], NS)  # schedules a promotion of key 0
    assert got.tier == "nvme"
    assert await store.delete([key(0)]) == 1
    await store.drain()
    assert tiers_of(store, [0]) == [""]
    assert await get_bytes(store, [0]) == [None]
    assert store.stats()["counters"].get("promotions", 0) == 0


async def test_delete_survives_a_read_that_finds_the_block_gone_meanwhile(
    store: TieredStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A get that reads a block the delete already removed from nvme drops its entry first.

    Found by a churn test over a real server: the delete then failed with INTERNAL (KeyError).
    """
    await put_blocks(store, range(5))  # key 0 is only in nvme
    nvme = store.tiers[1]
    removing = asyncio.Event()
    go_on = asyncio.Event()
    remove = nvme.remove

    async def slow_remove(keys: Sequence[bytes]) -> bool:
        done = await remove(keys)
        removing.set()
        await go_on.wait()
        return done

    monkeypatch.setattr(nvme, "remove", slow_remove)
    deleting = asyncio.ensure_future(store.delete([key(0)]))
    await removing.wait()
    assert await get_bytes(store, [0]) == [None]  # finds it gone, forgets it
    go_on.set()
    assert await deleting == 1
    assert tiers_of(store, [0]) == [""]


async def test_block_evicted_from_the_last_tier_leaves_the_store(tmp_path: Path) -> None:
    store = make_store(tmp_path / "nvme", nvme_capacity=128 * 1024)
    try:
        total = 40
        await put_blocks(store, range(total))
        stats = store.stats()
        evicted = stats["counters"]["evicted_from_store"]
        assert evicted > 0
        assert stats["blocks"] == total - evicted
        assert stats["tiers"]["nvme"]["evictions"] >= evicted
        for name, tier in stats["tiers"].items():
            assert tier["used"] <= tier["capacity"], name
            assert tier["indexed_blocks"] == tier["blocks"], name
        assert tiers_of(store, [0]) == [""]
        assert await get_bytes(store, [0]) == [None]
        assert tiers_of(store, [total - 1]) == ["dram"]
        present = [n for n in range(total) if tiers_of(store, [n]) != [""]]
        assert len(present) == stats["blocks"]
        assert present == list(range(total - len(present), total)), "LRU order is kept"
        assert await get_bytes(store, present) == [payload(n) for n in present]
    finally:
        await store.close()


async def test_single_tier_store_evicts_out_of_the_store() -> None:
    store = make_store(None, dram_pages=2)
    try:
        await put_blocks(store, range(3))
        assert tiers_of(store, range(3)) == ["", "dram", "dram"]
        assert store.stats()["counters"]["evicted_from_store"] == 1
        assert store.stats()["counters"].get("demotions", 0) == 0
    finally:
        await store.close()


# --- stats ------------------------------------------------------------------------------------


async def test_stats_counters(store: TieredStore) -> None:
    await store.put([key(0), key(1)], [payload(0, 100), payload(1, 200)], NS)
    await store.put([key(1)], [payload(1, 200)], NS)
    await put_blocks(store, [2, 3, 4])  # key 0 demoted
    await store.get([key(0), key(1), key(99)], NS)
    await store.drain()
    store.lookup([key(0)], NS)
    store.lookup([key(1)], NS)
    await store.delete([key(4)])
    stats = store.stats()
    counters = stats["counters"]
    assert counters["puts"] == 5
    assert counters["blocks_put"] == 5
    assert counters["bytes_put"] == 100 + 200 + 200 + 3 * PAGE
    assert counters["gets"] == 1
    assert counters["hits"] == 2
    assert counters["misses"] == 1
    assert counters["lookups"] == 2
    assert counters["deletes"] == 1
    assert counters["demotions"] >= 1
    assert counters["promotions"] == 1
    assert stats["blocks"] == 4
    dram, nvme = stats["tiers"]["dram"], stats["tiers"]["nvme"]
    assert dram["hits"] == 1 and nvme["hits"] == 1
    assert dram["capacity"] == 4 * PAGE
    assert dram["used"] <= dram["capacity"]
    assert dram["wasted_bytes"] == dram["used"] - dram["payload_bytes"]
    assert nvme["corrupt_blocks"] == 0
    assert dram["indexed_blocks"] == dram["blocks"]
    assert nvme["indexed_blocks"] == nvme["blocks"]


# --- restart and corruption -------------------------------------------------------------------


async def test_restart_finds_nvme_blocks(tmp_path: Path) -> None:
    path = tmp_path / "nvme"
    first = make_store(path)
    await put_blocks(first, range(7))  # keys 0..2 demoted to nvme, 3..6 only in dram
    assert tiers_of(first, range(7)) == ["nvme"] * 3 + ["dram"] * 4
    await first.close()

    second = make_store(path)
    try:
        assert second.load_index() == 3
        assert tiers_of(second, range(7)) == ["nvme"] * 3 + [""] * 4
        assert second.lookup([key(n) for n in range(7)], NS).hits == 3
        assert second.lookup([key(0)], OTHER_NS).hits == 0  # namespaces survive too
        assert await get_bytes(second, range(4)) == [payload(0), payload(1), payload(2), None]
        await second.drain()
        assert second.stats()["counters"]["promotions"] == 3
        with pytest.raises(NamespaceMismatchError):
            await second.put([key(1)], [payload(1)], OTHER_NS)
    finally:
        await second.close()


def corrupt_in_lmdb(path: Path, k: bytes, index: int) -> None:
    env = lmdb.open(str(path), map_size=8 * MIB)
    try:
        with env.begin(write=True) as txn:
            stored = txn.get(k)
            assert stored is not None
            value = bytearray(stored)
            value[index] ^= 0x01
            txn.put(k, bytes(value))
    finally:
        env.close()


async def test_corrupt_nvme_block_after_restart_is_a_miss(tmp_path: Path) -> None:
    path = tmp_path / "nvme"
    first = make_store(path)
    await put_blocks(first, range(6))  # keys 0, 1 in nvme
    await first.close()
    corrupt_in_lmdb(path, key(1), HEADER_BYTES + 1234)

    second = make_store(path)
    try:
        assert second.load_index() == 2  # the header is intact; only a read can tell
        assert second.lookup([key(0), key(1)], NS).hits == 2
        results = await second.get([key(0), key(1)], NS)
        assert bytes(results[0].payload or b"") == payload(0)
        assert results[1].payload is None
        await second.drain()
        assert second.stats()["tiers"]["nvme"]["corrupt_blocks"] == 1
        assert second.lookup([key(0), key(1)], NS).hits == 1
        assert second.lookup([key(1)], NS).tiers == [""]
        assert second.stats()["blocks"] == 1
        # The key can be stored again, and then reads back right.
        await second.put([key(1)], [payload(1)], NS)
        assert await get_bytes(second, [1]) == [payload(1)]
    finally:
        await second.close()


async def test_live_corruption_of_an_nvme_block_is_a_miss(
    store: TieredStore, tmp_path: Path
) -> None:
    await put_blocks(store, range(5))  # key 0 in nvme only
    assert rot_in_file(tmp_path / "nvme" / "data.mdb", payload(0)[2000:2100]) >= 1
    assert store.lookup([key(0)], NS).hits == 1
    assert await get_bytes(store, [0, 1]) == [None, payload(1)]
    await store.drain()
    assert store.lookup([key(0)], NS).hits == 0
    assert store.stats()["tiers"]["nvme"]["corrupt_blocks"] == 1
    assert store.stats()["tiers"]["nvme"]["blocks"] == 0


async def test_nothing_comes_back_after_deleting_everything_and_restarting(
    tmp_path: Path,
) -> None:
    # A 32 KiB map is so full that LMDB may refuse even a delete (it needs pages to copy the
    # B-tree). Then the delete must say so and keep the block visible, never report it gone and
    # let it come back at the next restart.
    path = tmp_path / "nvme"
    first = make_store(path, dram_pages=2, nvme_capacity=32 * 1024)
    await put_blocks(first, range(8), length=3000)
    present = [t for t in first.lookup([key(n) for n in range(8)], NS).tiers if t]
    removed = await first.delete([key(n) for n in range(8)])
    still_there = [t for t in first.lookup([key(n) for n in range(8)], NS).tiers if t]
    assert removed + len(still_there) == len(present)
    assert removed > 0
    await first.close()

    second = make_store(path, dram_pages=2, nvme_capacity=32 * 1024)
    try:
        assert second.load_index() == len(still_there)
        found = [value is not None for value in await get_bytes(second, range(8))]
        assert sum(found) == len(still_there)
    finally:
        await second.close()


async def test_lmdb_map_full_is_handled_by_eviction_not_an_error(tmp_path: Path) -> None:
    # 256 KiB blocks in a 1 MiB map: LMDB fills before the tier's estimate, and space a delete
    # frees is reusable only two transactions later, so the store has to evict and retry.
    block = 256 * 1024
    store = make_store(tmp_path / "nvme", nvme_capacity=1 * MIB)
    try:
        for n in range(8):
            result = await store.put([key(n)], [payload(n, block)], NS)
            assert (result.stored, result.dropped) == (1, 0)
            assert tiers_of(store, [n]) == ["nvme"]
            nvme = store.stats()["tiers"]["nvme"]
            assert nvme["used"] <= nvme["capacity"]
            assert nvme["write_errors"] == 0
            assert nvme["indexed_blocks"] == nvme["blocks"] >= 1
        present = [n for n in range(8) if tiers_of(store, [n]) == ["nvme"]]
        assert present[-1] == 7
        assert await get_bytes(store, present) == [payload(n, block) for n in present]
        assert store.stats()["counters"]["evicted_from_store"] == 8 - len(present)
    finally:
        await store.close()


async def test_pin_taken_during_an_eviction_protects_the_block(store: TieredStore) -> None:
    await put_blocks(store, range(4))
    put = asyncio.ensure_future(store.put([key(9)], [payload(9, 3 * PAGE)], NS))
    await asyncio.sleep(0)  # sleep: one loop turn: the put is writing key 0 to nvme
    assert not put.done()
    store.pin([key(2)])
    await put
    assert tiers_of(store, [2]) == ["dram"]


# --- concurrency ----------------------------------------------------------------------------


async def test_concurrent_requests_never_return_wrong_bytes(store: TieredStore) -> None:
    async def writer(offset: int) -> None:
        for n in range(offset, offset + 12):
            await store.put([key(n)], [payload(n, (n % 3 + 1) * PAGE - n)], NS)

    async def reader() -> list[tuple[int, bytes]]:
        seen: list[tuple[int, bytes]] = []
        for _ in range(30):
            numbers = list(range(0, 36, 2))
            for n, value in zip(numbers, await get_bytes(store, numbers), strict=True):
                if value is not None:
                    seen.append((n, value))
            await asyncio.sleep(0)
        return seen

    async def deleter() -> None:
        for n in range(0, 36, 5):
            await store.delete([key(n)])
            await asyncio.sleep(0)

    outcome = await asyncio.gather(writer(0), writer(12), writer(24), reader(), reader(), deleter())
    await store.drain()
    for seen in outcome[3:5]:
        for n, value in seen:
            assert value == payload(n, (n % 3 + 1) * PAGE - n)
    stats = store.stats()
    for tier in stats["tiers"].values():
        assert tier["used"] <= tier["capacity"]
        assert tier["indexed_blocks"] == tier["blocks"]
    numbers = list(range(36))
    for n, found in zip(numbers, await get_bytes(store, numbers), strict=True):
        assert found is None or found == payload(n, (n % 3 + 1) * PAGE - n)


async def test_persist_saves_dram_only_blocks_for_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "nvme"
    first = make_store(path, dram_pages=4)
    await put_blocks(first, range(6))  # two demoted to nvme, four only in dram
    assert tiers_of(first, range(6)).count("dram") == 4
    assert await first.persist(budget_s=30.0) == 4
    assert await first.persist(budget_s=30.0) == 0  # nothing left to save
    await first.close()

    second = make_store(path, dram_pages=4)
    try:
        assert second.load_index() == 6
        assert await get_bytes(second, range(6)) == [payload(n) for n in range(6)]
    finally:
        await second.close()


async def test_persist_without_a_persistent_tier_saves_nothing() -> None:
    store = make_store(None, dram_pages=4)
    try:
        await put_blocks(store, range(2))
        assert await store.persist(budget_s=30.0) == 0
    finally:
        await store.close()
