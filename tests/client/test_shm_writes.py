"""A shared-memory put is a reservation, written and committed: one write path (in-process server).

:meth:`ShmWrites.put` reserves as :meth:`ShmWrites.reserve` does (``RESERVE``), writes each value
into its pages as :meth:`ShmReservation.write` does and commits as a reservation does
(``COMMIT_FROM``), so whatever a put ends in (stored, a block the window has no room for, a
write that fails, a deadline passed before the commit) leaves the server, the write window and
the socket pool as a reservation ending the same way would: nothing held, every window run given
back, the socket reused.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from harness.polling import apoll

from kvstore.client import shm_writes
from kvstore.client.shm import ShmDataPlane
from kvstore.errors import DeadlineExceededError
from kvstore.keys import Namespace
from kvstore.server.shm import ShmServer
from kvstore.store import TieredStore
from kvstore.tiers.dram import DramTier

PAGE = 4096
NS = Namespace(model="shm-writes-test").fingerprint()


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[ShmServer, ShmDataPlane]]:
    store = TieredStore([DramTier(64 * PAGE, page_size=PAGE)])
    server = ShmServer(store, str(tmp_path / "s.sock"), os.urandom(16))
    await server.start()
    plane = await asyncio.to_thread(ShmDataPlane, server.path, NS)
    try:
        assert plane.sealed  # the window path, what every current server has
        yield server, plane
    finally:
        await asyncio.to_thread(plane.close)
        await server.close()
        await store.close()


def keys(*numbers: int) -> list[bytes]:
    return [bytes([n]) * 16 for n in numbers]


async def nothing_held(server: ShmServer, plane: ShmDataPlane) -> None:
    """Wait until the server holds no reservation (CANCEL is one-way) and check the client."""
    arena = server.store.arena
    assert arena is not None
    await apoll(
        lambda: server.stats()["reservations"] == 0 and arena.stats()["reserved_bytes"] == 0,
        10.0,
        "the reservations given back",
    )
    window = plane._window
    assert window is None or window.free_bytes == window.size
    assert plane._reserving == []


async def test_a_put_stores_reports_present_and_gives_everything_back(
    served: tuple[ShmServer, ShmDataPlane],
) -> None:
    server, plane = served
    values = [os.urandom(PAGE + 5), os.urandom(3 * PAGE)]
    result, no_room = await asyncio.to_thread(plane.put, keys(1, 2), values)
    assert (result.stored, result.already_present, no_room) == (2, 0, [])
    again, no_room = await asyncio.to_thread(plane.put, keys(2, 3), [values[1], b"x" * 10])
    assert (again.stored, again.already_present, no_room) == (1, 1, [])
    assert await asyncio.to_thread(plane.get, keys(1, 2, 3)) == [*values, b"x" * 10]
    await nothing_held(server, plane)
    assert len(plane._idle) == 1  # one socket, reused by every call


async def test_a_block_the_window_has_no_room_for_is_no_room_and_given_back(
    served: tuple[ShmServer, ShmDataPlane],
) -> None:
    server, plane = served
    window = plane.window()
    held = window.take(window.size - 2 * PAGE)  # leaves two pages free
    assert held is not None
    try:
        values = [os.urandom(PAGE), os.urandom(2 * PAGE), os.urandom(PAGE)]
        result, no_room = await asyncio.to_thread(plane.put, keys(4, 5, 6), values)
        assert (result.stored, no_room) == (2, [1])  # 5 did not fit in what was left
        assert await asyncio.to_thread(plane.get, keys(4, 5, 6)) == [values[0], None, values[2]]
    finally:
        window.give(held, window.size - 2 * PAGE)
    await nothing_held(server, plane)


async def test_a_write_that_fails_cancels_the_whole_put(
    served: tuple[ShmServer, ShmDataPlane], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, plane = served
    write = shm_writes.write_runs
    calls = []

    def failing(into: Any, ranges: Any, value: memoryview) -> None:
        calls.append(len(value))
        if len(calls) == 2:
            raise RuntimeError("the caller's buffer went away")
        write(into, ranges, value)

    monkeypatch.setattr(shm_writes, "write_runs", failing)
    with pytest.raises(RuntimeError, match="went away"):
        await asyncio.to_thread(plane.put, keys(7, 8), [b"a" * PAGE, b"b" * PAGE])
    monkeypatch.undo()
    await nothing_held(server, plane)
    assert await asyncio.to_thread(plane.get, keys(7, 8)) == [None, None]


async def test_a_put_past_its_deadline_before_the_commit_stores_nothing(
    served: tuple[ShmServer, ShmDataPlane], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, plane = served

    class Later:
        """The put's clock once its values are written: an hour on (its deadline long past)."""

        @staticmethod
        def monotonic() -> float:
            return time.monotonic() + 3600.0

    monkeypatch.setattr(shm_writes, "time", Later)
    with pytest.raises(DeadlineExceededError, match="while writing blocks"):
        await asyncio.to_thread(plane.put, keys(9), [b"c" * PAGE])
    monkeypatch.undo()
    await nothing_held(server, plane)
    assert len(plane._idle) == 1  # cancelled in order: the socket is still good
    assert await asyncio.to_thread(plane.get, keys(9)) == [None]
    result, _ = await asyncio.to_thread(plane.put, keys(9), [b"c" * PAGE])
    assert result.stored == 1
