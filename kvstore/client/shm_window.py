"""The client's write window: where its puts' bytes wait for the server to copy them into the arena.

A server that seals its arena (every current one) lets clients map it read-only
(:mod:`kvstore.server.shm_window`), so a block is written here instead: :class:`ClientWindow` is a
memfd of this process, mapped writable, sent to the server once per connection. Each write
takes a run of it (:meth:`ClientWindow.take`), copies the block in, has the server copy it out
with ``COMMIT_FROM`` and gives the run back (:meth:`ClientWindow.give`). Runs are handed out
lowest offset first, so the pages in use stay near the start and the window's memory is what the
largest burst of writes in flight needed (the memfd is sparse: untouched pages cost nothing).

Thread-safe: connections of several threads write through one window at once.
"""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import mmap
import os
import threading
from typing import Any

import numpy as np

__all__ = ["WINDOW_BYTES", "ClientWindow"]

#: The window's size at most (the arena's size where that is smaller): what may be in flight.
WINDOW_BYTES = 1 << 30
#: Runs are whole pages, so that each block starts page-aligned (DMA and copies like that).
_GRAIN = mmap.PAGESIZE


class ClientWindow:
    """A writable memfd window of ``size`` bytes with a first-fit allocator of page runs."""

    def __init__(self, size: int) -> None:
        size = max(_GRAIN, -(-size // _GRAIN) * _GRAIN)
        self.fd = os.memfd_create("kvstore-write-window", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            # The server refuses a window that could shrink under its copies.
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
            self._mapping = mmap.mmap(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise
        self.size = size
        #: The window as writable ``uint8``.
        self.bytes: np.ndarray[Any, np.dtype[np.uint8]] = np.frombuffer(
            self._mapping, dtype=np.uint8
        )
        self._lock = threading.Lock()
        self._starts = [0]  # free runs, sorted by start, never adjacent
        self._sizes = [size]

    def take(self, length: int) -> int | None:
        """The offset of a free run of at least ``length`` bytes, now taken; ``None`` if no
        run is that large (the caller sends that block another way)."""
        need = max(_GRAIN, -(-length // _GRAIN) * _GRAIN)
        with self._lock:
            for index, free in enumerate(self._sizes):
                if free >= need:
                    start = self._starts[index]
                    if free == need:
                        del self._starts[index], self._sizes[index]
                    else:
                        self._starts[index] += need
                        self._sizes[index] -= need
                    return start
        return None

    def give(self, offset: int, length: int) -> None:
        """Give back the run :meth:`take` returned for ``length`` bytes at ``offset``."""
        size = max(_GRAIN, -(-length // _GRAIN) * _GRAIN)
        with self._lock:
            index = bisect.bisect(self._starts, offset)
            self._starts.insert(index, offset)
            self._sizes.insert(index, size)
            # Merge with the next run, then with the previous one.
            if index + 1 < len(self._starts) and offset + size == self._starts[index + 1]:
                self._sizes[index] += self._sizes.pop(index + 1)
                del self._starts[index + 1]
            if index and self._starts[index - 1] + self._sizes[index - 1] == offset:
                self._sizes[index - 1] += self._sizes.pop(index)
                del self._starts[index]

    @property
    def free_bytes(self) -> int:
        """Bytes not taken (for tests and stats)."""
        with self._lock:
            return sum(self._sizes)

    def write(self, offset: int, data: Any) -> None:
        """Copy ``data`` (a ``uint8`` array) into the window at ``offset``."""
        self.bytes[offset : offset + len(data)] = data

    def close(self) -> None:
        """Close the memfd and unmap (a view still exported keeps the mapping until it goes)."""
        self.bytes = np.empty(0, dtype=np.uint8)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        with contextlib.suppress(BufferError):
            self._mapping.close()
