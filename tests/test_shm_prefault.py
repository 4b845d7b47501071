"""Tests of :class:`kvstore.client.shm_prefault.ArenaPrefaulter` on a real memfd mapping.

The server side is not needed: a memfd with some pages written (resident) and some never touched
(holes) is exactly what a client maps. ``/proc/self/smaps`` says how much of the mapping this
process has in its page tables; ``st_blocks`` of the memfd says how much memory it holds.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator

import numpy as np
import pytest

from kvstore.client import shm_prefault
from kvstore.client.shm_prefault import ArenaPrefaulter

MiB = 1 << 20
PAGE = mmap.PAGESIZE


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
    """A 40 MiB memfd whose first 3 MiB and a 1 MiB run at 20 MiB hold data, written through a
    mapping that is gone again: the reader's mapping starts with nothing in its page tables."""
    fd = os.memfd_create("prefault-test")
    os.ftruncate(fd, 40 * MiB)
    writer = mmap.mmap(fd, 40 * MiB)
    writer[: 3 * MiB] = b"\x01" * (3 * MiB)
    writer[20 * MiB : 21 * MiB] = b"\x02" * MiB
    writer.close()
    mapping = mmap.mmap(fd, 40 * MiB)
    view = np.frombuffer(mapping, dtype=np.uint8)
    yield fd, mapping, view
    os.close(fd)  # the mapping goes with the last view of it


def test_only_resident_pages_are_faulted_in(arena: tuple[int, mmap.mmap, np.ndarray]) -> None:
    fd, _, view = arena
    address = view.ctypes.data
    held = os.fstat(fd).st_blocks
    assert mapped_bytes(address) == 0
    prefaulter = ArenaPrefaulter(address, view.nbytes)
    assert prefaulter.wait(timeout=10)
    assert prefaulter.populated == 4 * MiB
    assert mapped_bytes(address) == 4 * MiB
    # The holes stayed holes: faulting them in would have made the kernel allocate them.
    assert os.fstat(fd).st_blocks == held
    assert view[0] == 1 and view[20 * MiB] == 2  # the data is what was written


def test_stop_ends_the_thread_between_slices(
    arena: tuple[int, mmap.mmap, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, _, view = arena
    monkeypatch.setattr(shm_prefault, "SLICE_BYTES", PAGE)  # 10240 slices: far from done
    prefaulter = ArenaPrefaulter(view.ctypes.data, view.nbytes)
    prefaulter.stop(timeout=5)
    assert prefaulter.wait(timeout=0)
    assert prefaulter.populated < 4 * MiB
