"""Mapping the pages of the arena's blocks into this process before the first reads touch them.

A client maps the server's arena once, but the kernel fills in its page tables one fault at a
time, on the first read of each page. A worker that reads a block in place (a lease) or copies it
out pays those faults inside the copy, on the engine's critical path: about 0.6 ms of the 4 ms
that copying an 8K-token prefix (32 MiB) took on 2 cores (BENCHMARKS.md), every time the block
sits on pages this process has not read before. :class:`ArenaPrefaulter` does that work once, on
a background thread: it takes the blocks the published index lists in the client's namespace
(:meth:`~kvstore.protocol.dram_index.IndexReader.published`) and faults their pages in, read-only
(``MADV_POPULATE_READ``, Linux 5.14; nothing happens on older kernels). Only pages that hold
blocks, so it makes the kernel allocate no arena memory (the server keeps every page it ever
used, and a page-locked arena is resident whole: faulting in the whole mapping would map all of
it). Blocks stored later fault once, on first read, as before. It costs about 30 ms of one core
per GiB of blocks, once, and 2 MiB of page tables per GiB (what reading every block once costs
anyway).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["ArenaPrefaulter", "merged_page_runs"]

logger = logging.getLogger(__name__)

#: ``madvise`` advice that faults a range in readable (Linux 5.14; not in Python's mmap module).
MADV_POPULATE_READ = 22
#: Bytes faulted in per call at most: bounds how long :meth:`ArenaPrefaulter.stop` waits.
SLICE_BYTES = 64 << 20


def _madvise() -> Any:
    """The C library's ``madvise``, typed; ``None`` where it is missing."""
    try:
        # The process's own symbols: libc is loaded already (find_library would run ldconfig).
        function = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


def merged_page_runs(ranges: np.ndarray[Any, Any], limit: int) -> list[tuple[int, int]]:
    """``(start, end)`` page-aligned runs covering the ``(offset, length)`` rows of ``ranges``
    that lie inside ``[0, limit)``, sorted, overlapping and touching runs merged."""
    page = mmap.PAGESIZE
    runs: list[tuple[int, int]] = []
    rows = sorted((int(o), int(n)) for o, n in ranges.tolist() if n > 0 and o + n <= limit)
    for offset, length in rows:
        start, end = offset // page * page, -(-(offset + length) // page) * page
        if runs and start <= runs[-1][1]:
            runs[-1] = (runs[-1][0], max(runs[-1][1], end))
        else:
            runs.append((start, end))
    return runs


class ArenaPrefaulter:
    """Faults in the pages of the blocks ``blocks()`` lists, on a daemon thread.

    ``mapping`` is the arena's mapping, which this object keeps a reference to (so that it is
    not unmapped under the thread when its owner is dropped); ``address`` is where it starts.
    ``blocks()`` runs on the thread and returns ``(offset, length)`` rows. The owner calls
    :meth:`stop` before it unmaps the arena, and leaves it mapped if :meth:`stop` says the
    thread is still running. Best effort: where ``madvise`` refuses, it logs at debug level
    and stops.
    """

    def __init__(
        self, mapping: mmap.mmap, address: int, blocks: Callable[[], np.ndarray[Any, Any]]
    ) -> None:
        self._mapping = mapping
        self._address = address
        self._blocks = blocks
        self._stopping = threading.Event()
        #: Bytes faulted in so far.
        self.populated = 0
        #: Whether every run was faulted in (False while running, or after a stop or a refusal).
        self.completed = False
        self._thread = threading.Thread(target=self._run, name="kvstore-prefault", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop after the current call; whether the thread has ended (then it no longer
        touches the mapping)."""
        self._stopping.set()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the thread has ended, however it ended; whether it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        madvise = _madvise()
        if madvise is None:
            logger.debug("arena prefault: no madvise in this C library")
            return
        try:
            runs = merged_page_runs(self._blocks(), len(self._mapping))
        except Exception:  # a closed index, or one that went away: nothing to do
            logger.debug("arena prefault: cannot list the blocks", exc_info=True)
            return
        for start, end in runs:
            for at in range(start, end, SLICE_BYTES):
                if self._stopping.is_set():
                    return
                size = min(SLICE_BYTES, end - at)
                if madvise(self._address + at, size, MADV_POPULATE_READ) != 0:
                    # EINVAL before Linux 5.14; nothing else is a reason to go on either.
                    logger.debug("arena prefault: madvise failed (errno %d)", ctypes.get_errno())
                    return
                self.populated += size
        self.completed = True
        logger.debug("arena prefault: %d MiB of blocks mapped", self.populated >> 20)
