"""Arena sessions: what one holder has taken from the store's dram arena, named by ids.

Both data planes lend arena pages out instead of copying payloads: a reader gets leases
(:meth:`TieredStore.acquire`) on the pages of the blocks it reads, a writer gets reservations
(:meth:`TieredStore.reserve`) of pages it fills and then commits. What is lent belongs to a
session, which names each item by an id, gives back what its holder releases, commits or cancels,
and gives back everything else when it is closed: the shared-memory server holds one session per
connection (closed when the socket goes), the UCX server one per transfer (closed when the transfer
ends, however it ends). Either way nothing lent can outlive its holder, so a client that dies
cannot leak arena space or pins.

Sessions run on the store's event loop, like every other caller of the store.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Literal, NamedTuple, TypeVar, overload

import numpy as np

from kvstore.errors import InvalidRequestError
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

    def __init__(self, store: TieredStore, ids: Iterator[int]) -> None:
        self.store = store
        self._ids = ids
        #: Open leases by id.
        self.leases: dict[int, DramLease] = {}
        #: Open reservations by id, each with the key it is for.
        self.reservations: dict[int, tuple[bytes, Reservation]] = {}

    async def acquire(
        self, keys: Sequence[bytes], namespace: bytes
    ) -> list[Leased | bytes | memoryview | None]:
        """:meth:`TieredStore.acquire` the keys; the leases stay open here until released.

        Per key: a :class:`Leased`, the payload itself (a block that could not be brought into
        the arena) or ``None`` (a miss).
        """
        answers: list[Leased | bytes | memoryview | None] = []
        for item in await self.store.acquire(keys, namespace):
            if isinstance(item, DramLease):
                lease_id = next(self._ids)
                self.leases[lease_id] = item
                answers.append(Leased(lease_id, item))
            else:
                answers.append(item)
        return answers

    def release(self, ids: Iterable[int]) -> None:
        """Give back the leases named by ``ids``; an id this session does not hold is ignored."""
        leases = [self.leases.pop(i) for i in ids if i in self.leases]
        self.store.release(leases)

    async def reserve(
        self, keys: Sequence[bytes], lengths: Sequence[int], namespace: bytes
    ) -> list[Reserved | Literal["present"] | None]:
        """:meth:`TieredStore.reserve` pages for the keys; they stay open here until committed
        or cancelled.

        Per key: a :class:`Reserved`, ``"present"`` (already stored) or ``None`` (no room).
        """
        answers: list[Reserved | Literal["present"] | None] = []
        reserved = await self.store.reserve(keys, lengths, namespace)
        for key, item in zip(keys, reserved, strict=True):
            if isinstance(item, Reservation):
                reservation_id = next(self._ids)
                self.reservations[reservation_id] = (key, item)
                answers.append(Reserved(reservation_id, key, item))
            else:
                answers.append(item)
        return answers

    async def commit(self, ids: Sequence[int], namespace: bytes) -> PutResult:
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
        try:
            return await self.store.commit(written, namespace)
        except BaseException:
            self.store.cancel([reservation for _, reservation in written])  # idempotent
            raise

    def cancel(self, ids: Iterable[int]) -> None:
        """Give back the reservations named by ``ids``; an id this session does not hold is
        ignored."""
        given_back = [self.reservations.pop(i)[1] for i in ids if i in self.reservations]
        self.store.cancel(given_back)

    def give_back(self) -> None:
        """Give back every lease and reservation still open."""
        leases = list(self.leases.values())
        reservations = [reservation for _, reservation in self.reservations.values()]
        self.leases.clear()
        self.reservations.clear()
        try:
            self.store.release(leases)
        finally:
            self.store.cancel(reservations)


S = TypeVar("S", bound=ArenaSession)


class ArenaSessions:
    """The open sessions of one server over ``store``: ids unique among them, and their counts."""

    def __init__(self, store: TieredStore) -> None:
        self.store = store
        self._ids = itertools.count(1)
        self._open: set[ArenaSession] = set()

    @overload
    def open(self) -> ArenaSession: ...

    @overload
    def open(self, kind: type[S]) -> S: ...

    def open(self, kind: type[ArenaSession] = ArenaSession) -> ArenaSession:
        """A new, empty session (of ``kind``, a subclass that carries more about its holder)."""
        session = kind(self.store, self._ids)
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
