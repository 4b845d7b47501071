"""What the tiers that cut one preallocated region into pages (``dram``, ``hbm``) share."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvstore.tiers.base import Tier
from kvstore.tiers.pages import Extent, PageAllocator, byte_ranges

__all__ = ["PagedTier"]


class PagedTier(Tier):
    """A tier whose space is ``capacity // page_size`` pages handed out by a PageAllocator.

    Subclasses call :meth:`_init_pages` first in ``__init__`` and keep their blocks, by key, in
    ``_blocks``.
    """

    page_size: int
    capacity: int
    _pages: PageAllocator
    _blocks: dict[bytes, Any]

    def _init_pages(self, capacity: int, page_size: int) -> int:
        """Check ``page_size``, round ``capacity`` down to whole pages; the number of pages."""
        if page_size <= 0:
            raise ValueError(f"page_size must be > 0, got {page_size}")
        self.page_size = page_size
        num_pages = capacity // page_size
        self.capacity = num_pages * page_size
        self._pages = PageAllocator(num_pages)
        return num_pages

    def footprint(self, length: int) -> int:
        """Whole pages: ``ceil(length / page_size) * page_size``."""
        return -(-length // self.page_size) * self.page_size

    @property
    def used(self) -> int:
        """Bytes of pages handed out."""
        return self._pages.used_pages * self.page_size

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def _ranges(self, extents: Sequence[Extent], length: int) -> list[tuple[int, int]]:
        return byte_ranges(extents, self.page_size, length)
