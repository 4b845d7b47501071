"""Verified reads on every shared-memory path, and the write window's checks (in-process server).

With ``dram.verify_reads`` a block whose arena bytes no longer match what was put is a miss on
every path, the direct index read included, and is counted in ``corrupt_blocks``. No client can
change arena bytes any more (``tests/integration/test_shm_overwrite.py``), so the bytes here are
changed through the server's own mapping, as rot or a bug of the server's would.

Writes come through a client's window: the server takes only a memfd it can seal against
shrinking and no larger than it allows, copies only from inside it, and refuses a plain
``COMMIT`` of pages no client could have written.
"""

from __future__ import annotations

import asyncio
import os
import struct
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from kvstore.client.shm import ShmDataPlane
from kvstore.client.shm_window import ClientWindow
from kvstore.keys import Namespace
from kvstore.protocol.shm_frames import Cursor, Op, pack_ids, pack_keys
from kvstore.protocol.shm_messages import ReserveSlot
from kvstore.server.shm import ShmServer, _Session
from kvstore.store import TieredStore
from kvstore.tiers.dram import DramTier

PAGE = 4096
NS = Namespace(model="shm-verify-test").fingerprint()
KEYS = [bytes([n]) * 16 for n in range(1, 5)]
VALUES = [os.urandom(3 * PAGE) for _ in KEYS]


async def serving(tmp_path: Path, verify: bool) -> ShmServer:
    store = TieredStore([DramTier(64 * PAGE, page_size=PAGE, verify_reads=verify)])
    await store.put(KEYS, VALUES, NS)
    server = ShmServer(store, str(tmp_path / "s.sock"), os.urandom(16))
    await server.start()
    return server


@pytest.fixture
async def verifying(tmp_path: Path) -> AsyncIterator[ShmServer]:
    server = await serving(tmp_path, verify=True)
    yield server
    await server.close()
    await server.store.close()


def rot(server: ShmServer, key: bytes) -> None:
    """Change one byte of ``key``'s block in the arena, through the server's own mapping."""
    arena = server.store.arena
    assert arena is not None
    (offset, _), *_ = arena.extents(key)
    view = arena.range_view(offset, 1)
    view[0] ^= 0xFF


def corrupt_blocks(server: ShmServer) -> int:
    return int(server.store.stats()["tiers"]["dram"]["corrupt_blocks"])


@pytest.mark.parametrize("path", ["direct get", "direct get_into", "direct acquire", "leased"])
async def test_a_changed_block_is_a_counted_miss_on_every_path(
    verifying: ShmServer, path: str
) -> None:
    plane = await asyncio.to_thread(ShmDataPlane, verifying.path, NS, direct_reads=path != "leased")
    try:
        assert plane.direct_reads == (path != "leased")
        rot(verifying, KEYS[1])

        def read() -> list[bytes | None]:
            if path == "direct get_into":
                out = [bytearray(len(v)) for v in VALUES]
                ok = plane.get_into(KEYS, out)
                return [bytes(b) if good else None for b, good in zip(out, ok, strict=True)]
            if path == "direct acquire":
                with plane.acquire(KEYS) as lease:
                    views = [None if v is None else bytes(v) for v in lease.views]
                    return [v if ok else None for v, ok in zip(views, lease.intact(), strict=True)]
            return plane.get(KEYS)

        got = await asyncio.to_thread(read)
        assert got == [VALUES[0], None, VALUES[2], VALUES[3]]
        assert corrupt_blocks(verifying) == 1
        assert await asyncio.to_thread(plane.get, KEYS[1:2]) == [None]  # dropped: gone for good
    finally:
        await asyncio.to_thread(plane.close)


async def test_without_verification_the_index_carries_no_checksums(tmp_path: Path) -> None:
    """The default: the direct read copies without hashing (what ``dram.verify_reads`` buys)."""
    server = await serving(tmp_path, verify=False)
    plane = await asyncio.to_thread(ShmDataPlane, server.path, NS)
    try:
        assert plane._index is not None and not plane._index.checksums
        rot(server, KEYS[1])
        got = await asyncio.to_thread(plane.get, KEYS[1:2])
        assert got[0] is not None and got[0] != VALUES[1]  # served as it is: nothing checks it
    finally:
        await asyncio.to_thread(plane.close)
        await server.close()
        await server.store.close()


async def test_a_put_through_the_window_is_read_back(verifying: ShmServer) -> None:
    plane = await asyncio.to_thread(ShmDataPlane, verifying.path, NS)
    try:
        assert plane.sealed and not plane._arena.flags.writeable
        key, value = b"w" * 16, os.urandom(5 * PAGE + 17)
        result, no_room = await asyncio.to_thread(plane.put, [key], [value])
        assert result.stored == 1 and no_room == []
        assert await asyncio.to_thread(plane.get, [key]) == [value]
        window = plane._window
        assert window is not None and window.free_bytes == window.size  # given back
    finally:
        await asyncio.to_thread(plane.close)


# -- the server's checks of windows and commits, request by request ------------------------------


def session(server: ShmServer) -> _Session:
    held = server._sessions.open(_Session)
    held.namespace = NS
    held.fds = []
    return held


async def reserve(server: ShmServer, held: _Session, length: int) -> int:
    body = pack_keys([os.urandom(16)]) + struct.pack("<Q", length)
    reply = await server._dispatch(held, Op.RESERVE, memoryview(body))
    assert reply is not None and reply[4] == 0, reply
    cursor = Cursor(reply[5:])
    assert cursor.u8() == ReserveSlot.RESERVED
    return cursor.u64()


async def test_a_plain_commit_of_pages_nobody_could_write_is_refused(verifying: ShmServer) -> None:
    held = session(verifying)
    reservation = await reserve(verifying, held, PAGE)
    reply = await verifying._dispatch(held, Op.COMMIT, memoryview(pack_ids([reservation])))
    assert reply is not None and reply[4] == 3 and b"read-only to clients" in reply
    assert reservation in held.reservations  # still the client's to cancel (or closing does)


async def test_window_offsets_are_checked_and_a_bad_commit_stores_nothing(
    verifying: ShmServer,
) -> None:
    held = session(verifying)
    reservation = await reserve(verifying, held, 2 * PAGE)
    body = pack_ids([reservation]) + struct.pack("<Q", 0)
    reply = await verifying._dispatch(held, Op.COMMIT_FROM, memoryview(body))
    assert reply is not None and reply[4] == 3 and b"WINDOW first" in reply
    window = ClientWindow(4 * PAGE)
    try:
        held.fds.append(os.dup(window.fd))
        assert await verifying._dispatch(held, Op.WINDOW, memoryview(b"")) == struct.pack(
            "<IB", 1, 0
        )
        assert held.window is not None and held.window.size == 4 * PAGE
        past = pack_ids([reservation]) + struct.pack("<Q", 3 * PAGE)  # 2 pages from page 3
        reply = await verifying._dispatch(held, Op.COMMIT_FROM, memoryview(past))
        assert reply is not None and reply[4] == 3 and b"past the end" in reply
        assert held.reservations == {}  # cancelled: nothing of it was stored
        reservation = await reserve(verifying, held, 2 * PAGE)
        data = os.urandom(2 * PAGE)
        window.write(PAGE, np.frombuffer(data, dtype=np.uint8))
        good = pack_ids([reservation]) + struct.pack("<Q", PAGE)
        reply = await verifying._dispatch(held, Op.COMMIT_FROM, memoryview(good))
        assert reply is not None and reply[4] == 0 and struct.unpack("<III", reply[5:])[0] == 1
    finally:
        window.close()
        verifying._sessions.close(held)
        if held.window is not None:
            held.window.close()


@pytest.mark.parametrize("kind", ["a pipe", "a regular file", "an oversized memfd", "none"])
async def test_a_window_that_is_not_a_sealable_bounded_memfd_is_refused(
    verifying: ShmServer, kind: str
) -> None:
    held = session(verifying)
    if kind == "a pipe":
        read, write = os.pipe()
        os.close(write)
        held.fds.append(read)
    elif kind == "a regular file":
        with tempfile.TemporaryFile() as file:
            file.truncate(PAGE)
            held.fds.append(os.dup(file.fileno()))
    elif kind == "an oversized memfd":
        fd = os.memfd_create("big", os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, 1 << 40)  # sparse: costs nothing, and far over the arena's size
        held.fds.append(fd)
    reply = await verifying._dispatch(held, Op.WINDOW, memoryview(b""))
    assert reply is not None and reply[4] == 3, reply
    assert held.window is None and held.fds == []  # whatever came is closed, not kept
    verifying._sessions.close(held)


async def test_the_arena_is_page_locked_read_only_and_the_window_writable(
    verifying: ShmServer,
) -> None:
    """A CUDA caller's registration (the tests' stand-in registrar: no GPU here): the read-only
    mapping of the arena is registered for reading only (``cudaHostRegisterReadOnly``, loads
    DMA out of it), the write window as writable (saves DMA into it), and a reservation's views
    lie in the window's registration."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from harness.cuda_stand_in import StandInRegistrar

    registrar = StandInRegistrar()
    plane = await asyncio.to_thread(ShmDataPlane, verifying.path, NS)
    try:
        arena = plane.register_with(registrar, None)
        window = plane.window_registration
        assert arena is not None and window is not None and arena.read_only
        for registration in (arena, window):
            assert await asyncio.to_thread(
                registration.wait_covered, registration.base, registration.size, 30
            )
        assert registrar.read_only == [(arena.base, arena.size)]
        assert (window.base, window.size) in registrar.registered
        held = await asyncio.to_thread(plane.reserve, [b"r" * 16], [2 * PAGE])
        view = held.views[0]
        assert view is not None and held.registration is window
        assert window.covers(int(view.ctypes.data), 2 * PAGE)
        view[:] = 7
        assert (await asyncio.to_thread(held.commit)).stored == 1
        assert await asyncio.to_thread(plane.get, [b"r" * 16]) == [bytes([7]) * 2 * PAGE]
    finally:
        await asyncio.to_thread(plane.close)
