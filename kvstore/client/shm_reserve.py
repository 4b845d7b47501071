"""Writing blocks in place: room reserved for a caller that fills it, then commits.

A plain put over shared memory copies each value once, from the caller's buffer into the client's
write window, from which the server copies it into the pages it reserved (the arena is read-only
to clients; an older server's writable arena takes it in the reserved pages themselves). A caller
that *produces* the bytes (the vLLM connector gathering KV blocks out of its paged cache) can
instead write them straight into the window and skip its own buffer:
:meth:`kvstore.KVStoreClient.reserve` hands out a :class:`ShmReservation`, the caller fills the
views, and :meth:`ShmReservation.commit` makes the blocks visible, with their checks computed by
the server from the bytes as committed (exactly as for a put). Blocks the store already holds are
reported ``"present"`` at once, so the caller need not produce them at all.

Until the commit nobody reads the pages; a reservation never committed is cancelled (or given
back by the server when the socket closes), so a crash mid-write stores nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np

from kvstore.buffers import byte_view
from kvstore.client.arena_registration import ArenaRegistration
from kvstore.errors import InvalidRequestError
from kvstore.types import PutResult

__all__ = ["ShmReservation", "SlotState", "write_runs"]

#: What the server answered for one key: pages reserved for it, already stored, or no room.
SlotState = Literal["reserved", "present", "no_room"]
_Ranges = list[tuple[int, int]]


class ShmReservation:
    """Arena pages reserved for blocks the caller writes in place (:meth:`ShmDataPlane.reserve`).

    ``states[i]`` says what happened to key ``i``; for a ``"reserved"`` key, ``views[i]`` is its
    pages as one writable ``uint8`` array of the requested size where they are contiguous (else
    ``None``: use :meth:`write`). Call :meth:`commit` once, after writing, or :meth:`cancel`;
    leaving a ``with`` block without committing cancels. Thread-safe commit/cancel, once.
    ``registration``: the client's mapping of the arena as page-locked for DMA so far, if a
    CUDA caller asked (a device can then copy straight into the views).
    """

    def __init__(
        self,
        arena: np.ndarray[Any, Any],
        states: list[SlotState],
        ids: list[int | None],
        ranges: list[_Ranges],
        finish: Callable[[list[int], list[int]], PutResult],
        registration: ArenaRegistration | None = None,
    ) -> None:
        self.states = states
        self.registration = registration
        self._arena = arena
        self._ids = ids
        self._ranges = ranges
        self._finish: Callable[[list[int], list[int]], PutResult] | None = finish
        self._lock = threading.Lock()
        self.views: list[np.ndarray[Any, Any] | None] = [
            arena[r[0][0] : r[0][0] + r[0][1]] if len(r) == 1 else None for r in ranges
        ]

    def write(self, index: int, value: Any) -> None:
        """Copy ``value`` (bytes-like, numpy array or CPU tensor of the reserved size) into key
        ``index``'s pages, wherever they lie."""
        if self.states[index] != "reserved":
            raise InvalidRequestError(f"key {index} has no reserved pages ({self.states[index]})")
        size = sum(length for _, length in self._ranges[index])
        if len(view := byte_view(value)) != size:
            raise InvalidRequestError(f"key {index} reserved {size} bytes, got {len(view)}")
        write_runs(self._arena, self._ranges[index], view)

    def commit(self, written: Sequence[int] | None = None) -> PutResult:
        """Store the reserved keys in ``written`` (default: every reserved key) and cancel the
        other reservations. The result counts ``"present"`` keys as already present; keys with
        no room are the caller's to send another way."""
        chosen = set(range(len(self.states)) if written is None else written)
        commit: list[int] = []
        cancel: list[int] = []
        for index, slot in enumerate(self._ids):
            if slot is not None:
                (commit if index in chosen else cancel).append(slot)
        result = self._end(commit, cancel)
        present = self.states.count("present")
        return PutResult(result.stored, result.already_present + present, result.dropped)

    def cancel(self) -> None:
        """Give every reserved page back unwritten (nothing if already committed or cancelled)."""
        if self.open:
            self._end([], [slot for slot in self._ids if slot is not None], strict=False)

    def _end(self, commit: list[int], cancel: list[int], *, strict: bool = True) -> PutResult:
        with self._lock:
            finish, self._finish = self._finish, None
        if finish is None:
            if strict:
                raise InvalidRequestError("this reservation was already committed or cancelled")
            return PutResult()
        return finish(commit, cancel)

    @property
    def open(self) -> bool:
        """Whether neither :meth:`commit` nor :meth:`cancel` has run yet."""
        return self._finish is not None

    def __enter__(self) -> ShmReservation:
        return self

    def __exit__(self, *_: object) -> None:
        self.cancel()


def write_runs(
    into: np.ndarray[Any, np.dtype[np.uint8]], ranges: Sequence[tuple[int, int]], value: memoryview
) -> None:
    """Copy ``value`` into the runs ``ranges`` of ``into`` (a write window, or an older server's
    writable arena), in order: how a put and :meth:`ShmReservation.write` fill reserved pages."""
    source = np.frombuffer(value, dtype=np.uint8)
    if len(ranges) == 1:  # always, in a write window: one copy, no slicing of the source
        offset, length = ranges[0]
        into[offset : offset + length] = source
        return
    at = 0
    for offset, length in ranges:
        into[offset : offset + length] = source[at : at + length]
        at += length
