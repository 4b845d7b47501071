"""Write windows: how a client that may not write the arena hands the server the blocks it puts.

The dram arena is sealed against writable mappings (:mod:`kvstore.tiers.dram`): every client of
the shared-memory plane maps it read-only, so no process, whatever namespace it says it works in,
can change a byte of a block it did not put, nor of one it did once committed. A client writes
instead into a *window*: a memfd of its own, sent once per connection (``WINDOW``,
``SCM_RIGHTS``). It reserves pages as before, copies each block into its window, and
``COMMIT_FROM`` says where each block lies there; the server copies the bytes into the reserved
pages, then commits them, computing their checksum from the arena's copy (what readers get).
Whatever the client does to its window afterwards (or meanwhile) can only change its own blocks,
and only before they are committed.

The server maps a window read-only and trusts nothing about it: it must be a memfd sealed against
shrinking (the server adds the seal itself where the client has not; a file that shrank under a
copy would crash the server), no larger than :func:`window_limit`, and every offset a commit names
is checked against its size. A commit copies at most the bytes the connection has reserved, which
its session's quota bounds.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
from collections.abc import Sequence

import numpy as np

from kvstore.errors import InvalidRequestError
from kvstore.tiers.dram import DramTier, Reservation

__all__ = ["WriteWindow", "window_limit"]

_NEEDED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW

#: A window may be this large even where the arena is smaller (a few blocks in flight).
_MIN_LIMIT = 64 << 20


def window_limit(arena: DramTier) -> int:
    """The largest window a client of ``arena`` may send: more than the arena buys nothing."""
    return max(arena.capacity, _MIN_LIMIT)


class WriteWindow:
    """A client's write window, mapped read-only by the server (see the module docstring)."""

    def __init__(self, fd: int, max_bytes: int) -> None:
        """Adopt ``fd`` (closed here, whatever happens); :class:`InvalidRequestError` for one
        that is no memfd, cannot be sealed against resizing, is empty or over ``max_bytes``."""
        try:
            try:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
                if seals & _NEEDED_SEALS != _NEEDED_SEALS:
                    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _NEEDED_SEALS)
            except OSError as exc:
                raise InvalidRequestError(
                    f"a write window must be a memfd that can be sealed against resizing ({exc})"
                ) from None
            size = os.fstat(fd).st_size
            if not 0 < size <= max_bytes:
                raise InvalidRequestError(
                    f"a write window of {size} bytes; it must be 1 to {max_bytes} bytes"
                )
            self._mapping = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self.size = size
        self._bytes = np.frombuffer(self._mapping, dtype=np.uint8)

    def land(
        self, arena: DramTier, reservations: Sequence[Reservation], offsets: Sequence[int]
    ) -> None:
        """Copy each reservation's bytes from its offset in the window into its arena pages;
        every offset is checked before anything is copied."""
        for reservation, offset in zip(reservations, offsets, strict=True):
            if offset + reservation.length > self.size:
                raise InvalidRequestError(
                    f"a block of {reservation.length} bytes at offset {offset} lies past the end "
                    f"of this connection's {self.size}-byte write window"
                )
        for reservation, offset in zip(reservations, offsets, strict=True):
            at = offset
            for start, length in reservation.ranges:
                arena.range_view(start, length)[:] = self._bytes[at : at + length]
                at += length

    def close(self) -> None:
        """Unmap the window (a view still exported keeps it mapped until it goes)."""
        self._bytes = np.empty(0, dtype=np.uint8)
        with contextlib.suppress(BufferError):
            self._mapping.close()
