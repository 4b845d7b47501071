"""Tests of the direct-access half of :class:`kvstore.tiers.dram.DramTier`: leases, reservations.

A lease names the arena ranges of a resident block; removing or replacing the block unindexes it
at once but keeps its pages (and bytes) until the last lease is released. A reservation hands out
free pages that are written (by the server, copying a client's window: the memfd itself is
sealed against writes) before :meth:`DramTier.install` makes them a block. Every test checks
the accounting (``used``, ``wasted_bytes``, ``leases``, ``reserved_bytes``, ``retired_bytes``)
against a model kept independently of the tier.

The arena is read with ``os.pread`` on the memfd, the way a co-located client that mapped it
sees it, and written through the server's own mapping (:meth:`DramTier.range_view`).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import numpy as np
import pytest

from kvstore.block import BlockHeader
from kvstore.buffers import byte_view
from kvstore.tiers.dram import DramLease, DramTier, Reservation

PAGE = 4096
PAGES = 8
NS = bytes(range(100, 116))


def key(n: int) -> bytes:
    return n.to_bytes(2, "little") * 8


def payload(n: int, length: int) -> bytes:
    return np.random.default_rng(n).integers(0, 256, size=length, dtype=np.uint8).tobytes()


def header(k: bytes, data: bytes) -> BlockHeader:
    return BlockHeader.for_payload(k, NS, byte_view(data))


def write(tier: DramTier, k: bytes, data: bytes) -> bool:
    return tier.write_sync(header(k, data), data)


def read(tier: DramTier, k: bytes) -> bytes | None:
    block = tier.read_sync(k)
    return None if block is None else bytes(block.payload)


def arena_bytes(tier: DramTier, ranges: list[tuple[int, int]]) -> bytes:
    """What a client that mapped the memfd sees at ``ranges``."""
    return b"".join(os.pread(tier.fd, size, offset) for offset, size in ranges)


def write_into(tier: DramTier, reservation: Reservation, data: bytes) -> None:
    """Fill a reservation through the server's mapping, as its copy out of a window does."""
    at = 0
    for offset, size in reservation.ranges:
        tier.range_view(offset, size)[:] = np.frombuffer(data[at : at + size], dtype=np.uint8)
        at += size
    assert at == len(data)


def pages(length: int) -> int:
    return -(-length // PAGE)


def check_accounting(
    tier: DramTier,
    live: dict[bytes, int],
    *,
    leases: int = 0,
    reserved: int = 0,
    retired: int = 0,
) -> None:
    """Stats against a model: ``live`` maps indexed keys to payload lengths; the others are
    page counts held by open reservations and by removed-but-leased blocks."""
    stats = tier.stats()
    live_pages = sum(pages(length) for length in live.values())
    assert stats["blocks"] == len(live)
    assert stats["payload_bytes"] == sum(live.values())
    assert stats["used"] == tier.used == (live_pages + reserved + retired) * PAGE
    assert stats["reserved_bytes"] == reserved * PAGE
    assert stats["retired_bytes"] == retired * PAGE
    assert stats["leases"] == leases
    assert stats["wasted_bytes"] == live_pages * PAGE - sum(live.values())
    assert stats["wasted_bytes"] >= 0
    assert stats["used"] <= stats["capacity"]


@pytest.fixture
async def tier() -> AsyncIterator[DramTier]:
    dram = DramTier(PAGES * PAGE, page_size=PAGE)
    yield dram
    await dram.close()


def fragment(tier: DramTier) -> dict[bytes, bytes]:
    """Fill all pages with one-page blocks, then free every other one; returns the survivors."""
    blocks = {key(n): payload(n, PAGE - n) for n in range(PAGES)}
    for k, data in blocks.items():
        assert write(tier, k, data)
    freed = [key(n) for n in range(0, PAGES, 2)]
    tier.remove_sync(freed)
    assert tier.stats()["free_runs"] == PAGES // 2
    return {k: v for k, v in blocks.items() if k not in freed}


# --- leases ----------------------------------------------------------------------------------


def test_lease_names_the_ranges_and_bytes_of_a_block(tier: DramTier) -> None:
    data = payload(1, 2 * PAGE + 100)
    assert write(tier, key(1), data)
    lease = tier.lease(key(1))
    assert isinstance(lease, DramLease)
    assert lease.key == key(1)
    assert lease.ranges == tier.extents(key(1))
    assert sum(size for _, size in lease.ranges) == len(data)
    assert arena_bytes(tier, lease.ranges) == data
    check_accounting(tier, {key(1): len(data)}, leases=1)
    tier.release(lease)
    check_accounting(tier, {key(1): len(data)})
    assert read(tier, key(1)) == data


def test_lease_of_an_absent_key_is_none(tier: DramTier) -> None:
    assert tier.lease(key(7)) is None
    check_accounting(tier, {})


def test_several_leases_on_one_block_are_counted(tier: DramTier) -> None:
    data = payload(2, PAGE)
    assert write(tier, key(2), data)
    first, second = tier.lease(key(2)), tier.lease(key(2))
    assert first is not None and second is not None
    check_accounting(tier, {key(2): PAGE}, leases=2)
    tier.remove_sync([key(2)])
    tier.release(first)
    # One reader still holds it: the pages stay and keep their bytes.
    check_accounting(tier, {}, leases=1, retired=1)
    assert arena_bytes(tier, second.ranges) == data
    tier.release(second)
    check_accounting(tier, {})


def test_remove_while_leased_keeps_bytes_and_pages_until_release(tier: DramTier) -> None:
    data = payload(3, 3 * PAGE - 5)
    assert write(tier, key(3), data)
    lease = tier.lease(key(3))
    assert lease is not None
    tier.remove_sync([key(3)])
    # Gone for everyone else at once ...
    assert key(3) not in tier
    assert read(tier, key(3)) is None
    assert tier.lease(key(3)) is None
    check_accounting(tier, {}, leases=1, retired=3)
    # ... but its pages are not handed out again: fill everything else and look.
    fillers = {key(10 + n): payload(10 + n, PAGE) for n in range(PAGES - 3)}
    for k, filler in fillers.items():
        assert write(tier, k, filler)
    assert not write(tier, key(99), payload(99, 1))  # the leased pages are not free
    assert arena_bytes(tier, lease.ranges) == data
    check_accounting(tier, {k: PAGE for k in fillers}, leases=1, retired=3)
    tier.release(lease)
    check_accounting(tier, {k: PAGE for k in fillers})
    assert tier.used == (PAGES - 3) * PAGE
    # Now they are reusable.
    assert write(tier, key(99), payload(99, 3 * PAGE))
    for k, filler in fillers.items():
        assert read(tier, k) == filler


def test_replace_while_leased_keeps_the_old_bytes_for_the_reader(tier: DramTier) -> None:
    old, new = payload(4, 2 * PAGE), payload(5, 2 * PAGE - 1)
    assert write(tier, key(4), old)
    lease = tier.lease(key(4))
    assert lease is not None
    assert write(tier, key(4), new)
    assert read(tier, key(4)) == new
    assert arena_bytes(tier, lease.ranges) == old
    assert tier.extents(key(4)) != lease.ranges
    check_accounting(tier, {key(4): len(new)}, leases=1, retired=2)
    # Replacing it again (the new block is not leased) reuses the new block's own pages.
    newer = payload(6, 2 * PAGE)
    assert write(tier, key(4), newer)
    assert arena_bytes(tier, lease.ranges) == old
    check_accounting(tier, {key(4): len(newer)}, leases=1, retired=2)
    tier.release(lease)
    check_accounting(tier, {key(4): len(newer)})
    assert read(tier, key(4)) == newer


def test_double_release_raises_and_changes_nothing(tier: DramTier) -> None:
    data = payload(7, PAGE)
    assert write(tier, key(7), data)
    lease = tier.lease(key(7))
    assert lease is not None
    tier.release(lease)
    with pytest.raises(ValueError, match="twice"):
        tier.release(lease)
    check_accounting(tier, {key(7): PAGE})
    assert read(tier, key(7)) == data


def test_double_release_of_a_retired_block_raises_and_frees_once(tier: DramTier) -> None:
    data = payload(8, PAGE)
    assert write(tier, key(8), data)
    lease = tier.lease(key(8))
    assert lease is not None
    tier.remove_sync([key(8)])
    tier.release(lease)
    check_accounting(tier, {})
    with pytest.raises(ValueError):
        tier.release(lease)
    check_accounting(tier, {})
    # The freed page was not freed twice: the allocator still hands out exactly PAGES pages.
    for n in range(PAGES):
        assert write(tier, key(20 + n), payload(20 + n, PAGE))
    assert not write(tier, key(99), payload(99, 1))


def test_replacement_does_not_count_leased_pages_as_reusable(tier: DramTier) -> None:
    old = payload(9, 2 * PAGE)
    assert write(tier, key(9), old)
    others = {key(30 + n): payload(30 + n, PAGE) for n in range(PAGES - 2)}
    for k, data in others.items():
        assert write(tier, k, data)
    assert tier.used == tier.capacity
    lease = tier.lease(key(9))
    assert lease is not None
    # Only the leased block's own pages could make room: the write must be refused ...
    assert not write(tier, key(9), payload(10, 2 * PAGE))
    # ... and leave the old block in place, indexed and intact.
    assert read(tier, key(9)) == old
    assert arena_bytes(tier, lease.ranges) == old
    live = {key(9): len(old), **{k: PAGE for k in others}}
    check_accounting(tier, live, leases=1)
    tier.release(lease)
    # Unleased, the same replacement reuses those pages.
    replacement = payload(10, 2 * PAGE)
    assert write(tier, key(9), replacement)
    assert read(tier, key(9)) == replacement
    check_accounting(tier, {**live, key(9): len(replacement)})


def test_replacement_with_one_free_page_short_is_refused_while_leased(tier: DramTier) -> None:
    old = payload(11, PAGE)
    assert write(tier, key(11), old)
    for n in range(PAGES - 2):
        assert write(tier, key(40 + n), payload(40 + n, PAGE))
    lease = tier.lease(key(11))
    assert lease is not None
    # One page is free; a two-page replacement would need the leased page too.
    assert not write(tier, key(11), payload(12, 2 * PAGE))
    assert read(tier, key(11)) == old
    # A one-page replacement fits in the free page and retires the leased one.
    new = payload(13, PAGE)
    assert write(tier, key(11), new)
    assert read(tier, key(11)) == new
    assert arena_bytes(tier, lease.ranges) == old
    assert tier.used == tier.capacity
    tier.release(lease)
    assert tier.used == tier.capacity - PAGE


def test_lease_of_a_fragmented_block(tier: DramTier) -> None:
    survivors = fragment(tier)
    big = payload(14, 3 * PAGE + 7)
    assert write(tier, key(14), big)
    lease = tier.lease(key(14))
    assert lease is not None
    assert len(lease.ranges) == 4, "expected a block split over several page runs"
    assert [size for _, size in lease.ranges] == [PAGE, PAGE, PAGE, 7]
    assert arena_bytes(tier, lease.ranges) == big
    tier.remove_sync([key(14)])
    live = {k: len(v) for k, v in survivors.items()}
    check_accounting(tier, live, leases=1, retired=4)
    assert not write(tier, key(15), payload(15, 1))
    assert arena_bytes(tier, lease.ranges) == big
    tier.release(lease)
    check_accounting(tier, live)
    assert tier.stats()["free_runs"] == 4
    for k, data in survivors.items():
        assert read(tier, k) == data


# --- reservations ----------------------------------------------------------------------------


def test_reserve_write_install_read(tier: DramTier) -> None:
    data = payload(16, 2 * PAGE + 33)
    reservation = tier.reserve(len(data))
    assert reservation is not None
    assert reservation.length == len(data)
    assert sum(size for _, size in reservation.ranges) == len(data)
    check_accounting(tier, {}, reserved=3)
    assert key(16) not in tier
    write_into(tier, reservation, data)
    assert bytes(tier.reserved_payload(reservation)) == data
    tier.install(header(key(16), data), reservation)
    assert not reservation.open
    assert read(tier, key(16)) == data
    assert tier.extents(key(16)) == reservation.ranges
    check_accounting(tier, {key(16): len(data)})
    # The installed block behaves like any other: lease, remove, release.
    lease = tier.lease(key(16))
    assert lease is not None and arena_bytes(tier, lease.ranges) == data
    tier.remove_sync([key(16)])
    check_accounting(tier, {}, leases=1, retired=3)
    tier.release(lease)
    check_accounting(tier, {})


def test_reservations_do_not_overlap_blocks_or_each_other(tier: DramTier) -> None:
    resident = payload(17, 2 * PAGE)
    assert write(tier, key(17), resident)
    first = tier.reserve(3 * PAGE)
    second = tier.reserve(3 * PAGE)
    assert first is not None and second is not None
    check_accounting(tier, {key(17): 2 * PAGE}, reserved=6)
    one, two = payload(18, 3 * PAGE), payload(19, 3 * PAGE)
    write_into(tier, first, one)
    write_into(tier, second, two)
    assert read(tier, key(17)) == resident
    assert bytes(tier.reserved_payload(first)) == one
    assert bytes(tier.reserved_payload(second)) == two
    # The arena is full now, counting reserved pages.
    assert not write(tier, key(99), payload(99, 1))
    assert tier.reserve(1) is None
    tier.install(header(key(18), one), first)
    tier.install(header(key(19), two), second)
    for k, data in ((key(17), resident), (key(18), one), (key(19), two)):
        assert read(tier, k) == data
    check_accounting(tier, {key(17): 2 * PAGE, key(18): 3 * PAGE, key(19): 3 * PAGE})


def test_install_replaces_an_older_unleased_block(tier: DramTier) -> None:
    old = payload(20, 3 * PAGE)
    assert write(tier, key(20), old)
    new = payload(21, PAGE + 1)
    reservation = tier.reserve(len(new))
    assert reservation is not None
    write_into(tier, reservation, new)
    tier.install(header(key(20), new), reservation)
    assert read(tier, key(20)) == new
    check_accounting(tier, {key(20): len(new)})
    assert tier.used == 2 * PAGE


def test_install_replaces_an_older_leased_block(tier: DramTier) -> None:
    old = payload(22, 2 * PAGE)
    assert write(tier, key(22), old)
    lease = tier.lease(key(22))
    assert lease is not None
    new = payload(23, PAGE)
    reservation = tier.reserve(len(new))
    assert reservation is not None
    write_into(tier, reservation, new)
    tier.install(header(key(22), new), reservation)
    assert read(tier, key(22)) == new
    assert arena_bytes(tier, lease.ranges) == old
    check_accounting(tier, {key(22): PAGE}, leases=1, retired=2)
    tier.release(lease)
    check_accounting(tier, {key(22): PAGE})


def test_install_checks_length_and_is_once_only(tier: DramTier) -> None:
    data = payload(24, PAGE)
    reservation = tier.reserve(len(data))
    assert reservation is not None
    write_into(tier, reservation, data)
    with pytest.raises(ValueError):
        tier.install(header(key(24), data[:-1]), reservation)
    # A refused install changes nothing: the reservation is still open and installable.
    assert reservation.open
    check_accounting(tier, {}, reserved=1)
    tier.install(header(key(24), data), reservation)
    with pytest.raises(ValueError):
        tier.install(header(key(25), data), reservation)
    assert key(25) not in tier
    check_accounting(tier, {key(24): PAGE})


def test_cancel_frees_and_is_idempotent(tier: DramTier) -> None:
    reservation = tier.reserve(5 * PAGE)
    assert reservation is not None
    check_accounting(tier, {}, reserved=5)
    tier.cancel(reservation)
    check_accounting(tier, {})
    tier.cancel(reservation)
    check_accounting(tier, {})
    with pytest.raises(ValueError):
        tier.install(header(key(26), payload(26, 5 * PAGE)), reservation)
    assert key(26) not in tier
    # All pages are free again, and freed exactly once.
    for n in range(PAGES):
        assert write(tier, key(30 + n), payload(30 + n, PAGE))
    assert tier.reserve(1) is None


def test_cancel_after_install_leaves_the_block_alone(tier: DramTier) -> None:
    data = payload(27, 2 * PAGE)
    reservation = tier.reserve(len(data))
    assert reservation is not None
    write_into(tier, reservation, data)
    tier.install(header(key(27), data), reservation)
    tier.cancel(reservation)
    assert read(tier, key(27)) == data
    check_accounting(tier, {key(27): len(data)})
    assert write(tier, key(28), payload(28, (PAGES - 2) * PAGE))
    assert read(tier, key(27)) == data


def test_reserve_returns_none_when_full_and_refuses_bad_lengths(tier: DramTier) -> None:
    assert tier.reserve(PAGES * PAGE + 1) is None
    check_accounting(tier, {})
    assert write(tier, key(29), payload(29, 6 * PAGE))
    assert tier.reserve(3 * PAGE) is None
    check_accounting(tier, {key(29): 6 * PAGE})
    reservation = tier.reserve(2 * PAGE)
    assert reservation is not None
    assert tier.reserve(1) is None
    check_accounting(tier, {key(29): 6 * PAGE}, reserved=2)
    for bad in (0, -1):
        with pytest.raises(ValueError):
            tier.reserve(bad)
    check_accounting(tier, {key(29): 6 * PAGE}, reserved=2)
    tier.cancel(reservation)


def test_reserve_in_a_zero_capacity_tier_is_none() -> None:
    empty = DramTier(0, page_size=PAGE)
    assert empty.reserve(1) is None
    assert empty.stats()["reserved_bytes"] == 0


def test_fragmented_reservation_round_trip(tier: DramTier) -> None:
    survivors = fragment(tier)
    data = payload(31, 3 * PAGE + 1)
    reservation = tier.reserve(len(data))
    assert reservation is not None
    assert len(reservation.ranges) == 4, "expected a reservation over several page runs"
    assert [size for _, size in reservation.ranges] == [PAGE, PAGE, PAGE, 1]
    live = {k: len(v) for k, v in survivors.items()}
    check_accounting(tier, live, reserved=4)
    write_into(tier, reservation, data)
    assert bytes(tier.reserved_payload(reservation)) == data
    tier.install(header(key(31), data), reservation)
    assert read(tier, key(31)) == data
    assert tier.extents(key(31)) == reservation.ranges
    for k, v in survivors.items():
        assert read(tier, k) == v
    check_accounting(tier, {**live, key(31): len(data)})
    # A lease of it, a remove and a release give the four runs back.
    lease = tier.lease(key(31))
    assert lease is not None and arena_bytes(tier, lease.ranges) == data
    tier.remove_sync([key(31)])
    check_accounting(tier, live, leases=1, retired=4)
    tier.release(lease)
    check_accounting(tier, live)
    assert tier.stats()["free_runs"] == 4


def test_fragmented_reservation_cancel_gives_every_run_back(tier: DramTier) -> None:
    survivors = fragment(tier)
    reservation = tier.reserve(4 * PAGE)
    assert reservation is not None and len(reservation.ranges) == 4
    assert tier.reserve(1) is None
    tier.cancel(reservation)
    check_accounting(tier, {k: len(v) for k, v in survivors.items()})
    assert tier.stats()["free_runs"] == 4
    assert write(tier, key(32), payload(32, 4 * PAGE))


def test_accounting_through_a_mixed_sequence(tier: DramTier) -> None:
    """Leases, replacements, reservations and cancels interleaved; the model never drifts."""
    live: dict[bytes, int] = {}
    assert write(tier, key(1), payload(1, 100))
    live[key(1)] = 100
    assert write(tier, key(2), payload(2, PAGE + 1))
    live[key(2)] = PAGE + 1
    check_accounting(tier, live)
    lease1 = tier.lease(key(1))
    lease2 = tier.lease(key(2))
    assert lease1 is not None and lease2 is not None
    reservation = tier.reserve(PAGE - 1)
    assert reservation is not None
    check_accounting(tier, live, leases=2, reserved=1)
    assert write(tier, key(1), payload(3, 200))  # replaces a leased one-page block
    live[key(1)] = 200
    check_accounting(tier, live, leases=2, reserved=1, retired=1)
    tier.remove_sync([key(2)])
    del live[key(2)]
    check_accounting(tier, live, leases=2, reserved=1, retired=3)
    write_into(tier, reservation, payload(4, PAGE - 1))
    tier.install(header(key(2), payload(4, PAGE - 1)), reservation)
    live[key(2)] = PAGE - 1
    check_accounting(tier, live, leases=2, retired=3)
    tier.release(lease2)
    check_accounting(tier, live, leases=1, retired=1)
    tier.release(lease1)
    check_accounting(tier, live)
    assert read(tier, key(1)) == payload(3, 200)
    assert read(tier, key(2)) == payload(4, PAGE - 1)
    tier.remove_sync([key(1), key(2)])
    check_accounting(tier, {})
    assert tier.stats()["free_runs"] == 1
