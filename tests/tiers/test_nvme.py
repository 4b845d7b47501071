"""Tests of :class:`kvstore.tiers.nvme.NvmeTier` on real LMDB directories.

Blocks survive closing and reopening the environment; bytes that rot on disk (changed here through
a separate LMDB handle, or by writing into ``data.mdb`` directly) are never returned but deleted
and counted; a full LMDB map makes ``write`` return False instead of raising; and a directory that
is not an LMDB environment is moved aside so that the tier starts empty.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import lmdb
import numpy as np
import pytest
from harness.lmdb_rot import rot_in_file

from kvstore.block import HEADER_BYTES, BlockHeader, WireHeader, encode_header
from kvstore.tiers.nvme import NvmeTier

NS = bytes(range(100, 116))
MIB = 1024**2


def key(n: int) -> bytes:
    return n.to_bytes(2, "little") * 8


def payload(n: int, length: int) -> bytes:
    return np.random.default_rng(n).integers(0, 256, size=length, dtype=np.uint8).tobytes()


async def put(tier: NvmeTier, k: bytes, data: bytes) -> bool:
    return await tier.write(BlockHeader.for_payload(k, NS, data), data)


async def read_bytes(tier: NvmeTier, k: bytes) -> bytes | None:
    block = (await tier.read([k]))[0]
    return None if block is None else bytes(block.payload)


def raw_values(path: Path) -> dict[bytes, bytes]:
    """Everything in the LMDB environment at ``path``, read through a separate handle."""
    env = lmdb.open(str(path), readonly=True, lock=False)
    try:
        with env.begin() as txn:
            return {bytes(k): bytes(v) for k, v in txn.cursor()}
    finally:
        env.close()


def rewrite_value(path: Path, k: bytes, change: object) -> None:
    """Replace the stored value of ``k`` by ``change(value)`` through a separate LMDB handle."""
    env = lmdb.open(str(path), map_size=8 * MIB)
    try:
        with env.begin(write=True) as txn:
            value = txn.get(k)
            assert value is not None
            txn.put(k, change(bytes(value)))  # type: ignore[operator]
    finally:
        env.close()


def put_raw(path: Path, k: bytes, value: bytes) -> None:
    env = lmdb.open(str(path), map_size=8 * MIB)
    try:
        with env.begin(write=True) as txn:
            txn.put(k, value)
    finally:
        env.close()


def flip(value: bytes, index: int) -> bytes:
    changed = bytearray(value)
    changed[index] ^= 0x40
    return bytes(changed)


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "nvme"


@pytest.fixture
async def tier(path: Path) -> AsyncIterator[NvmeTier]:
    nvme = NvmeTier(path, 8 * MIB)
    yield nvme
    await nvme.close()


# --- round trips ----------------------------------------------------------------------------


async def test_round_trip(tier: NvmeTier) -> None:
    blocks = {key(n): payload(n, length) for n, length in enumerate([1, 4096, 5000, 300_000])}
    for k, data in blocks.items():
        assert await put(tier, k, data)
    wanted = [*blocks, key(999)]
    read = await tier.read(wanted)
    assert read[-1] is None
    for k, block in zip(blocks, read, strict=False):
        assert block is not None
        assert bytes(block.payload) == blocks[k]
        assert block.header == BlockHeader.for_payload(k, NS, blocks[k])
        assert k in tier
    assert tier.used == sum(tier.footprint(len(v)) for v in blocks.values())
    stats = tier.stats()
    assert stats["blocks"] == 4
    assert stats["corrupt_blocks"] == 0


async def test_value_on_disk_is_header_then_payload(path: Path) -> None:
    data = payload(1, 777)
    nvme = NvmeTier(path, 8 * MIB)
    assert await put(nvme, key(1), data)
    await nvme.close()
    value = raw_values(path)[key(1)]
    assert value[HEADER_BYTES:] == data
    assert WireHeader.unpack(value[:HEADER_BYTES]) == WireHeader.for_payload(key(1), NS, data)


async def test_footprint_counts_lmdb_pages(tier: NvmeTier) -> None:
    assert tier.footprint(1) == 4096
    assert tier.footprint(4096) == 2 * 4096
    assert tier.footprint(256 * 1024) % 4096 == 0
    assert tier.footprint(256 * 1024) > 256 * 1024 + HEADER_BYTES


async def test_capacity_keeps_headroom_below_map_size(path: Path) -> None:
    nvme = NvmeTier(path, 10 * MIB)
    try:
        assert nvme.capacity < nvme.map_size == 10 * MIB
        assert nvme.stats()["map_size"] == 10 * MIB
    finally:
        await nvme.close()


async def test_remove_and_replace_keep_usage_exact(tier: NvmeTier, path: Path) -> None:
    assert await put(tier, key(1), payload(1, 10_000))
    assert await put(tier, key(2), payload(2, 20_000))
    assert await put(tier, key(1), payload(3, 3_000))  # replace
    assert await read_bytes(tier, key(1)) == payload(3, 3_000)
    assert tier.used == tier.footprint(3_000) + tier.footprint(20_000)
    await tier.remove([key(2), key(404)])
    assert key(2) not in tier
    assert await read_bytes(tier, key(2)) is None
    assert tier.used == tier.footprint(3_000)
    assert tier.stats()["blocks"] == 1


# --- restart --------------------------------------------------------------------------------


async def test_blocks_survive_close_and_reopen(path: Path) -> None:
    blocks = {key(n): payload(n, 1000 * n + 1) for n in range(1, 6)}
    first = NvmeTier(path, 8 * MIB)
    for k, data in blocks.items():
        assert await put(first, k, data)
    await first.remove([key(5)])
    del blocks[key(5)]
    used = first.used
    await first.close()

    second = NvmeTier(path, 8 * MIB)
    try:
        assert second.used == 0  # nothing is known until the scan
        headers = {h.key: h for h in second.scan()}
        assert set(headers) == set(blocks)
        for k, data in blocks.items():
            # Payloads are not read by the scan: no checksum yet, the rest is the put's header.
            assert headers[k] == replace(BlockHeader.for_payload(k, NS, data), checksum=None)
            assert k in second
        assert second.used == used
        for k, data in blocks.items():
            assert await read_bytes(second, k) == data
    finally:
        await second.close()


# --- corruption -----------------------------------------------------------------------------


async def test_corrupted_payload_is_a_miss_deleted_and_counted(path: Path) -> None:
    good, bad = payload(1, 9000), payload(2, 9000)
    first = NvmeTier(path, 8 * MIB)
    assert await put(first, key(1), good)
    assert await put(first, key(2), bad)
    await first.close()
    rewrite_value(path, key(2), lambda value: flip(value, HEADER_BYTES + 4321))

    second = NvmeTier(path, 8 * MIB)
    try:
        # The header is intact, so the scan still lists the block ...
        assert {h.key for h in second.scan()} == {key(1), key(2)}
        # ... but its MAC fails on read: a miss, never the rotten bytes.
        blocks = await second.read([key(2), key(1)])
        assert blocks[0] is None
        assert blocks[1] is not None and bytes(blocks[1].payload) == good
        assert second.corrupt_blocks == 1
        assert second.stats()["corrupt_blocks"] == 1
        assert key(2) not in second
        assert second.used == second.footprint(len(good))
        assert await read_bytes(second, key(2)) is None
        assert second.corrupt_blocks == 1  # deleted, so not found (or counted) again
    finally:
        await second.close()
    assert set(raw_values(path)) == {key(1)}


@pytest.mark.parametrize(
    "offset",
    [48, 63, 40],  # the stored MAC's ends; the payload length (the scan cannot tell it is wrong)
)
async def test_corrupted_mac_or_length_field_is_a_miss(path: Path, offset: int) -> None:
    data = payload(1, 5000)
    first = NvmeTier(path, 8 * MIB)
    assert await put(first, key(1), data)
    await first.close()
    rewrite_value(path, key(1), lambda value: flip(value, offset))

    second = NvmeTier(path, 8 * MIB)
    try:
        list(second.scan())
        assert await read_bytes(second, key(1)) is None
        assert second.corrupt_blocks == 1
        assert key(1) not in second
    finally:
        await second.close()
    assert raw_values(path) == {}


async def test_live_bit_rot_in_data_file_is_a_miss(tier: NvmeTier, path: Path) -> None:
    """Bytes changed under an open environment (the disk, not LMDB) are caught on read."""
    data = payload(7, 64 * 1024)
    assert await put(tier, key(7), data)
    assert await read_bytes(tier, key(7)) == data
    assert rot_in_file(path / "data.mdb", data[1000:1100]) >= 1
    assert await read_bytes(tier, key(7)) is None
    assert tier.corrupt_blocks == 1
    assert key(7) not in tier
    assert tier.used == 0


async def test_corrupt_block_read_twice_in_one_batch_is_counted_once(path: Path) -> None:
    first = NvmeTier(path, 8 * MIB)
    assert await put(first, key(1), payload(1, 5000))
    await first.close()
    rewrite_value(path, key(1), lambda value: flip(value, HEADER_BYTES + 10))
    second = NvmeTier(path, 8 * MIB)
    try:
        list(second.scan())
        assert await second.read([key(1), key(1)]) == [None, None]
        assert second.corrupt_blocks == 1
    finally:
        await second.close()


@pytest.mark.parametrize(
    "breakage",
    ["magic", "flags", "other_key", "truncated", "shorter_than_header"],
)
async def test_value_with_broken_header_is_dropped_at_scan(path: Path, breakage: str) -> None:
    good = payload(1, 3000)
    first = NvmeTier(path, 8 * MIB)
    assert await put(first, key(1), good)
    await first.close()
    data = payload(2, 3000)
    value = encode_header(key(2), NS, data) + data
    broken = {
        "magic": flip(value, 0),
        "flags": flip(value, 6),
        "other_key": encode_header(key(3), NS, data) + data,
        "truncated": value[:-1],
        "shorter_than_header": value[: HEADER_BYTES - 1],
    }[breakage]
    put_raw(path, key(2), broken)

    second = NvmeTier(path, 8 * MIB)
    try:
        assert [h.key for h in second.scan()] == [key(1)]
        assert second.corrupt_blocks == 1
        assert key(2) not in second
        assert second.used == second.footprint(len(good))
        assert await read_bytes(second, key(2)) is None
        assert await read_bytes(second, key(1)) == good
    finally:
        await second.close()
    assert set(raw_values(path)) == {key(1)}


# --- map full and unusable directories ---------------------------------------------------------


async def test_map_full_returns_false_and_never_raises(path: Path) -> None:
    block = 256 * 1024
    nvme = NvmeTier(path, 1 * MIB)
    try:
        results = []
        for n in range(8):
            used_before = nvme.used
            ok = await put(nvme, key(n), payload(n, block))
            results.append(ok)
            if not ok:
                assert nvme.used == used_before
                assert key(n) not in nvme
        assert results[0]
        assert not all(results)
        stored = [key(n) for n, ok in enumerate(results) if ok]
        assert nvme.stats()["blocks"] == len(stored)
        assert nvme.stats()["write_errors"] == 0  # map full is "no room", not a disk error
        for n, ok in enumerate(results):
            assert await read_bytes(nvme, key(n)) == (payload(n, block) if ok else None)
        # Room made by removals becomes usable again. LMDB reuses a freed page only once two
        # later transactions have committed, so a write right after one removal may still be
        # refused (the store evicts more and retries); it must not raise either way.
        recovered = False
        for k in stored:
            await nvme.remove([k])
            if await put(nvme, key(100), payload(100, block)):
                recovered = True
                break
        assert recovered
        assert await read_bytes(nvme, key(100)) == payload(100, block)
        assert nvme.used <= nvme.capacity
    finally:
        await nvme.close()


async def test_unopenable_directory_is_moved_aside_and_tier_starts_empty(tmp_path: Path) -> None:
    path = tmp_path / "nvme"
    path.mkdir()
    garbage = os.urandom(64 * 1024)
    (path / "data.mdb").write_bytes(garbage)

    nvme = NvmeTier(path, 4 * MIB)
    try:
        assert list(nvme.scan()) == []
        assert nvme.used == 0
        assert await put(nvme, key(1), b"fresh start")
        assert await read_bytes(nvme, key(1)) == b"fresh start"
    finally:
        await nvme.close()
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("nvme.corrupt-")]
    assert len(aside) == 1
    assert (aside[0] / "data.mdb").read_bytes() == garbage
    values = raw_values(path)
    assert set(values) == {key(1)}
    assert values[key(1)][HEADER_BYTES:] == b"fresh start"


async def test_remove_on_a_full_map_leaves_disk_and_accounting_consistent(path: Path) -> None:
    nvme = NvmeTier(path, 32 * 1024)
    written = 0
    while await put(nvme, key(written), payload(written, 2000)):
        written += 1
    assert written >= 1
    await nvme.remove([key(0)])
    still_counted = key(0) in nvme
    await nvme.close()
    still_on_disk = key(0) in raw_values(path)
    # Either the delete happened, or the tier still accounts for the block it could not delete.
    assert still_counted or not still_on_disk
