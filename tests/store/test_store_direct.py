"""Tests of :class:`kvstore.store.TieredStore`'s direct access for co-located clients.

``acquire`` / ``release`` (leases on dram pages, promoting from nvme first, falling back to the
payload bytes when the arena cannot make room) and ``reserve`` / ``commit`` / ``cancel`` (puts
that a client writes into the arena itself), over a real DRAM arena and a real LMDB directory.
The arena is read and written through its memfd, as a client that mapped it does.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from harness.polling import apoll
from harness.store_blocks import MIB, PAGE, arena, key, make_store, payload

from kvstore.errors import CapacityError, InvalidRequestError, NamespaceMismatchError
from kvstore.keys import Namespace
from kvstore.store import TieredStore
from kvstore.tiers.dram import DramLease, Reservation
from kvstore.tiers.nvme import NvmeTier

NS = Namespace(model="direct-test").fingerprint()
OTHER_NS = Namespace(model="direct-test", tenant="someone-else").fingerprint()


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[TieredStore]:
    s = make_store(tmp_path / "nvme")
    yield s
    await s.close()


def mapped(store: TieredStore, ranges: Sequence[tuple[int, int]]) -> bytes:
    """The bytes a client that mapped the arena sees at ``ranges``."""
    fd = arena(store).fd
    return b"".join(os.pread(fd, size, offset) for offset, size in ranges)


def fill(store: TieredStore, reservation: Reservation, data: bytes) -> None:
    """Write a value into its reservation, as the server does from a client's write window (the
    arena's memfd is sealed against every other writer, see docs/shared-memory.md)."""
    tier = arena(store)
    at = 0
    for offset, size in reservation.ranges:
        tier.range_view(offset, size)[:] = memoryview(data)[at : at + size]
        at += size
    assert at == len(data) == reservation.length


async def put_blocks(store: TieredStore, numbers: Sequence[int], length: int = PAGE) -> None:
    for n in numbers:
        assert (await store.put([key(n)], [payload(n, length)], NS)).stored == 1


async def get_bytes(store: TieredStore, numbers: Sequence[int]) -> list[bytes | None]:
    results = await store.get([key(n) for n in numbers], NS)
    return [None if r.payload is None else bytes(r.payload) for r in results]


def tiers_of(store: TieredStore, numbers: Sequence[int], namespace: bytes = NS) -> list[str]:
    return store.lookup([key(n) for n in numbers], namespace).tiers


def dram_stats(store: TieredStore) -> dict[str, Any]:
    return dict(store.stats()["tiers"]["dram"])


def counters(store: TieredStore) -> dict[str, int]:
    return dict(store.stats()["counters"])


def delta(before: dict[str, int], after: dict[str, int], name: str) -> int:
    return after.get(name, 0) - before.get(name, 0)


def leases_of(acquired: Sequence[Any]) -> list[DramLease]:
    assert all(isinstance(item, DramLease) for item in acquired), acquired
    return list(acquired)


async def reserve_one(store: TieredStore, n: int, length: int = PAGE) -> Reservation:
    [reservation] = await store.reserve([key(n)], [length], NS)
    assert isinstance(reservation, Reservation)
    return reservation


# --- acquire / release -----------------------------------------------------------------------


async def test_acquire_leases_dram_blocks(store: TieredStore) -> None:
    await put_blocks(store, [1])
    await store.put([key(2)], [payload(2, PAGE + 10)], NS)
    acquired = leases_of(await store.acquire([key(1), key(2)], NS))
    assert [lease.key for lease in acquired] == [key(1), key(2)]
    assert mapped(store, acquired[0].ranges) == payload(1)
    assert mapped(store, acquired[1].ranges) == payload(2, PAGE + 10)
    assert dram_stats(store)["leases"] == 2
    store.release(acquired)
    assert dram_stats(store)["leases"] == 0
    assert await get_bytes(store, [1, 2]) == [payload(1), payload(2, PAGE + 10)]


async def test_acquire_promotes_an_nvme_only_block_and_leases_it(store: TieredStore) -> None:
    await put_blocks(store, range(5))  # four pages of dram: key 0 is demoted
    assert tiers_of(store, [0]) == ["nvme"]
    [lease] = leases_of(await store.acquire([key(0)], NS))
    assert tiers_of(store, [0]) == ["dram"]
    assert mapped(store, lease.ranges) == payload(0)
    assert dram_stats(store)["leases"] == 1
    store.release([lease])
    # The block that made room went down to nvme, not out of the store.
    assert await get_bytes(store, range(5)) == [payload(n) for n in range(5)]


async def test_acquire_of_a_miss_is_none(store: TieredStore) -> None:
    await put_blocks(store, [1])
    before = counters(store)
    acquired = await store.acquire([key(1), key(99)], NS)
    assert isinstance(acquired[0], DramLease)
    assert acquired[1] is None
    after = counters(store)
    assert delta(before, after, "misses") == 1
    assert delta(before, after, "hits") == 1
    store.release([acquired[0]])
    assert dram_stats(store)["leases"] == 0


async def test_acquire_under_another_namespace_is_none_and_counted(store: TieredStore) -> None:
    await put_blocks(store, [1, 2])
    await put_blocks(store, range(3, 7))  # keys 1 and 2 go down to nvme
    assert tiers_of(store, [1, 2, 6]) == ["nvme", "nvme", "dram"]
    before = counters(store)
    acquired = await store.acquire([key(1), key(6)], OTHER_NS)
    assert acquired == [None, None]
    after = counters(store)
    assert delta(before, after, "namespace_mismatches") == 2
    assert delta(before, after, "misses") == 2
    assert dram_stats(store)["leases"] == 0
    # Nothing was promoted for the wrong namespace.
    assert tiers_of(store, [1, 6]) == ["nvme", "dram"]


async def test_acquire_validates_the_request(store: TieredStore) -> None:
    with pytest.raises(InvalidRequestError):
        await store.acquire([], NS)
    with pytest.raises(InvalidRequestError):
        await store.acquire([b"short"], NS)
    with pytest.raises(InvalidRequestError):
        await store.acquire([key(1)], b"bad namespace")


async def test_leased_blocks_are_not_evicted_and_puts_go_to_nvme(store: TieredStore) -> None:
    await put_blocks(store, range(4))
    leases = leases_of(await store.acquire([key(n) for n in range(4)], NS))
    result = await store.put([key(10)], [payload(10)], NS)
    assert result.stored == 1
    assert tiers_of(store, [0, 1, 2, 3, 10]) == ["dram"] * 4 + ["nvme"]
    for n, lease in enumerate(leases):
        assert mapped(store, lease.ranges) == payload(n)
    store.release(leases)
    # Unpinned, they are ordinary LRU blocks again; the acquire read them as one chain, which
    # ages suffix first (kvstore.policy), so the suffix block 3 is the one to go.
    await put_blocks(store, [11])
    assert tiers_of(store, [0, 1, 2, 3, 11]) == ["dram"] * 3 + ["nvme", "dram"]


async def test_puts_needing_leased_room_are_dropped_without_a_lower_tier() -> None:
    store = make_store(None, dram_pages=2)
    try:
        await put_blocks(store, [0, 1])
        leases = leases_of(await store.acquire([key(0), key(1)], NS))
        result = await store.put([key(2)], [payload(2)], NS)
        assert (result.stored, result.dropped) == (0, 1)
        assert store.stats()["counters"]["put_dropped"] == 1
        assert await get_bytes(store, [0, 1]) == [payload(0), payload(1)]
        # Releasing one lease makes it evictable again.
        store.release(leases[:1])
        assert (await store.put([key(2)], [payload(2)], NS)).stored == 1
        assert await get_bytes(store, [0, 1, 2]) == [None, payload(1), payload(2)]
        assert mapped(store, leases[1].ranges) == payload(1)
        store.release(leases[1:])
    finally:
        await store.close()


async def test_delete_of_a_leased_block(store: TieredStore) -> None:
    await put_blocks(store, range(4))
    [lease] = leases_of(await store.acquire([key(1)], NS))
    used = dram_stats(store)["used"]
    assert await store.delete([key(1)], NS) == 1
    # Gone for everyone at once ...
    assert store.lookup([key(1)], NS).hits == 0
    assert tiers_of(store, [1]) == [""]
    assert await get_bytes(store, [1]) == [None]
    assert await store.acquire([key(1)], NS) == [None]
    stats = dram_stats(store)
    assert stats["used"] == used
    assert stats["retired_bytes"] == PAGE
    assert stats["blocks"] == 3
    # ... while the reader's bytes stay, even when new puts want the room.
    await put_blocks(store, range(20, 26))
    assert mapped(store, lease.ranges) == payload(1)
    assert dram_stats(store)["used"] == 4 * PAGE
    assert dram_stats(store)["blocks"] == 3
    store.release([lease])
    stats = dram_stats(store)
    assert stats["retired_bytes"] == 0
    assert stats["leases"] == 0
    assert stats["used"] == 3 * PAGE
    # The space is back: the next put lands in dram without evicting.
    evictions = stats["evictions"]
    await put_blocks(store, [30])
    assert tiers_of(store, [30]) == ["dram"]
    assert dram_stats(store)["evictions"] == evictions
    assert dram_stats(store)["used"] == 4 * PAGE


async def test_acquire_falls_back_to_bytes_when_everything_is_leased(
    store: TieredStore,
) -> None:
    await put_blocks(store, range(5))  # key 0 only in nvme
    leases = leases_of(await store.acquire([key(n) for n in range(1, 5)], NS))
    before = counters(store)
    [got] = await store.acquire([key(0)], NS)
    assert not isinstance(got, DramLease)
    assert got is not None and bytes(got) == payload(0)
    after = counters(store)
    assert delta(before, after, "gets") == 1
    assert delta(before, after, "hits") == 1
    assert delta(before, after, "misses") == 0
    await store.drain()
    assert tiers_of(store, [0]) == ["nvme"]
    assert dram_stats(store)["leases"] == 4
    store.release(leases)
    # With the leases gone, the same key is promoted and leased.
    [lease] = leases_of(await store.acquire([key(0)], NS))
    assert mapped(store, lease.ranges) == payload(0)
    store.release([lease])


async def test_acquire_mixes_leases_fallback_bytes_and_misses(store: TieredStore) -> None:
    await put_blocks(store, range(5))  # key 0 only in nvme
    held = leases_of(await store.acquire([key(n) for n in range(1, 5)], NS))
    acquired = await store.acquire([key(1), key(0), key(77)], NS)
    assert isinstance(acquired[0], DramLease)
    assert mapped(store, acquired[0].ranges) == payload(1)
    assert acquired[1] is not None and not isinstance(acquired[1], DramLease)
    assert bytes(acquired[1]) == payload(0)
    assert acquired[2] is None
    assert dram_stats(store)["leases"] == 5
    store.release([*held, acquired[0]])
    assert dram_stats(store)["leases"] == 0


async def test_acquire_counts_like_a_get(tmp_path: Path) -> None:
    """The same request as a get and as an acquire moves gets/hits/misses the same way."""
    ways: dict[str, dict[str, int]] = {}
    tier_hits: dict[str, dict[str, int]] = {}
    for way in ("get", "acquire"):
        store = make_store(tmp_path / way)
        try:
            await put_blocks(store, range(5))  # key 0 in nvme, 1..4 in dram
            before = counters(store)
            hits_before = {name: t["hits"] for name, t in store.stats()["tiers"].items()}
            keys = [key(0), key(3), key(50), key(4)]
            if way == "get":
                await store.get(keys, NS)
            else:
                acquired = await store.acquire(keys, NS)
                store.release([item for item in acquired if isinstance(item, DramLease)])
            after = counters(store)
            ways[way] = {n: delta(before, after, n) for n in ("gets", "hits", "misses")}
            tier_hits[way] = {
                name: t["hits"] - hits_before[name] for name, t in store.stats()["tiers"].items()
            }
            await store.drain()
        finally:
            await store.close()
    assert ways["get"] == {"gets": 1, "hits": 3, "misses": 1}
    assert ways["acquire"] == ways["get"]
    assert tier_hits["acquire"] == tier_hits["get"] == {"dram": 2, "nvme": 1}


async def test_direct_reads_are_counted_and_keep_blocks_recent(store: TieredStore) -> None:
    """Reads a client served from the published index reach the store only as a TOUCH."""
    await put_blocks(store, range(5))  # 0 went down to nvme; 1 is the least recent in dram
    before = counters(store)
    hits_before = dram_stats(store)["hits"]
    # Two client calls' reads in one TOUCH: 1 (in dram), 0 (read before it was evicted), and
    # 50, which was never stored and so cannot have been read: ignored.
    assert store.record_direct_reads([key(1), key(0), key(50)], NS, calls=2) == 1
    after = counters(store)
    assert {n: delta(before, after, n) for n in ("gets", "hits", "blocks_read_direct")} == {
        "gets": 2,
        "hits": 2,
        "blocks_read_direct": 2,
    }
    assert dram_stats(store)["hits"] == hits_before + 2
    await put_blocks(store, [5])  # evicts the least recently used block: now 2, not 1
    assert tiers_of(store, [1, 2, 5]) == ["dram", "nvme", "dram"]


async def test_direct_reads_of_other_namespaces_or_gone_blocks_age_nothing(
    store: TieredStore,
) -> None:
    await put_blocks(store, range(5))  # 0 went down to nvme
    assert store.record_direct_reads([key(1)], OTHER_NS) == 0
    assert store.record_direct_reads([key(0)], NS) == 0  # not in the arena any more
    # Lookups answered by the client only move the lookup counter.
    before = counters(store)
    assert store.record_direct_reads([], NS, calls=0, lookups=3) == 0
    after = counters(store)
    assert {n: delta(before, after, n) for n in ("lookups", "gets", "hits")} == {
        "lookups": 3,
        "gets": 0,
        "hits": 0,
    }
    with pytest.raises(InvalidRequestError):
        store.record_direct_reads([b"short"], NS)


async def test_release_twice_raises(store: TieredStore) -> None:
    await put_blocks(store, [1])
    [lease] = leases_of(await store.acquire([key(1)], NS))
    store.release([lease])
    with pytest.raises(ValueError):
        store.release([lease])
    assert dram_stats(store)["leases"] == 0


async def test_direct_access_needs_a_dram_arena(tmp_path: Path) -> None:
    store = TieredStore([NvmeTier(tmp_path / "nvme", MIB)])
    try:
        assert store.arena is None
        with pytest.raises(InvalidRequestError):
            await store.acquire([key(1)], NS)
        with pytest.raises(InvalidRequestError):
            await store.reserve([key(1)], [PAGE], NS)
    finally:
        await store.close()


# --- reserve / commit / cancel ---------------------------------------------------------------


async def test_reserve_commit_get(store: TieredStore) -> None:
    data = payload(5, 2 * PAGE + 3)
    reservation = await reserve_one(store, 5, len(data))
    assert dram_stats(store)["reserved_bytes"] == 3 * PAGE
    # Not a block yet.
    assert store.lookup([key(5)], NS).hits == 0
    assert await get_bytes(store, [5]) == [None]
    fill(store, reservation, data)
    result = await store.commit([(key(5), reservation)], NS)
    assert (result.stored, result.already_present, result.dropped) == (1, 0, 0)
    assert tiers_of(store, [5]) == ["dram"]
    assert await get_bytes(store, [5]) == [data]
    stats = dram_stats(store)
    assert stats["reserved_bytes"] == 0
    assert stats["used"] == 3 * PAGE
    assert stats["wasted_bytes"] == 3 * PAGE - len(data)
    c = counters(store)
    assert c["puts"] == 1 and c["blocks_put"] == 1 and c["bytes_put"] == len(data)


async def test_committed_block_is_checksummed_when_demoted(store: TieredStore) -> None:
    """A committed block is a full block: demoted to nvme it verifies and reads back."""
    data = payload(6)
    reservation = await reserve_one(store, 6)
    fill(store, reservation, data)
    await store.commit([(key(6), reservation)], NS)
    await put_blocks(store, range(10, 14))
    assert tiers_of(store, [6]) == ["nvme"]
    assert await get_bytes(store, [6]) == [data]


async def test_reserve_of_a_present_key(store: TieredStore) -> None:
    await put_blocks(store, [1])
    used = dram_stats(store)["used"]
    out = await store.reserve([key(1), key(2)], [PAGE, PAGE], NS)
    assert out[0] == "present"
    assert isinstance(out[1], Reservation)
    assert dram_stats(store)["used"] == used + PAGE
    store.cancel([out[1]])
    assert dram_stats(store)["used"] == used
    assert dram_stats(store)["reserved_bytes"] == 0


async def test_reserve_makes_room_by_demoting(store: TieredStore) -> None:
    await put_blocks(store, range(4))
    reservation = await reserve_one(store, 9, 2 * PAGE)
    assert tiers_of(store, [0, 1, 2, 3]) == ["nvme", "nvme", "dram", "dram"]
    fill(store, reservation, payload(9, 2 * PAGE))
    await store.commit([(key(9), reservation)], NS)
    assert await get_bytes(store, [0, 1, 9]) == [payload(0), payload(1), payload(9, 2 * PAGE)]


async def test_reserve_is_none_when_the_arena_cannot_make_room(store: TieredStore) -> None:
    await put_blocks(store, range(4))
    leases = leases_of(await store.acquire([key(n) for n in range(4)], NS))
    out = await store.reserve([key(8), key(9)], [PAGE, 5 * PAGE], NS)  # 5 pages > the arena
    assert out == [None, None]
    stats = dram_stats(store)
    assert stats["reserved_bytes"] == 0
    assert stats["used"] == 4 * PAGE
    store.release(leases)


@pytest.mark.parametrize(
    "case",
    ["no keys", "empty value", "over max_block_bytes", "bigger than the store", "length count"],
)
async def test_bad_reserve_reserves_nothing(tmp_path: Path, case: str) -> None:
    store = make_store(tmp_path / "nvme", max_block_bytes=2 * PAGE)
    try:
        await put_blocks(store, [1, 2])
        before = dram_stats(store)
        keys, lengths = [key(10), key(11)], [PAGE, PAGE]
        error: type[Exception] = InvalidRequestError
        if case == "no keys":
            keys, lengths = [], []
        elif case == "empty value":
            lengths = [PAGE, 0]
        elif case == "over max_block_bytes":
            lengths = [PAGE, 2 * PAGE + 1]
            error = CapacityError
        elif case == "bigger than the store":
            keys = [key(10 + n) for n in range(300)]  # 300 pages > 4 pages + 1 MiB
            lengths = [PAGE] * 300
            error = CapacityError
        else:
            lengths = [PAGE]
        with pytest.raises(error):
            store.check_reserve(keys, lengths, NS)  # what reserve checks, and what sessions ask
        with pytest.raises(error):
            await store.reserve(keys, lengths, NS)
        after = dram_stats(store)
        assert after["reserved_bytes"] == 0
        assert after["used"] == before["used"]
        assert tiers_of(store, [1, 2, 10, 11]) == ["dram", "dram", "", ""]
    finally:
        await store.close()


async def test_reserve_with_a_key_of_another_namespace_raises_and_reserves_nothing(
    store: TieredStore,
) -> None:
    await store.put([key(1)], [payload(1)], OTHER_NS)
    await put_blocks(store, range(2, 5))  # dram is full: a reservation would have to evict
    with pytest.raises(NamespaceMismatchError):
        await store.reserve([key(10), key(1)], [PAGE, PAGE], NS)
    stats = dram_stats(store)
    assert stats["reserved_bytes"] == 0
    assert stats["used"] == 4 * PAGE
    assert tiers_of(store, [1], OTHER_NS) == ["dram"]
    assert tiers_of(store, [2, 3, 4]) == ["dram"] * 3
    assert store.stats()["counters"].get("demotions", 0) == 0


async def test_commit_after_someone_else_stored_the_key(store: TieredStore) -> None:
    first = await reserve_one(store, 3)
    second = await reserve_one(store, 3)  # not a block yet, so a second reservation is given
    assert dram_stats(store)["reserved_bytes"] == 2 * PAGE
    fill(store, first, payload(3))
    fill(store, second, payload(33))
    assert (await store.commit([(key(3), first)], NS)).stored == 1
    result = await store.commit([(key(3), second)], NS)
    assert (result.stored, result.already_present, result.dropped) == (0, 1, 0)
    assert await get_bytes(store, [3]) == [payload(3)]
    stats = dram_stats(store)
    assert stats["reserved_bytes"] == 0
    assert stats["used"] == PAGE
    assert stats["blocks"] == 1


async def test_commit_after_a_put_of_the_same_key(store: TieredStore) -> None:
    reservation = await reserve_one(store, 4)
    fill(store, reservation, payload(44))
    await put_blocks(store, [4])
    result = await store.commit([(key(4), reservation)], NS)
    assert (result.stored, result.already_present, result.dropped) == (0, 1, 0)
    assert await get_bytes(store, [4]) == [payload(4)]
    assert dram_stats(store)["used"] == PAGE
    assert dram_stats(store)["reserved_bytes"] == 0


async def test_commit_of_a_key_stored_meanwhile_under_another_namespace(
    store: TieredStore,
) -> None:
    reservation = await reserve_one(store, 7)
    fill(store, reservation, payload(77))
    await store.put([key(7)], [payload(7)], OTHER_NS)
    before = counters(store)
    result = await store.commit([(key(7), reservation)], NS)
    assert (result.stored, result.already_present, result.dropped) == (0, 0, 1)
    assert delta(before, counters(store), "namespace_mismatches") == 1
    assert await get_bytes(store, [7]) == [None]
    [other] = await store.get([key(7)], OTHER_NS)
    assert other.payload is not None and bytes(other.payload) == payload(7)
    assert dram_stats(store)["used"] == PAGE
    assert dram_stats(store)["reserved_bytes"] == 0


async def test_commit_of_several_reservations(store: TieredStore) -> None:
    values = {8: payload(8, 100), 9: payload(9, PAGE), 10: payload(10, PAGE + 1)}
    out = await store.reserve([key(n) for n in values], [len(v) for v in values.values()], NS)
    written = []
    for n, reservation in zip(values, out, strict=True):
        assert isinstance(reservation, Reservation)
        fill(store, reservation, values[n])
        written.append((key(n), reservation))
    result = await store.commit(written, NS)
    assert result.stored == 3
    assert await get_bytes(store, list(values)) == list(values.values())
    assert store.lookup([key(n) for n in values], NS).hits == 3


async def test_cancel_gives_pages_back_and_is_idempotent(store: TieredStore) -> None:
    reservation = await reserve_one(store, 12, 3 * PAGE)
    assert dram_stats(store)["used"] == 3 * PAGE
    store.cancel([reservation])
    store.cancel([reservation])
    stats = dram_stats(store)
    assert stats["used"] == 0
    assert stats["reserved_bytes"] == 0
    assert store.lookup([key(12)], NS).hits == 0
    # All four pages take blocks again.
    await put_blocks(store, range(20, 24))
    assert tiers_of(store, range(20, 24)) == ["dram"] * 4


async def test_reserved_pages_are_not_handed_to_puts(store: TieredStore) -> None:
    reservation = await reserve_one(store, 13, 2 * PAGE)
    data = payload(13, 2 * PAGE)
    fill(store, reservation, data)
    await put_blocks(store, range(30, 36))  # only two pages are free for these
    assert bytes(arena(store).reserved_payload(reservation)) == data
    assert dram_stats(store)["used"] == 4 * PAGE
    await store.commit([(key(13), reservation)], NS)
    assert await get_bytes(store, [13]) == [data]
    assert await get_bytes(store, range(30, 36)) == [payload(n) for n in range(30, 36)]


async def test_acquire_of_more_nvme_blocks_than_the_arena_holds(store: TieredStore) -> None:
    """Promotions later in one request may evict blocks promoted earlier in it; every key still
    comes back right, as a lease or as bytes, and the arena never holds more than it can."""
    await put_blocks(store, range(10))  # 0..5 only in nvme, 6..9 in dram
    numbers = [0, 1, 2, 3, 4, 5]
    acquired = await store.acquire([key(n) for n in numbers], NS)
    leases = [item for item in acquired if isinstance(item, DramLease)]
    assert 1 <= len(leases) <= 4
    for n, item in zip(numbers, acquired, strict=True):
        assert item is not None
        got = mapped(store, item.ranges) if isinstance(item, DramLease) else bytes(item)
        assert got == payload(n)
    stats = dram_stats(store)
    assert stats["leases"] == len(leases)
    assert stats["used"] <= stats["capacity"]
    store.release(leases)
    await store.drain()
    assert dram_stats(store)["leases"] == 0
    assert await get_bytes(store, range(10)) == [payload(n) for n in range(10)]


async def test_reacquiring_a_replaced_key_leases_the_new_block(store: TieredStore) -> None:
    await put_blocks(store, [1])
    [old] = leases_of(await store.acquire([key(1)], NS))
    assert await store.delete([key(1)], NS) == 1
    await store.put([key(1)], [payload(101)], NS)
    [new] = leases_of(await store.acquire([key(1)], NS))
    assert new.ranges != old.ranges
    assert mapped(store, old.ranges) == payload(1)
    assert mapped(store, new.ranges) == payload(101)
    assert dram_stats(store)["leases"] == 2
    store.release([old])
    assert dram_stats(store)["retired_bytes"] == 0
    assert mapped(store, new.ranges) == payload(101)
    store.release([new])
    assert dram_stats(store)["used"] == PAGE


# -- cancellation (a client's deadline cancels the call inside the server) ------------------------


async def test_a_cancelled_acquire_gives_back_the_leases_it_took(store: TieredStore) -> None:
    await put_blocks(store, range(6))  # 4 dram pages: blocks 0 and 1 went down to nvme
    assert tiers_of(store, [0, 5]) == ["nvme", "dram"]
    async with store._mover.lock:  # the promotion of block 0 waits for the lock: cancel it there
        task = asyncio.ensure_future(store.acquire([key(5), key(0)], NS))
        # Block 5 is leased before the wait for the lock.
        await apoll(lambda: dram_stats(store)["leases"] == 1, 10.0, "block 5 leased")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert dram_stats(store)["leases"] == 0
    assert not store._index.pins


async def test_a_cancelled_reserve_gives_back_its_reservations(store: TieredStore) -> None:
    stall = asyncio.Event()
    real_make_room = store._mover.make_room
    calls = 0

    async def make_room(level: int, footprint: int, force: bool = False) -> bool:
        nonlocal calls
        calls += 1
        if calls == 2:
            await stall.wait()  # the second key's eviction never finishes
        return await real_make_room(level, footprint, force)

    store._mover.make_room = make_room  # type: ignore[method-assign]
    task = asyncio.ensure_future(store.reserve([key(1), key(2)], [PAGE, PAGE], NS))
    await apoll(lambda: calls == 2, 10.0, "the second key's eviction stalled")
    assert dram_stats(store)["reserved_bytes"] == PAGE
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert dram_stats(store)["reserved_bytes"] == 0
    assert dram_stats(store)["used"] == 0
