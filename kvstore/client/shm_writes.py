"""Writes over the shared-memory plane: reserve pages, hand the server the bytes, commit.

:class:`ShmWrites` is the writing half of :class:`~kvstore.client.shm.ShmDataPlane` (which
extends it). A put reserves pages for its blocks (``RESERVE``), puts each block's bytes where the
server takes them, and commits. Where the server sealed its arena (every current server: the
arena is then mapped read-only here, :mod:`kvstore.server.shm_window`) the bytes go into this
client's write window (:mod:`kvstore.client.shm_window`) and ``COMMIT_FROM`` names where they lie;
the server copies them into the reserved pages. An older server's unsealed arena takes them in
the reserved pages themselves, and a plain ``COMMIT``. A block the window has no room for right
now is reported like one the arena has no room for: the caller sends it another way.

A window run is given back once the server has answered the commit (it has copied the bytes by
then) or the reservation was cancelled; where a commit's answer never came (a timeout), its runs
are left taken, since the server may still be copying out of them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvstore.buffers import byte_view
from kvstore.client.shm_attach import ShmAttachment
from kvstore.client.shm_reserve import ShmReservation, SlotState
from kvstore.client.shm_socket import ShmConnection, closed_on_failure
from kvstore.client.shm_window import ClientWindow
from kvstore.errors import DeadlineExceededError, InvalidRequestError
from kvstore.protocol.checks import check_pairs
from kvstore.protocol.shm_frames import Op, pack_ids
from kvstore.protocol.shm_messages import (
    Lent,
    ReserveSlot,
    pack_commit,
    pack_commit_from,
    pack_reserve,
    read_commit_reply,
    read_reserve_reply,
)
from kvstore.retention import KEEP, Retention
from kvstore.types import PutResult

__all__ = ["ShmWrites"]

_Ranges = list[tuple[int, int]]


class ShmWrites(ShmAttachment):
    """Puts and in-place reservations over the shared-memory plane (see the module docstring)."""

    def put(
        self,
        keys: Sequence[bytes],
        values: Sequence[Any],
        timeout: float | None = None,
        retention: Retention = KEEP,
    ) -> tuple[PutResult, list[int]]:
        """Write blocks through the arena, stored with ``retention``.

        Returns the result and the indices of values the arena (or the write window) had no
        room for, which the caller sends another way.
        """
        check_pairs(keys, values, "values")
        views = [byte_view(value) for value in values]
        present = 0
        no_room: list[int] = []
        deadline = self._deadline(timeout)
        taken: list[tuple[int, int]] = []  # window runs: (offset, length)
        answered = True
        with self._connection(deadline) as conn:
            window = self._window_on(conn, deadline) if self.sealed else None
            asked = pack_reserve(keys, [len(view) for view in views], retention)
            reply = conn.call(Op.RESERVE, asked, deadline)
            reserved: list[int] = []
            refused: list[int] = []  # reserved by the server, but no room in the window
            try:
                for index, (view, item) in enumerate(
                    zip(views, read_reserve_reply(reply, len(keys)), strict=True)
                ):
                    if isinstance(item, Lent):
                        if window is None:
                            reserved.append(item.id)
                            self._write(item.ranges, view)
                        elif (offset := window.take(len(view))) is None:
                            refused.append(item.id)
                            no_room.append(index)
                        else:
                            reserved.append(item.id)
                            taken.append((offset, len(view)))
                            window.write(offset, np.frombuffer(view, dtype=np.uint8))
                    elif item == ReserveSlot.PRESENT:
                        present += 1
                    else:
                        no_room.append(index)
                if refused:
                    conn.send(Op.CANCEL, pack_ids(refused))
                if not reserved:
                    return PutResult(0, present, 0), no_room
                if time.monotonic() > deadline:
                    conn.send(Op.CANCEL, pack_ids(reserved))
                    reserved = []
                    raise DeadlineExceededError("deadline exceeded while writing blocks")
                answered = False
                counts = self._commit(conn, reserved, [o for o, _ in taken], retention, deadline)
                answered = True
            except BaseException:
                if reserved and answered:
                    conn.send(Op.CANCEL, pack_ids(reserved))
                raise
            finally:
                if window is not None and answered:
                    for offset, length in taken:
                        window.give(offset, length)
        stored, already, dropped = counts
        return PutResult(stored, present + already, dropped), no_room

    def _commit(
        self,
        conn: ShmConnection,
        ids: list[int],
        offsets: list[int],
        retention: Retention,
        deadline: float,
    ) -> tuple[int, int, int]:
        """Commit reserved slots ``ids`` (from ``offsets`` in the window where it is used)."""
        if self.sealed:
            reply = conn.call(Op.COMMIT_FROM, pack_commit_from(ids, offsets, retention), deadline)
        else:
            reply = conn.call(Op.COMMIT, pack_commit(ids, retention), deadline)
        return read_commit_reply(reply)

    def reserve(
        self,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        timeout: float | None = None,
        retention: Retention = KEEP,
    ) -> ShmReservation:
        """Reserve room for blocks of ``sizes`` bytes that the caller writes in place and then
        commits (:class:`~kvstore.client.shm_reserve.ShmReservation`), stored with
        ``retention``; the socket stays with the reservation until then. The views are pages of
        the write window where the arena is read-only here, else the reserved arena pages."""
        if len(sizes) != len(keys):
            raise InvalidRequestError(f"got {len(sizes)} sizes for {len(keys)} keys")
        if any(size < 0 for size in sizes):
            raise InvalidRequestError("block sizes must be >= 0")
        deadline = self._deadline(timeout)
        conn = self._take(deadline)
        states: list[SlotState] = []
        ids: list[int | None] = []
        ranges: list[_Ranges] = []
        runs: dict[int, tuple[int, int]] = {}  # slot id: its window run
        window: ClientWindow | None = None
        # A failure closes the socket, and the server then gives back whatever it reserved.
        with closed_on_failure(conn):
            window = self._window_on(conn, deadline) if self.sealed else None
            reply = conn.call(Op.RESERVE, pack_reserve(keys, sizes, retention), deadline)
            refused: list[int] = []
            for size, item in zip(sizes, read_reserve_reply(reply, len(keys)), strict=True):
                if isinstance(item, Lent):
                    if window is None:
                        ids.append(item.id)
                        ranges.append(list(item.ranges))
                        states.append("reserved")
                        continue
                    offset = window.take(size)
                    if offset is not None:
                        runs[item.id] = (offset, size)
                        ids.append(item.id)
                        ranges.append([(offset, size)])
                        states.append("reserved")
                        continue
                    refused.append(item.id)
                    item = ReserveSlot.NO_ROOM
                ids.append(None)
                ranges.append([])
                states.append("present" if item == ReserveSlot.PRESENT else "no_room")
            if refused:
                conn.send(Op.CANCEL, pack_ids(refused))
        with self._lock:
            self._reserving.append(conn)

        def finish(commit: list[int], cancel: list[int]) -> PutResult:
            return self._finish_reservation(conn, commit, cancel, retention, runs, window)

        if window is None:
            return ShmReservation(self._arena, states, ids, ranges, finish, self.registration)
        return ShmReservation(window.bytes, states, ids, ranges, finish, self.window_registration)

    def _finish_reservation(
        self,
        conn: ShmConnection,
        commit: list[int],
        cancel: list[int],
        retention: Retention,
        runs: dict[int, tuple[int, int]],
        window: ClientWindow | None,
    ) -> PutResult:
        """Commit and cancel a :meth:`reserve`'s slots, then give its socket back."""
        result = PutResult()
        with self._lock:
            if conn in self._reserving:
                self._reserving.remove(conn)
        with closed_on_failure(conn):
            if cancel:
                conn.send(Op.CANCEL, pack_ids(cancel))
                _give_back(window, runs, cancel)
            if commit:
                offsets = [runs[slot][0] for slot in commit] if window is not None else []
                counts = self._commit(conn, commit, offsets, retention, self._deadline(None))
                _give_back(window, runs, commit)
                result = PutResult(*counts)
        self._give_back(conn)
        return result

    def _write(self, ranges: Sequence[tuple[int, int]], view: memoryview) -> None:
        """Copy ``view`` into reserved pages of an arena this client may write (older servers)."""
        source = np.frombuffer(view, dtype=np.uint8)
        at = 0
        for offset, size in ranges:
            self._arena[offset : offset + size] = source[at : at + size]
            at += size


def _give_back(
    window: ClientWindow | None, runs: dict[int, tuple[int, int]], slots: list[int]
) -> None:
    """Give back the window runs of ``slots`` (none where no window is used)."""
    if window is None:
        return
    for slot in slots:
        run = runs.pop(slot, None)
        if run is not None:
            window.give(*run)
