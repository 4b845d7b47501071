"""A page allocator for one preallocated arena.

The arena is cut into ``num_pages`` equal pages. A block takes ``ceil(length / page_size)`` pages,
as one contiguous run when a free run is long enough (best fit), otherwise as several runs, so an
allocation succeeds exactly when enough pages are free: fragmentation can cost a copy per run but
never a failed put. Free runs coalesce with their neighbours on release. Nothing is allocated from
the Python heap per page; the bookkeeping is two dicts of free runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

__all__ = ["Extent", "PageAllocator", "byte_ranges"]


class Extent(NamedTuple):
    """A run of ``pages`` contiguous pages starting at page ``first``."""

    first: int
    pages: int


def byte_ranges(extents: Sequence[Extent], page_size: int, length: int) -> list[tuple[int, int]]:
    """Byte ranges ``(offset, size)`` that hold ``length`` payload bytes laid over ``extents``."""
    remaining = length
    ranges = []
    for first, count in extents:
        size = min(count * page_size, remaining)
        ranges.append((first * page_size, size))
        remaining -= size
    return ranges


class PageAllocator:
    """Hands out and takes back runs of pages of a fixed-size arena."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        self.num_pages = num_pages
        self.free_pages = num_pages
        # Free runs indexed by both ends so that a released run merges in O(1).
        self._run_at: dict[int, int] = {0: num_pages} if num_pages else {}
        self._run_ending: dict[int, int] = {num_pages: 0} if num_pages else {}
        # Extents handed out (first page -> length), so a bad or double release is caught.
        self._handed_out: dict[int, int] = {}

    @property
    def used_pages(self) -> int:
        """Pages currently handed out."""
        return self.num_pages - self.free_pages

    @property
    def free_runs(self) -> int:
        """Number of separate free runs: 1 means no fragmentation."""
        return len(self._run_at)

    def allocate(self, count: int) -> list[Extent] | None:
        """Take ``count`` pages; ``None`` (and nothing changed) if fewer are free."""
        if count <= 0:
            return []
        if count > self.free_pages:
            return None
        best: tuple[int, int] | None = None  # (length, first) of the shortest run that fits
        for first, length in self._run_at.items():
            if length >= count and (best is None or length < best[0]):
                best = (length, first)
                if length == count:
                    break
        if best is not None:
            return [self._take(best[1], count)]
        extents: list[Extent] = []
        remaining = count
        for first, length in sorted(self._run_at.items(), key=lambda run: -run[1]):
            taken = min(length, remaining)
            extents.append(self._take(first, taken))
            remaining -= taken
            if remaining == 0:
                break
        return extents

    def release(self, extents: list[Extent]) -> None:
        """Give pages back; each extent must have come from :meth:`allocate`."""
        for first, count in extents:
            if count <= 0:
                continue
            end = first + count
            if self._handed_out.get(first) != count:
                raise ValueError(f"double release (or never handed out): pages {first}..{end}")
            del self._handed_out[first]
            self.free_pages += count
            before = self._run_ending.pop(first, None)
            if before is not None:  # merge with the free run that ends where this one starts
                del self._run_at[before]
                first = before
            after = self._run_at.pop(end, None)
            if after is not None:  # merge with the free run that starts where this one ends
                del self._run_ending[end + after]
                end += after
            self._run_at[first] = end - first
            self._run_ending[end] = first

    def _take(self, first: int, count: int) -> Extent:
        length = self._run_at.pop(first)
        del self._run_ending[first + length]
        if length > count:
            rest = first + count
            self._run_at[rest] = length - count
            self._run_ending[first + length] = rest
        self.free_pages -= count
        self._handed_out[first] = count
        return Extent(first, count)
