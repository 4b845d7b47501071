"""Writes over the shared-memory plane: reserve pages, write the bytes, commit.

:class:`ShmWrites` is the writing half of :class:`~kvstore.client.shm.ShmDataPlane` (which
extends it), and it has one write path: :meth:`ShmWrites.reserve` reserves pages for blocks
(``RESERVE``) and hands out a :class:`~kvstore.client.shm_reserve.ShmReservation`, the caller
writes each block into it, and the reservation's commit stores them. :meth:`ShmWrites.put` is
that path with the caller's values: reserve, write each value, commit, within one deadline.
Where the server sealed its arena (every current server: the arena is then mapped read-only
here, :mod:`kvstore.server.shm_window`) a reservation's views are runs of this client's write
window (:mod:`kvstore.client.shm_window`) and ``COMMIT_FROM`` names where they lie; the server
copies them into the reserved pages. An older server's unsealed arena takes them in the reserved
pages themselves, and a plain ``COMMIT``. A block the window has no room for right now is
reported like one the arena has no room for: the caller sends it another way.

A window run is given back once the server has answered the commit (it has copied the bytes by
then) or the reservation was cancelled; where a commit's answer never came (a timeout), its runs
are left taken, since the server may still be copying out of them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.buffers import byte_view
from kvstore.client.shm_attach import ShmAttachment
from kvstore.client.shm_reserve import ShmReservation, SlotState, write_runs
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
_Runs = dict[int, tuple[int, int]]  # slot id: its window run (offset, length)


@dataclass(slots=True)
class _Reserved:
    """What one ``RESERVE`` exchange gave this client, until its commit or cancel: per key its
    state, slot id and pages (a window run, or runs of an older server's writable arena), the
    window runs by slot id, and the socket the slots belong to."""

    conn: ShmConnection
    window: ClientWindow | None
    states: list[SlotState]
    ids: list[int | None]
    ranges: list[_Ranges]
    runs: _Runs

    @property
    def slots(self) -> list[int]:
        """The slot ids reserved."""
        return [slot for slot in self.ids if slot is not None]


class ShmWrites(ShmAttachment):
    """Puts and in-place reservations over the shared-memory plane (see the module docstring)."""

    def put(
        self,
        keys: Sequence[bytes],
        values: Sequence[Any],
        timeout: float | None = None,
        retention: Retention = KEEP,
    ) -> tuple[PutResult, list[int]]:
        """Write blocks through the arena, stored with ``retention``: reserved as by
        :meth:`reserve`, each value written into its pages, committed, all within ``timeout``.

        Returns the result and the indices of values the arena (or the write window) had no
        room for, which the caller sends another way.
        """
        check_pairs(keys, values, "values")
        views = [byte_view(value) for value in values]
        deadline = self._deadline(timeout)
        held = self._reserve(keys, [len(view) for view in views], deadline, retention)
        into = self._arena if held.window is None else held.window.bytes
        try:
            for index, slot in enumerate(held.ids):
                if slot is not None:
                    write_runs(into, held.ranges[index], views[index])
        except BaseException:
            self._finish(held, [], held.slots, retention, None)
            raise
        stored, present, dropped = self._finish(held, held.slots, [], retention, deadline)
        no_room = [index for index, state in enumerate(held.states) if state == "no_room"]
        return PutResult(stored, present + held.states.count("present"), dropped), no_room

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
        held = self._reserve(keys, sizes, self._deadline(timeout), retention)
        with self._lock:
            self._reserving.append(held.conn)

        def finish(commit: list[int], cancel: list[int]) -> PutResult:
            with self._lock:
                if held.conn in self._reserving:
                    self._reserving.remove(held.conn)
            return PutResult(*self._finish(held, commit, cancel, retention, None))

        states, ids, ranges = held.states, held.ids, held.ranges
        if held.window is None:
            return ShmReservation(self._arena, states, ids, ranges, finish, self.registration)
        window, registration = held.window.bytes, self.window_registration
        return ShmReservation(window, states, ids, ranges, finish, registration)

    def _reserve(
        self, keys: Sequence[bytes], sizes: Sequence[int], deadline: float, retention: Retention
    ) -> _Reserved:
        """Reserve pages for blocks of ``sizes`` bytes (``RESERVE``) before ``deadline``, and a
        window run for each where the arena is sealed (a slot the window has no room for is
        cancelled and reported ``"no_room"``); the socket is the caller's until :meth:`_finish`."""
        conn = self._take(deadline)
        held = _Reserved(conn, None, [], [], [], {})
        states, ids, ranges, runs = held.states, held.ids, held.ranges, held.runs
        # A failure closes the socket, and the server then gives back whatever it reserved.
        try:
            with closed_on_failure(conn):
                window = held.window = self._window_on(conn, deadline) if self.sealed else None
                reply = conn.call(Op.RESERVE, pack_reserve(keys, sizes, retention), deadline)
                refused: list[int] = []
                for size, item in zip(sizes, read_reserve_reply(reply, len(keys)), strict=True):
                    if isinstance(item, Lent):
                        offset = None if window is None else window.take(size)
                        if window is None or offset is not None:
                            ids.append(item.id)
                            states.append("reserved")
                            if offset is None:
                                ranges.append(list(item.ranges))
                            else:
                                runs[item.id] = (offset, size)
                                ranges.append([(offset, size)])
                            continue
                        refused.append(item.id)  # reserved, but no room in the window
                        item = ReserveSlot.NO_ROOM
                    ids.append(None)
                    ranges.append([])
                    states.append("present" if item == ReserveSlot.PRESENT else "no_room")
                if refused:
                    conn.send(Op.CANCEL, pack_ids(refused))
        except BaseException:
            _give_back(held.window, runs, list(runs))  # the server gave the reservations back
            raise
        return held

    def _finish(
        self,
        held: _Reserved,
        commit: list[int],
        cancel: list[int],
        retention: Retention,
        commit_by: float | None,
    ) -> tuple[int, int, int]:
        """Commit and cancel slots of ``held``, then give its socket back; the commit's
        (stored, already present, dropped). ``commit_by``: the instant past which nothing is
        committed (DeadlineExceededError; ``None``: the default timeout from now)."""
        conn, window, runs = held.conn, held.window, held.runs
        counts = (0, 0, 0)
        late = commit_by is not None and commit and time.monotonic() > commit_by
        if late:
            cancel, commit = cancel + commit, []
        with closed_on_failure(conn):
            if cancel:
                conn.send(Op.CANCEL, pack_ids(cancel))
                _give_back(window, runs, cancel)
            if commit:
                deadline = self._deadline(None) if commit_by is None else commit_by
                offsets = [runs[slot][0] for slot in commit] if window is not None else []
                counts = self._commit(conn, commit, offsets, retention, deadline)
                _give_back(window, runs, commit)
        self._give_back(conn)
        if late:
            raise DeadlineExceededError("deadline exceeded while writing blocks")
        return counts

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


def _give_back(window: ClientWindow | None, runs: _Runs, slots: list[int]) -> None:
    """Give back the window runs of ``slots`` (none where no window is used)."""
    if window is None:
        return
    for slot in slots:
        run = runs.pop(slot, None)
        if run is not None:
            window.give(*run)
