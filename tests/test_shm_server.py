"""``ShmServer``'s request handling, driven in-process (the socket: tests/integration/test_shm.py).

A request is parsed whole before the store is touched, so a malformed frame takes nothing; counts
the peer sends are checked against the frame before anything is built from them.
"""

from __future__ import annotations

import os
import struct
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvstore.keys import Namespace
from kvstore.server.shm import ShmServer, _Session
from kvstore.store import TieredStore
from kvstore.tiers.dram import DramTier
from kvstore.transport.shm_protocol import (
    PROTOCOL_VERSION,
    Cursor,
    Hello,
    Op,
    ProtocolError,
    pack_ids,
    pack_keys,
    unpack_hello,
)

PAGE = 4096
NS = Namespace(model="shm-server-test").fingerprint()
KEY = b"k" * 16


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[ShmServer]:
    store = TieredStore([DramTier(8 * PAGE, page_size=PAGE)])
    await store.put([KEY], [os.urandom(PAGE)], NS)
    yield ShmServer(store, str(tmp_path / "s.sock"), os.urandom(16))
    await store.close()


def session() -> _Session:
    held = _Session()
    held.namespace = NS
    return held


def status(reply: bytes | None) -> int:
    assert reply is not None
    return reply[4]


def dram(server: ShmServer) -> dict[str, int]:
    return dict(server.store.stats()["tiers"]["dram"])


@pytest.mark.parametrize(
    ("op", "body"),
    [
        (Op.ACQUIRE, pack_keys([KEY]) + b"x"),
        (Op.RESERVE, pack_keys([b"n" * 16]) + struct.pack("<Q", PAGE) + b"x"),
        (Op.LOOKUP, pack_keys([KEY]) + b"x"),
    ],
    ids=["acquire", "reserve", "lookup"],
)
async def test_trailing_bytes_are_refused_before_anything_is_taken(
    server: ShmServer, op: int, body: bytes
) -> None:
    held = session()
    reply = await server._dispatch(held, op, memoryview(body))
    assert status(reply) == 3  # INVALID_ARGUMENT
    assert not held.leases and not held.reservations
    assert dram(server)["leases"] == 0 and dram(server)["reserved_bytes"] == 0


async def test_a_commit_with_trailing_bytes_stores_nothing(server: ShmServer) -> None:
    held = session()
    reply = await server._dispatch(
        held, Op.RESERVE, memoryview(pack_keys([b"n" * 16]) + struct.pack("<Q", PAGE))
    )
    assert status(reply) == 0
    (reservation_id,) = held.reservations
    reply = await server._dispatch(held, Op.COMMIT, memoryview(pack_ids([reservation_id]) + b"x"))
    assert status(reply) == 3
    assert server.store.lookup([b"n" * 16], NS).hits == 0
    server._give_back(held)  # what closing the socket does
    assert dram(server)["reserved_bytes"] == 0


def test_counts_are_checked_against_the_frame_before_use() -> None:
    huge = struct.pack("<I", 2**31)
    with pytest.raises(ProtocolError, match="truncated"):
        Cursor(huge).ids()
    with pytest.raises(ProtocolError, match="truncated"):
        Cursor(struct.pack("<H", 1000) + bytes(16)).ranges()
    assert Cursor(pack_ids([1, 2**64 - 1])).ids() == [1, 2**64 - 1]


def test_a_greeting_of_another_protocol_version_is_refused() -> None:
    hello = Hello(1 << 20, 4096, 1000, bytes(16), ["dram", "nvme"])
    assert unpack_hello(hello.pack()) == hello
    older = struct.pack("<I", PROTOCOL_VERSION - 1) + hello.pack()[4:]
    with pytest.raises(ProtocolError, match="protocol"):
        unpack_hello(older)


@pytest.mark.parametrize(
    ("calls", "lookups"),
    [(2, 0), (0, 1 << 17)],
    ids=["more-calls-than-keys", "too-many-lookups"],
)
async def test_a_touch_claiming_impossible_counts_counts_nothing(
    server: ShmServer, calls: int, lookups: int
) -> None:
    before = dict(server.store.stats()["counters"])
    body = struct.pack("<II", calls, lookups) + pack_keys([KEY])
    assert await server._dispatch(session(), Op.TOUCH, memoryview(body)) is None  # one-way
    assert dict(server.store.stats()["counters"]) == before
    good = struct.pack("<II", 1, 3) + pack_keys([KEY])
    assert await server._dispatch(session(), Op.TOUCH, memoryview(good)) is None
    after = server.store.stats()["counters"]
    assert after["blocks_read_direct"] == 1 and after["lookups"] - before.get("lookups", 0) == 3
