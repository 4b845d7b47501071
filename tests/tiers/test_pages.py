"""Tests of :class:`kvstore.tiers.pages.PageAllocator`, the DRAM arena's page bookkeeping.

An allocation succeeds exactly when enough pages are free (one best-fit run if one is long enough,
otherwise several runs), fails with ``None`` having changed nothing, never hands a page out twice,
and released runs coalesce back into one run.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.tiers.pages import Extent, PageAllocator


def take(pages: PageAllocator, count: int) -> list[Extent]:
    extents = pages.allocate(count)
    assert extents is not None, f"could not allocate {count} pages"
    return extents


def pages_of(extents: list[Extent]) -> list[int]:
    return [page for first, count in extents for page in range(first, first + count)]


def test_fresh_allocator_is_one_free_run() -> None:
    pages = PageAllocator(8)
    assert (pages.num_pages, pages.free_pages, pages.used_pages, pages.free_runs) == (8, 8, 0, 1)


def test_empty_allocator() -> None:
    pages = PageAllocator(0)
    assert pages.free_runs == 0
    assert pages.allocate(1) is None
    assert pages.allocate(0) == []


def test_negative_page_count_is_refused() -> None:
    with pytest.raises(ValueError, match="num_pages"):
        PageAllocator(-1)


def test_allocate_and_release() -> None:
    pages = PageAllocator(8)
    extents = pages.allocate(3)
    assert extents == [Extent(0, 3)]
    assert (pages.free_pages, pages.used_pages) == (5, 3)
    more = pages.allocate(5)
    assert more == [Extent(3, 5)]
    assert pages.free_pages == 0
    assert pages.free_runs == 0
    pages.release(extents)
    pages.release(more)
    assert (pages.free_pages, pages.used_pages, pages.free_runs) == (8, 0, 1)
    assert pages.allocate(8) == [Extent(0, 8)]


def test_zero_or_negative_count_allocates_nothing() -> None:
    pages = PageAllocator(4)
    assert pages.allocate(0) == []
    assert pages.allocate(-3) == []
    assert pages.free_pages == 4


def test_best_fit_takes_the_shortest_run_that_fits() -> None:
    pages = PageAllocator(10)
    a, b, c, d = (take(pages, n) for n in (3, 1, 2, 4))
    assert a == [Extent(0, 3)] and b == [Extent(3, 1)]
    assert c == [Extent(4, 2)] and d == [Extent(6, 4)]
    pages.release(a)  # free run of 3 at 0
    pages.release(c)  # free run of 2 at 4
    assert pages.free_runs == 2
    # Two pages fit both runs; best fit takes the 2-run exactly, leaving the 3-run whole.
    assert pages.allocate(2) == [Extent(4, 2)]
    assert pages.allocate(3) == [Extent(0, 3)]
    assert pages.free_pages == 0


def test_best_fit_prefers_shorter_run_over_earlier_longer_one() -> None:
    pages = PageAllocator(12)
    first, _, _, gap, _ = (take(pages, n) for n in (5, 1, 1, 2, 3))
    assert first == [Extent(0, 5)] and gap == [Extent(7, 2)]
    pages.release(first)  # run of 5 at 0
    pages.release(gap)  # run of 2 at 7
    assert pages.allocate(1) == [Extent(7, 1)]  # from the 2-run, not the 5-run
    assert pages.free_runs == 2
    assert pages.free_pages == 6


def test_fragmented_allocation_uses_several_extents() -> None:
    pages = PageAllocator(8)
    blocks = [take(pages, 1) for _ in range(8)]
    for block in blocks[::2]:  # free pages 0, 2, 4, 6: four runs of one page
        pages.release(block)
    assert pages.free_runs == 4
    assert pages.free_pages == 4
    extents = pages.allocate(3)
    assert extents is not None
    assert len(extents) == 3
    assert all(count == 1 for _, count in extents)
    taken = pages_of(extents)
    assert len(set(taken)) == 3
    assert set(taken) <= {0, 2, 4, 6}
    assert pages.free_pages == 1


def test_multi_extent_takes_longest_runs_first() -> None:
    pages = PageAllocator(10)
    parts = [take(pages, n) for n in (1, 1, 3, 1, 2, 2)]
    pages.release(parts[0])  # run of 1 at 0
    pages.release(parts[2])  # run of 3 at 2
    pages.release(parts[4])  # run of 2 at 6
    extents = pages.allocate(5)
    assert extents is not None
    assert sum(count for _, count in extents) == 5
    assert extents[0] == Extent(2, 3)
    assert extents[1] == Extent(6, 2)
    assert pages.free_pages == 1


def test_released_neighbours_coalesce_into_one_run() -> None:
    pages = PageAllocator(6)
    blocks = [take(pages, 2) for _ in range(3)]
    assert pages.free_runs == 0
    pages.release(blocks[0])
    pages.release(blocks[2])
    assert pages.free_runs == 2
    pages.release(blocks[1])  # joins both neighbours
    assert pages.free_runs == 1
    assert pages.allocate(6) == [Extent(0, 6)]


def test_multi_extent_release_coalesces_back_to_one_run() -> None:
    pages = PageAllocator(8)
    singles = [take(pages, 1) for _ in range(8)]
    for block in singles[::2]:
        pages.release(block)
    spread = pages.allocate(4)
    assert spread is not None and len(spread) == 4
    for block in singles[1::2]:
        pages.release(block)
    pages.release(spread)
    assert (pages.free_runs, pages.free_pages) == (1, 8)
    assert pages.allocate(8) == [Extent(0, 8)]


def test_not_enough_pages_returns_none_and_changes_nothing() -> None:
    pages = PageAllocator(8)
    held = [take(pages, 1) for _ in range(8)]
    for block in held[::3]:  # free pages 0, 3, 6
        pages.release(block)
    assert (pages.free_pages, pages.free_runs) == (3, 3)
    assert pages.allocate(4) is None
    assert (pages.free_pages, pages.free_runs) == (3, 3)
    # What was free is still allocatable, all of it.
    assert sorted(pages_of(pages.allocate(3) or [])) == [0, 3, 6]


def test_double_release_is_an_error() -> None:
    pages = PageAllocator(4)
    block = pages.allocate(2)
    assert block is not None
    pages.release(block)
    with pytest.raises(ValueError, match="double release"):
        pages.release(block)
    assert pages.free_pages == 4


def test_double_release_of_run_end_is_an_error() -> None:
    pages = PageAllocator(4)
    first = pages.allocate(2)
    second = pages.allocate(2)
    assert first is not None and second is not None
    pages.release(first)
    pages.release(second)  # coalesced: one free run 0..4
    with pytest.raises(ValueError, match="double release"):
        pages.release(second)
    assert pages.free_pages == 4


def test_double_release_inside_a_coalesced_run_is_an_error() -> None:
    pages = PageAllocator(3)
    a, b, c = (take(pages, 1) for _ in range(3))
    pages.release(a)
    pages.release(c)
    pages.release(b)  # all three coalesce into one run 0..3
    with pytest.raises(ValueError, match="double release"):
        pages.release(b)
    assert pages.free_pages == 3


# --- property: random alloc/free sequences ------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    num_pages=st.integers(min_value=0, max_value=64),
    operations=st.lists(
        st.tuples(st.booleans(), st.integers(min_value=0, max_value=20)), max_size=80
    ),
)
def test_random_sequences_keep_accounting_and_never_share_a_page(
    num_pages: int, operations: list[tuple[bool, int]]
) -> None:
    pages = PageAllocator(num_pages)
    live: list[list[Extent]] = []
    owned: set[int] = set()
    for allocate, number in operations:
        if allocate or not live:
            free_before = pages.free_pages
            extents = pages.allocate(number)
            if number > free_before:
                assert extents is None
                assert pages.free_pages == free_before
                continue
            assert extents is not None
            taken = pages_of(extents)
            assert len(taken) == max(number, 0)
            assert len(set(taken)) == len(taken)
            assert all(0 <= page < num_pages for page in taken)
            assert not owned & set(taken), "a page was handed out twice"
            owned |= set(taken)
            if taken:
                live.append(extents)
        else:
            extents = live.pop(number % len(live))
            pages.release(extents)
            owned -= set(pages_of(extents))
        assert pages.free_pages == num_pages - len(owned)
        assert pages.used_pages == len(owned)
        # Taking every free page must succeed and yield exactly the pages nobody owns; giving
        # them back restores the same free space.
        runs_before = pages.free_runs
        everything = pages.allocate(pages.free_pages)
        assert everything is not None
        assert sorted(pages_of(everything)) == sorted(set(range(num_pages)) - owned)
        pages.release(everything)
        assert pages.free_runs == runs_before
        assert pages.free_pages == num_pages - len(owned)
    for extents in live:
        pages.release(extents)
    assert pages.free_pages == num_pages
    assert pages.free_runs == (1 if num_pages else 0)
