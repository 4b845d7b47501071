"""Tests of :class:`kvstore.client.shm_window.ClientWindow`: the client's write window.

A real memfd, sealed against resizing (the server refuses one that is not), and a first-fit
allocator of page runs: runs never overlap, given-back runs merge with their neighbours, the
lowest free offset is handed out first, and a request larger than any free run gets ``None``.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import random

import numpy as np

from kvstore.client.shm_window import ClientWindow

PAGE = mmap.PAGESIZE


def test_the_window_is_a_memfd_sealed_against_resizing() -> None:
    window = ClientWindow(10 * PAGE)
    try:
        seals = fcntl.fcntl(window.fd, fcntl.F_GET_SEALS)
        assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW
        assert os.fstat(window.fd).st_size == window.size == 10 * PAGE
        window.write(PAGE, np.full(3, 9, dtype=np.uint8))
        assert os.pread(window.fd, 4, PAGE) == b"\x09\x09\x09\x00"
    finally:
        window.close()


def test_runs_are_whole_pages_lowest_first_and_merge_when_given_back() -> None:
    window = ClientWindow(8 * PAGE)
    try:
        first, second = window.take(1), window.take(PAGE + 1)
        assert (first, second) == (0, PAGE)  # one page, then two
        assert window.take(6 * PAGE) is None  # 5 pages free
        assert window.take(5 * PAGE) == 3 * PAGE
        window.give(PAGE, PAGE + 1)
        window.give(0, 1)
        assert window.take(3 * PAGE) == 0  # the two runs given back merged into one
        window.give(3 * PAGE, 5 * PAGE)
        window.give(0, 3 * PAGE)
        assert window.free_bytes == 8 * PAGE and window.take(8 * PAGE) == 0
    finally:
        window.close()


def test_random_takes_and_gives_never_overlap() -> None:
    rng = random.Random(41)
    window = ClientWindow(64 * PAGE)
    held: dict[int, int] = {}
    try:
        for _ in range(2000):
            if held and rng.random() < 0.5:
                offset = rng.choice(list(held))
                window.give(offset, held.pop(offset))
                continue
            length = rng.randrange(1, 6 * PAGE)
            offset = window.take(length)
            if offset is None:
                continue
            end = offset + length
            assert end <= window.size
            assert all(end <= o or o + n <= offset for o, n in held.items()), (offset, length)
            held[offset] = length
        for offset, length in held.items():
            window.give(offset, length)
        assert window.free_bytes == window.size
    finally:
        window.close()
