"""The arena-session core both data planes lend pages through (:mod:`kvstore.server.sessions`).

A session names what it took by ids unique across the server, gives back only what it holds,
refuses a commit naming anything it does not hold before committing anything, and gives back
everything still open when it is closed. Checked against the arena's own accounting.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import numpy as np
import pytest

from kvstore.errors import InvalidRequestError
from kvstore.keys import Namespace
from kvstore.server.sessions import ArenaSessions, Leased, Reserved, gather, scatter
from kvstore.store import TieredStore
from kvstore.tiers.dram import DramTier

PAGE = 4096
NS = Namespace(model="arena-sessions-test").fingerprint()
KEY = b"k" * 16


@pytest.fixture
async def sessions() -> AsyncIterator[ArenaSessions]:
    store = TieredStore([DramTier(8 * PAGE, page_size=PAGE)])
    await store.put([KEY], [os.urandom(PAGE)], NS)
    yield ArenaSessions(store)
    await store.close()


def dram(sessions: ArenaSessions) -> dict[str, int]:
    return dict(sessions.store.stats()["tiers"]["dram"])


async def test_ids_are_unique_across_sessions_and_closing_gives_everything_back(
    sessions: ArenaSessions,
) -> None:
    first, second = sessions.open(), sessions.open()
    (leased,) = await first.acquire([KEY], NS)
    (reserved,) = await second.reserve([b"n" * 16], [PAGE], NS)
    assert isinstance(leased, Leased) and isinstance(reserved, Reserved)
    assert leased.id != reserved.id
    assert len(sessions) == 2 and sessions.stats() == {"leases": 1, "reservations": 1}
    assert dram(sessions)["leases"] == 1 and dram(sessions)["reserved_bytes"] == PAGE
    second.release([leased.id])  # another session's id: ignored
    assert dram(sessions)["leases"] == 1
    sessions.close(first)
    sessions.close(second)
    assert len(sessions) == 0 and sessions.stats() == {"leases": 0, "reservations": 0}
    assert dram(sessions)["leases"] == 0 and dram(sessions)["reserved_bytes"] == 0


async def test_a_commit_naming_an_unknown_or_repeated_id_commits_nothing(
    sessions: ArenaSessions,
) -> None:
    session = sessions.open()
    (reserved,) = await session.reserve([b"n" * 16], [PAGE], NS)
    assert isinstance(reserved, Reserved)
    with pytest.raises(InvalidRequestError, match="no open reservation"):
        await session.commit([reserved.id, reserved.id + 1000], NS)
    with pytest.raises(InvalidRequestError, match="twice"):
        await session.commit([reserved.id, reserved.id], NS)
    assert list(session.reservations) == [reserved.id]
    result = await session.commit([reserved.id], NS)
    assert result.stored == 1 and not session.reservations
    assert sessions.store.lookup([b"n" * 16], NS).hits == 1
    session.cancel([reserved.id])  # committed: nothing left to give back
    sessions.close(session)
    assert dram(sessions)["reserved_bytes"] == 0


async def test_gather_and_scatter_follow_the_runs_in_order(sessions: ArenaSessions) -> None:
    arena = sessions.store.arena
    assert arena is not None
    ranges = [(5 * PAGE, 100), (2 * PAGE, 50)]
    data = np.arange(150, dtype=np.uint8)
    scatter(arena, ranges, data)
    assert bytes(arena.range_view(2 * PAGE, 50)) == bytes(data[100:])
    assert bytes(gather(arena, ranges, 150)) == bytes(data)
