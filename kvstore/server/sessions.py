"""Arena sessions: what one holder has taken from the store's dram arena, named by ids.

Both data planes lend arena pages out instead of copying payloads: a reader gets leases
(:meth:`TieredStore.acquire`) on the pages of the blocks it reads, a writer gets reservations
(:meth:`TieredStore.reserve`) of pages it fills and then commits. What is lent belongs to a
session, which names each item by an id, gives back what its holder releases, commits or cancels,
and gives back everything else when it is closed: the shared-memory server holds one session per
connection (closed when the socket goes), the UCX server one per transfer (closed when the transfer
ends, however it ends). Either way nothing lent can outlive its holder, so a client that dies
cannot leak arena space or pins.

A session may hold at most ``max_bytes`` of the arena leased and reserved together (set by
:class:`ArenaSessions`): one holder cannot pin or fill the whole arena. A request that would take
a session already holding something past that is refused with :class:`CapacityError`
(RESOURCE_EXHAUSTED) and keeps nothing. A session holding nothing (how a well-behaved client
starts every call) is never refused for a batch larger than the quota: the blocks past it come
back inline (reads) or as "no room" (writes, which the client then sends over gRPC), so nothing
past the quota stays held.

Sessions run on the store's event loop, like every other caller of the store. What they take
they take from the store (:meth:`TieredStore.acquire`, :meth:`TieredStore.reserve`), whose
:class:`~kvstore.store.arena.ArenaLender` keeps each lease and reservation consistent with its
index; a session only names what its holder has and gives it back.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Literal, NamedTuple, TypeVar, overload

import numpy as np

from kvstore.errors import CapacityError, InvalidRequestError
from kvstore.retention import KEEP, Retention
from kvstore.store import TieredStore
from kvstore.tiers.dram import DramLease, DramTier, Reservation
from kvstore.types import PutResult

__all__ = ["ArenaSession", "ArenaSessions", "Leased", "Reserved", "gather", "scatter"]

logger = logging.getLogger(__name__)


class Leased(NamedTuple):
    """A lease a session holds, under the id its holder releases it by."""

    id: int
    lease: DramLease


class Reserved(NamedTuple):
    """A reservation a session holds for ``key``, under the id its holder commits it by."""

    id: int
    key: bytes
    reservation: Reservation


class ArenaSession:
    """The leases and reservations one holder has open; create it with :meth:`ArenaSessions.open`.

    Ids come from a counter shared by every session of a server, so an id names one item for the
    server's whole life; a session only ever looks up its own.
    """

    def __init__(
        self, store: TieredStore, ids: Iterator[int], max_bytes: int | None = None
    ) -> None:
        self.store = store
        self._ids = ids
        #: The most arena bytes this session may hold leased and reserved at once (None: no cap).
        self.max_bytes = max_bytes
        #: Arena bytes its open leases and reservations hold.
        self.held_bytes = 0
        #: Open leases by id.
        self.leases: dict[int, DramLease] = {}
        #: Open reservations by id, each with the key it is for.
        self.reservations: dict[int, tuple[bytes, Reservation]] = {}

    async def acquire(
        self, keys: Sequence[bytes], namespace: bytes
    ) -> list[Leased | bytes | memoryview | None]:
        """:meth:`TieredStore.acquire` the keys; the leases stay open here until released.

        Per key: a :class:`Leased`, the payload itself (a block that could not be brought into
        the arena, or one past the quota of a session that held nothing) or ``None`` (a miss).
        Raises :class:`CapacityError`, holding nothing new, when a session that holds leases or
        reservations already would pass its quota.
        """
        fresh = self.held_bytes == 0
        if not fresh:
            self._check_room(1)
        acquired = await self.store.acquire(keys, namespace)
        answers: list[Leased | bytes | memoryview | None] = []
        kept: list[int] = []
        overflow: list[DramLease] = []
        try:
            for item in acquired:
                if not isinstance(item, DramLease):
                    answers.append(item)
                    continue
                size = _bytes_of(item.ranges)
                if self.max_bytes is not None and self.held_bytes + size > self.max_bytes:
                    # Past the quota: a session that held nothing gets the payload inline (what
                    # gRPC would send), one that holds leases already is refused below.
                    overflow.append(item)
                    answers.append(self._copy_out(item) if fresh else None)
                    continue
                lease_id = next(self._ids)
                self.leases[lease_id] = item
                self.held_bytes += size
                kept.append(lease_id)
                answers.append(Leased(lease_id, item))
        finally:
            self.store.release(overflow)
        if overflow and not fresh:
            wanted = self.held_bytes + sum(_bytes_of(lease.ranges) for lease in overflow)
            self.release(kept)
            self._check_room(wanted - self.held_bytes)  # raises: ``wanted`` is past the quota
        return answers

    def release(self, ids: Iterable[int]) -> None:
        """Give back the leases named by ``ids``; an id this session does not hold is ignored."""
        leases = [self.leases.pop(i) for i in ids if i in self.leases]
        self.held_bytes -= sum(_bytes_of(lease.ranges) for lease in leases)
        self.store.release(leases)

    async def reserve(
        self,
        keys: Sequence[bytes],
        lengths: Sequence[int],
        namespace: bytes,
        retention: Retention = KEEP,
    ) -> list[Reserved | Literal["present"] | None]:
        """:meth:`TieredStore.reserve` pages for the keys; they stay open here until committed
        or cancelled.

        Per key: a :class:`Reserved`, ``"present"`` (already stored) or ``None`` (no room, or
        past the quota of a session that held nothing). Raises :class:`CapacityError`, reserving
        nothing, when a session holding something already would pass its quota.
        """
        # The whole request is checked first, by the store: past the quota or not, a bad one is
        # an error, not "no room". The quota is checked before anything is reserved (reserving
        # may evict blocks to make room): a session holding something already is refused
        # outright; one holding nothing gets NO_ROOM for the keys past its quota (the client
        # sends those over gRPC).
        self.store.check_reserve(keys, lengths, namespace, retention)
        asked = list(range(len(keys)))
        if self.max_bytes is not None:
            if self.held_bytes and self.held_bytes + sum(lengths) > self.max_bytes:
                self._check_room(sum(lengths))
            room, asked = self.max_bytes - self.held_bytes, []
            for index, length in enumerate(lengths):
                if length <= room:
                    room -= length
                    asked.append(index)
        got = (
            await self.store.reserve(
                [keys[i] for i in asked], [lengths[i] for i in asked], namespace, retention
            )
            if asked
            else []
        )
        reserved: list[Reservation | Literal["present"] | None] = [None] * len(keys)
        for index, item in zip(asked, got, strict=True):
            reserved[index] = item
        self.held_bytes += sum(_bytes_of(r.ranges) for r in got if isinstance(r, Reservation))
        answers: list[Reserved | Literal["present"] | None] = []
        for key, item in zip(keys, reserved, strict=True):
            if isinstance(item, Reservation):
                reservation_id = next(self._ids)
                self.reservations[reservation_id] = (key, item)
                answers.append(Reserved(reservation_id, key, item))
            else:
                answers.append(item)
        return answers

    async def commit(
        self, ids: Sequence[int], namespace: bytes, retention: Retention = KEEP
    ) -> PutResult:
        """:meth:`TieredStore.commit` the written reservations named by ``ids``.

        Every id must name an open reservation of this session, once; otherwise nothing is
        committed. The named reservations are closed however the commit ends (a failed one gives
        them back).
        """
        unknown = [i for i in ids if i not in self.reservations]
        if unknown:
            raise InvalidRequestError(f"no open reservation {unknown[0]} on this connection")
        if len(set(ids)) != len(ids):
            raise InvalidRequestError("COMMIT names a reservation twice")
        written = [self.reservations.pop(i) for i in ids]
        self.held_bytes -= sum(_bytes_of(reservation.ranges) for _, reservation in written)
        try:
            return await self.store.commit(written, namespace, retention)
        except BaseException:
            self.store.cancel([reservation for _, reservation in written])  # idempotent
            raise

    def cancel(self, ids: Iterable[int]) -> None:
        """Give back the reservations named by ``ids``; an id this session does not hold is
        ignored."""
        given_back = [self.reservations.pop(i)[1] for i in ids if i in self.reservations]
        self.held_bytes -= sum(_bytes_of(reservation.ranges) for reservation in given_back)
        self.store.cancel(given_back)

    def give_back(self) -> None:
        """Give back every lease and reservation still open."""
        leases = list(self.leases.values())
        reservations = [reservation for _, reservation in self.reservations.values()]
        self.leases.clear()
        self.reservations.clear()
        self.held_bytes = 0
        try:
            self.store.release(leases)
        finally:
            self.store.cancel(reservations)

    def _copy_out(self, lease: DramLease) -> bytes:
        """The payload under ``lease``, copied out of the arena."""
        arena = self.store.arena
        assert arena is not None  # a lease comes from the arena
        return gather(arena, lease.ranges, _bytes_of(lease.ranges)).tobytes()

    def _check_room(self, more: int) -> None:
        """Raise :class:`CapacityError` if ``more`` bytes would take this session past its
        quota (a session already at it is refused even an empty request's worth)."""
        if self.max_bytes is None or self.held_bytes + more <= self.max_bytes:
            return
        raise CapacityError(
            f"this connection holds {self.held_bytes} bytes of the arena leased or reserved; "
            f"{more} more would pass its limit of {self.max_bytes} "
            "(release or commit what it holds first)"
        )


def _bytes_of(ranges: Sequence[tuple[int, int]]) -> int:
    """Bytes of the arena ``ranges`` covers."""
    return sum(length for _, length in ranges)


S = TypeVar("S", bound=ArenaSession)


class ArenaSessions:
    """The open sessions of one server over ``store``: ids unique among them, and their counts."""

    def __init__(self, store: TieredStore, max_bytes_per_session: int | None = None) -> None:
        self.store = store
        #: The quota each session opened here gets (``None``: none).
        self.max_bytes_per_session = max_bytes_per_session
        self._ids = itertools.count(1)
        self._open: set[ArenaSession] = set()

    @overload
    def open(self) -> ArenaSession: ...

    @overload
    def open(self, kind: type[S]) -> S: ...

    def open(self, kind: type[ArenaSession] = ArenaSession) -> ArenaSession:
        """A new, empty session (of ``kind``, a subclass that carries more about its holder)."""
        session = kind(self.store, self._ids, self.max_bytes_per_session)
        self._open.add(session)
        return session

    def close(self, session: ArenaSession) -> None:
        """Forget ``session`` and give back everything it still holds.

        Never raises (it runs in ``finally`` blocks and done callbacks): a failure is logged.
        """
        self._open.discard(session)
        try:
            session.give_back()
        except Exception:
            logger.exception("giving back an arena session's leases and reservations failed")

    def __len__(self) -> int:
        return len(self._open)

    def stats(self) -> dict[str, int]:
        """Leases and reservations open across every session."""
        return {
            "leases": sum(len(s.leases) for s in self._open),
            "reservations": sum(len(s.reservations) for s in self._open),
        }


def gather(
    arena: DramTier, ranges: Sequence[tuple[int, int]], length: int
) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """A copy of the ``length`` bytes held in the runs of arena pages ``ranges`` names, as one
    contiguous buffer (for a lease in several runs, where one buffer is needed)."""
    out = np.empty(length, dtype=np.uint8)
    done = 0
    for offset, size in ranges:
        out[done : done + size] = arena.range_view(offset, size)
        done += size
    return out


def scatter(
    arena: DramTier, ranges: Sequence[tuple[int, int]], data: np.ndarray[Any, np.dtype[np.uint8]]
) -> None:
    """Copy ``data`` into the runs of arena pages ``ranges`` names, in order (the way back of
    :func:`gather`, for a reservation in several runs)."""
    done = 0
    for offset, size in ranges:
        arena.range_view(offset, size)[:] = data[done : done + size]
        done += size
