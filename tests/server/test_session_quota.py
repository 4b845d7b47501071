"""The per-session quota of :mod:`kvstore.server.sessions`: what one holder may keep of the arena.

A session holding something is refused more past its quota with :class:`CapacityError`, keeping
nothing of the refused request (checked against the arena's own accounting); a session holding
nothing gets what fits, and the blocks past its quota inline (reads) or as "no room" (writes).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import pytest

from kvstore.errors import CapacityError, InvalidRequestError, KVStoreError
from kvstore.keys import Namespace
from kvstore.server.sessions import ArenaSessions, Leased, Reserved
from kvstore.store import TieredStore
from kvstore.tiers.dram import DramTier

PAGE = 4096
NS = Namespace(model="session-quota-test").fingerprint()
KEYS = [bytes([i]) * 16 for i in range(6)]
VALUES = [os.urandom(PAGE) for _ in KEYS]


@pytest.fixture
async def sessions() -> AsyncIterator[ArenaSessions]:
    store = TieredStore([DramTier(16 * PAGE, page_size=PAGE)])
    await store.put(KEYS, VALUES, NS)
    yield ArenaSessions(store, max_bytes_per_session=3 * PAGE)
    await store.close()


def dram(sessions: ArenaSessions) -> dict[str, int]:
    return dict(sessions.store.stats()["tiers"]["dram"])


async def test_a_session_holding_leases_is_refused_more_and_keeps_nothing_of_it(
    sessions: ArenaSessions,
) -> None:
    session = sessions.open()
    (first,) = await session.acquire(KEYS[:1], NS)
    assert isinstance(first, Leased) and session.held_bytes == PAGE
    with pytest.raises(CapacityError, match="limit of 12288"):
        await session.acquire(KEYS[1:4], NS)  # two would fit, the third not: none kept
    assert session.held_bytes == PAGE and dram(sessions)["leases"] == 1
    with pytest.raises(CapacityError):
        await session.reserve([b"n" * 16] * 1, [3 * PAGE], NS)
    assert dram(sessions)["reserved_bytes"] == 0
    more = await session.acquire(KEYS[1:3], NS)  # up to the quota exactly is fine
    assert all(isinstance(item, Leased) for item in more) and session.held_bytes == 3 * PAGE
    session.release([first.id, *(item.id for item in more if isinstance(item, Leased))])
    assert session.held_bytes == 0 and dram(sessions)["leases"] == 0


async def test_a_session_holding_nothing_gets_the_rest_inline_or_as_no_room(
    sessions: ArenaSessions,
) -> None:
    session = sessions.open()
    answers = await session.acquire(KEYS, NS)
    assert [type(a).__name__ for a in answers] == ["Leased"] * 3 + ["bytes"] * 3
    assert answers[3:] == VALUES[3:]
    assert dram(sessions)["leases"] == 3 and session.held_bytes == 3 * PAGE
    sessions.close(session)
    writer = sessions.open()
    new = [bytes([100 + i]) * 16 for i in range(4)]
    reserved = await writer.reserve(new, [PAGE] * 4, NS)
    assert [isinstance(r, Reserved) for r in reserved] == [True, True, True, False]
    assert reserved[3] is None and dram(sessions)["reserved_bytes"] == 3 * PAGE
    ids = [r.id for r in reserved if isinstance(r, Reserved)]
    assert (await writer.commit(ids, NS)).stored == 3
    assert writer.held_bytes == 0
    # A bad request is an error whatever the quota says.
    with pytest.raises(InvalidRequestError):
        await writer.reserve(new[:1], [0], NS)
    # Keys past the quota are checked too (the store's check_reserve, on the whole request),
    # though the store is asked to reserve only those that fit.
    for lengths in ([PAGE] * 3 + [0], [PAGE] * 3 + [99 * PAGE]):
        with pytest.raises(KVStoreError):
            await writer.reserve(new, lengths, NS)
        assert writer.held_bytes == 0 and dram(sessions)["reserved_bytes"] == 0
    sessions.close(writer)
    assert dram(sessions)["leases"] == 0 and dram(sessions)["reserved_bytes"] == 0
