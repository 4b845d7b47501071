"""Tests of :class:`kvstore.client.shm_prefault.ArenaPrefaulter` on a real memfd mapping.

The server side is not needed: a memfd with some pages written (blocks) and some never touched
(holes) is what a client maps, and the prefaulter is told where the blocks lie, as the published
index tells it. ``/proc/self/smaps`` says how much of the mapping this process has in its page
tables; ``st_blocks`` of the memfd says how much memory the memfd holds. On a kernel without
``MADV_POPULATE_READ`` (before 5.14) the prefaulter must do nothing and say so.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from kvstore.client import shm_prefault
from kvstore.client.shm_prefault import ArenaPrefaulter, merged_page_runs

MiB = 1 << 20
PAGE = mmap.PAGESIZE
#: Blocks of the test arena: (offset, length), not page-aligned at their ends.
BLOCKS = np.array([[0, 3 * MiB - 100], [20 * MiB, MiB], [20 * MiB + MiB, 10]], dtype=np.uint64)


def populate_supported() -> bool:
    """Whether this kernel knows MADV_POPULATE_READ (tried on one anonymous page)."""
    madvise = shm_prefault._madvise()  # the prefaulter's own binding
    if madvise is None:
        return False
    probe = mmap.mmap(-1, PAGE)
    try:
        address = ctypes.addressof(ctypes.c_char.from_buffer(probe))
        return bool(madvise(address, PAGE, shm_prefault.MADV_POPULATE_READ) == 0)
    finally:
        probe.close()


def mapped_bytes(address: int) -> int:
    """Rss of the mapping that starts at ``address``: its pages in this process's page tables."""
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
                inside = int(fields[0].split("-")[0], 16) == address
            elif inside and fields[0] == "Rss:":
                return int(fields[1]) * 1024
    raise AssertionError(f"no mapping at {address:#x}")


@pytest.fixture
def arena() -> Iterator[tuple[int, mmap.mmap, np.ndarray]]:
    """A 40 MiB memfd holding BLOCKS (the rest never written), written through a mapping that
    is gone again: the reader's mapping starts with nothing in its page tables."""
    fd = os.memfd_create("prefault-test")
    os.ftruncate(fd, 40 * MiB)
    writer = mmap.mmap(fd, 40 * MiB)
    for offset, length in BLOCKS.tolist():
        writer[offset : offset + length] = b"\x01" * length
    writer.close()
    mapping = mmap.mmap(fd, 40 * MiB)
    yield fd, mapping, np.frombuffer(mapping, dtype=np.uint8)
    os.close(fd)  # the mapping goes with the last view of it


def test_runs_are_page_aligned_merged_and_inside_the_arena() -> None:
    ranges = np.array(
        [[5 * PAGE + 1, 10], [0, PAGE + 1], [2 * PAGE, PAGE], [9 * PAGE, 0], [30 * PAGE, PAGE]],
        dtype=np.uint64,
    )
    # The second and third merge (they touch); the empty row and the one past the end go.
    assert merged_page_runs(ranges, 20 * PAGE) == [(0, 3 * PAGE), (5 * PAGE, 6 * PAGE)]


def test_only_the_blocks_pages_are_faulted_in(arena: tuple[int, mmap.mmap, np.ndarray]) -> None:
    fd, mapping, view = arena
    address = view.ctypes.data
    held = os.fstat(fd).st_blocks
    assert mapped_bytes(address) == 0
    prefaulter = ArenaPrefaulter(mapping, address, lambda: BLOCKS)
    assert prefaulter.wait(timeout=10)
    if not populate_supported():
        assert prefaulter.populated == 0 and not prefaulter.completed
        return
    assert prefaulter.completed
    assert prefaulter.populated == 3 * MiB + MiB + PAGE  # runs rounded out to whole pages
    assert mapped_bytes(address) >= prefaulter.populated
    # The holes stayed holes: faulting them in would have made the kernel allocate them.
    assert os.fstat(fd).st_blocks == held
    assert view[0] == 1 and view[20 * MiB] == 1 and view[10 * MiB] == 0


def test_stop_before_the_first_call_faults_nothing_in(
    arena: tuple[int, mmap.mmap, np.ndarray],
) -> None:
    _, mapping, view = arena
    listing = threading.Event()

    def slow_blocks() -> np.ndarray:
        listing.wait(5)  # the index scan still running when the owner closes
        return BLOCKS

    prefaulter = ArenaPrefaulter(mapping, view.ctypes.data, slow_blocks)
    assert not prefaulter.stop(timeout=0.05)  # still running: the owner must keep the mapping
    listing.set()
    assert prefaulter.wait(timeout=5)
    assert prefaulter.populated == 0 and not prefaulter.completed
