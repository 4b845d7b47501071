"""Retention that survives a restart (:mod:`kvstore.store.retention_journal`), on real LMDB
directories: a store closed and opened again on the same nvme directory gives its retained blocks
their deadlines back, forgets those whose time ran out or whose block is gone, caps what it
restores by its own maximum, and leaves records of a later version where they are."""

from __future__ import annotations

import struct
import time
from pathlib import Path

import lmdb
from harness.store_blocks import PAGE, key, payload

from kvstore.keys import Namespace
from kvstore.policy import Policy
from kvstore.retention import Retention
from kvstore.store import TieredStore
from kvstore.tiers.dram import DramTier
from kvstore.tiers.nvme import NvmeTier
from kvstore.tiers.nvme_retention import RetentionRecords

NS = Namespace(model="retention-journal").fingerprint()


def open_store(path: Path, max_retention_s: float = 7200) -> TieredStore:
    store = TieredStore(
        [DramTier(4 * PAGE, page_size=PAGE), NvmeTier(path, 1024**2)],
        policy=Policy(max_retention_s=max_retention_s),
    )
    store.load_index()
    return store


def retained(store: TieredStore) -> dict[str, int]:
    tiers = store.stats()["tiers"]
    return {name: tiers[name]["retained_blocks"] for name in ("dram", "nvme")}


async def test_retained_blocks_keep_their_deadlines_across_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "nvme"
    store = open_store(path)
    await store.put([key(1), key(2)], [payload(1), payload(2)], NS, retention=Retention(3600))
    await store.put([key(3)], [payload(3)], NS, retention=Retention(60))
    await store.put([key(4)], [payload(4)], NS)  # plain
    await store.persist(5.0)  # what a graceful stop does: memory-only blocks go to disk
    await store.close()
    # Key 3's retention ran out while the store was down (its record says it ended a second ago).
    records = RetentionRecords(path / "retention")
    assert set(records.load()) == {key(1), key(2), key(3)}
    records.write({key(3): (time.time() - 1, 60.0)})
    records.close()

    store = open_store(path)
    try:
        assert retained(store)["nvme"] == 2
        index = store._index
        assert set(index.retained) == {key(1), key(2)}
        assert store.tier_of(key(3)) == "nvme"  # still stored, plain LRU now
        until, window = index.retained[key(1)]
        assert window == 3600 and 3590 < until - time.monotonic() <= 3600
        # Flooded: the retained ones stay, the plain one goes.
        for n in range(100, 100 + 400):
            await store.put([key(n)], [payload(n)], NS)
        assert store.tier_of(key(1)) is not None and store.tier_of(key(2)) is not None
        assert store.tier_of(key(4)) is None
    finally:
        await store.close()
    # Key 3's record is gone from disk too.
    records = RetentionRecords(path / "retention")
    assert set(records.load()) == {key(1), key(2)}
    records.close()


async def test_a_restart_caps_restored_deadlines_and_keeps_later_records(tmp_path: Path) -> None:
    path = tmp_path / "nvme"
    store = open_store(path)
    await store.put([key(1)], [payload(1)], NS, retention=Retention(7200))
    await store.persist(5.0)
    await store.close()
    with lmdb.open(str(path / "retention"), map_size=1 << 20) as env, env.begin(write=True) as txn:
        txn.put(key(9), struct.pack("<Hdd", 2, time.time() + 60, 60.0) + b"later fields")

    store = open_store(path, max_retention_s=600)  # the operator lowered the maximum
    try:
        until, window = store._index.retained[key(1)]
        assert window == 600 and until - time.monotonic() <= 600
    finally:
        await store.close()
    records = RetentionRecords(path / "retention")
    assert key(1) in records.load() and records.newer == 1
    records.close()
    with lmdb.open(str(path / "retention"), map_size=1 << 20) as env, env.begin() as txn:
        assert txn.get(key(9)) is not None  # a later release's record, left in place
