"""``ShmServer``'s request handling, driven in-process (the socket: tests/integration/test_shm.py).

A request is parsed whole before the store is touched, so a malformed frame takes nothing; counts
the peer sends are checked against the frame before anything is built from them. The socket file
gets exactly its configured mode whatever the umask, and only users that mode admits can connect
(checked from a child process that runs as another user, which needs root).
"""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import stat
import struct
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from kvstore.client.shm import ShmDataPlane
from kvstore.keys import Namespace
from kvstore.protocol.shm_frames import (
    PROTOCOL_VERSION,
    Cursor,
    Hello,
    Op,
    ProtocolError,
    pack_ids,
    pack_keys,
    unpack_hello,
)
from kvstore.server.shm import ShmServer, _Session
from kvstore.server.shm_listen import chmod_socket as _chmod_socket
from kvstore.server.shm_listen import listen_unix as _listen_unix
from kvstore.store import TieredStore
from kvstore.tiers.dram import DramTier

PAGE = 4096
NS = Namespace(model="shm-server-test").fingerprint()
KEY = b"k" * 16
NOBODY = 65534


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[ShmServer]:
    store = TieredStore([DramTier(8 * PAGE, page_size=PAGE)])
    await store.put([KEY], [os.urandom(PAGE)], NS)
    yield ShmServer(store, str(tmp_path / "s.sock"), os.urandom(16))
    await store.close()


def session(server: ShmServer) -> _Session:
    held = server._sessions.open(_Session)
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
    held = session(server)
    reply = await server._dispatch(held, op, memoryview(body))
    assert status(reply) == 3  # INVALID_ARGUMENT
    assert not held.leases and not held.reservations
    assert dram(server)["leases"] == 0 and dram(server)["reserved_bytes"] == 0


async def test_a_commit_with_trailing_bytes_stores_nothing(server: ShmServer) -> None:
    held = session(server)
    reply = await server._dispatch(
        held, Op.RESERVE, memoryview(pack_keys([b"n" * 16]) + struct.pack("<Q", PAGE))
    )
    assert status(reply) == 0
    (reservation_id,) = held.reservations
    reply = await server._dispatch(held, Op.COMMIT, memoryview(pack_ids([reservation_id]) + b"x"))
    assert status(reply) == 3
    assert server.store.lookup([b"n" * 16], NS).hits == 0
    server._sessions.close(held)  # what closing the socket does
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
    assert await server._dispatch(session(server), Op.TOUCH, memoryview(body)) is None  # one-way
    assert dict(server.store.stats()["counters"]) == before
    good = struct.pack("<II", 1, 3) + pack_keys([KEY])
    assert await server._dispatch(session(server), Op.TOUCH, memoryview(good)) is None
    after = server.store.stats()["counters"]
    assert after["blocks_read_direct"] == 1 and after["lookups"] - before.get("lookups", 0) == 3


# --- the socket file ------------------------------------------------------------------------------


def mode_of(path: Path) -> int:
    info = os.lstat(path)
    assert stat.S_ISSOCK(info.st_mode)
    return stat.S_IMODE(info.st_mode)


def stale_socket(path: Path) -> None:
    """Leave a socket file at ``path`` that nothing listens on, as a crashed server does."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(path))


def connect(path: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(str(path))


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory any user may enter (pytest's own temporary directories are 0700)."""
    with tempfile.TemporaryDirectory(prefix="kvstore-shm-") as name:
        os.chmod(name, 0o755)
        yield Path(name)


def as_other_user(action: Callable[[], None], groups: tuple[int, ...] = ()) -> str:
    """Run ``action`` in a forked child as uid and gid 65534 with supplementary ``groups``; the
    errno name of the :class:`OSError` it raised, or "" when it succeeded.

    Switching uid needs root. The test command runs as root, so not being root fails the test:
    a skip would quietly drop the only checks of who may connect."""
    if os.geteuid() != 0:
        pytest.fail("needs root to switch to another uid (scripts/test.sh runs as root)")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        code = 1
        try:
            os.close(read)
            os.setgroups(list(groups))
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            try:
                action()
                outcome = ""
            except OSError as exc:
                outcome = errno.errorcode.get(exc.errno or 0, repr(exc))
            os.write(write, outcome.encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        outcome = pipe.read().decode()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child failed before reporting"
    return outcome


@pytest.mark.parametrize("umask", [0o000, 0o077], ids=["umask-000", "umask-077"])
@pytest.mark.parametrize("mode", [0o660, 0o600, 0o666])
async def test_the_socket_gets_exactly_its_mode_whatever_the_umask(
    server: ShmServer, tmp_path: Path, mode: int, umask: int
) -> None:
    path = tmp_path / "mode.sock"
    shm = ShmServer(server.store, str(path), os.urandom(16), mode=mode)
    previous = os.umask(umask)
    try:
        await shm.start()
    finally:
        os.umask(previous)
    try:
        assert mode_of(path) == mode
        assert sorted(p.name for p in tmp_path.iterdir()) == ["mode.sock"]  # no temporary left
        connect(path)
    finally:
        await shm.close()
    assert not path.exists()


async def test_the_default_mode_admits_owner_and_group_only(server: ShmServer) -> None:
    await server.start()
    try:
        assert server.mode == 0o660 and mode_of(Path(server.path)) == 0o660
    finally:
        await server.close()


async def test_a_stale_socket_is_replaced(server: ShmServer, tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    stale_socket(path)
    await server.start()
    try:
        assert mode_of(path) == 0o660
        assert sorted(p.name for p in tmp_path.iterdir()) == ["s.sock"]
        connect(path)
    finally:
        await server.close()


async def test_a_live_socket_is_not_taken_over(server: ShmServer) -> None:
    """A second server on the same path fails (and would serve without shared memory) instead of
    stealing the socket from the first, whose clients keep connecting."""
    await server.start()
    try:
        second = ShmServer(server.store, server.path, os.urandom(16))
        with pytest.raises(OSError, match="another server is listening") as refused:
            await second.start()
        assert refused.value.errno == errno.EADDRINUSE
        await second.close()
        connect(Path(server.path))
    finally:
        await server.close()
    assert not Path(server.path).exists()


async def test_closing_leaves_a_socket_that_replaced_ours(server: ShmServer) -> None:
    """Only our own socket file is removed: one another server put there since stays."""
    await server.start()
    path = Path(server.path)
    path.unlink()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as newer:
        newer.bind(str(path))
        await server.close()
        assert stat.S_ISSOCK(os.lstat(path).st_mode)


async def test_a_path_near_the_length_limit_works(server: ShmServer, tmp_path: Path) -> None:
    """Socket paths may take up to 107 bytes; no temporary name eats into that."""
    base = str(tmp_path / "d")
    path = Path(base + "x" * (104 - len(base) - len("/s.sock")) + "/s.sock")
    path.parent.mkdir()
    assert len(str(path)) == 104
    shm = ShmServer(server.store, str(path), os.urandom(16))
    await shm.start()
    try:
        connect(path)
    finally:
        await shm.close()


def test_the_mode_is_not_set_through_a_symlink(tmp_path: Path) -> None:
    """If the freshly bound socket was swapped for a symlink (a directory others may write to),
    the file it points to keeps its mode."""
    target = tmp_path / "target"
    target.write_text("x")
    os.chmod(target, 0o600)
    link = tmp_path / "s.sock"
    link.symlink_to(target)
    with pytest.raises(OSError, match="no longer the socket"):
        _chmod_socket(str(link), 0o666)
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o600


@pytest.mark.parametrize("kind", ["file", "directory"])
async def test_what_is_not_a_socket_is_left_alone(
    server: ShmServer, tmp_path: Path, kind: str
) -> None:
    path = tmp_path / "s.sock"
    if kind == "file":
        path.write_text("not a socket")
    else:
        path.mkdir()
    with pytest.raises(FileExistsError, match="not a socket"):
        await server.start()
    if kind == "file":
        assert path.read_text() == "not a socket"
    else:
        assert path.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.sock"]


async def test_a_missing_directory_is_an_os_error_that_leaves_nothing(
    server: ShmServer, tmp_path: Path
) -> None:
    shm = ShmServer(server.store, str(tmp_path / "missing" / "s.sock"), os.urandom(16))
    with pytest.raises(FileNotFoundError):
        await shm.start()
    assert list(tmp_path.iterdir()) == []
    await shm.close()  # closing a server that never started is harmless


def test_a_mode_that_is_not_permission_bits_is_refused(server: ShmServer) -> None:
    with pytest.raises(ValueError, match="permission bits"):
        ShmServer(server.store, server.path, os.urandom(16), mode=0o4660)


@pytest.mark.parametrize(
    ("mode", "in_group", "outcome"),
    [(0o660, False, "EACCES"), (0o666, False, ""), (0o660, True, ""), (0o600, True, "EACCES")],
    ids=["0660-other", "0666-other", "0660-group-member", "0600-group-member"],
)
async def test_only_users_the_mode_admits_can_connect(
    server: ShmServer, shared_dir: Path, mode: int, in_group: bool, outcome: str
) -> None:
    path = shared_dir / "s.sock"
    shm = ShmServer(server.store, str(path), os.urandom(16), mode=mode)
    await shm.start()
    try:
        # A supplementary group is how a pod of another uid is let in (supplementalGroups).
        groups = (os.stat(path).st_gid,) if in_group else ()
        assert as_other_user(lambda: connect(path), groups) == outcome
    finally:
        await shm.close()


def test_another_users_socket_in_a_sticky_directory_is_left_alone(
    shared_dir: Path,
) -> None:
    # Another user can neither tell whether it is live (no permission to connect) nor, in a
    # sticky directory, remove it: the start fails cleanly either way.
    os.chmod(shared_dir, 0o1777)
    path = shared_dir / "s.sock"
    stale_socket(path)
    os.chmod(path, 0o755)
    assert as_other_user(lambda: _listen_unix(str(path), 0o660).close()) == "EACCES"
    os.chmod(path, 0o777)  # it may connect now: stale, but not its own to remove
    assert as_other_user(lambda: _listen_unix(str(path), 0o660).close()) == "EPERM"
    assert sorted(p.name for p in shared_dir.iterdir()) == ["s.sock"]
    assert os.lstat(path).st_uid == 0  # the stale socket is still the one root left


# --- a client that cannot read the index ----------------------------------------------------------


async def test_a_client_that_cannot_read_the_index_still_reads_through_the_server(
    server: ShmServer,
) -> None:
    """An index of a layout the client does not know (here: its version rewritten, as a future
    server's would be) costs the client its direct reads, not the shared-memory plane: reads and
    lookups go through the server over the same socket, and the bytes are right."""
    arena = server.store.arena
    assert arena is not None and arena.index is not None
    struct.pack_into("<I", arena.index._mapping, 8, 99)  # the version field
    await server.start()
    try:
        plane = await asyncio.to_thread(ShmDataPlane, server.path, NS)
        try:
            assert plane._index is None
            stored = (await server.store.get([KEY], NS))[0].payload
            out = bytearray(PAGE)
            assert await asyncio.to_thread(plane.get_into, [KEY], [out]) == [True]
            assert bytes(out) == bytes(stored)
            assert (await asyncio.to_thread(plane.lookup, [KEY, b"x" * 16])).hits == 1
            counters = server.store.stats()["counters"]
            assert counters.get("blocks_read_direct", 0) == 0
        finally:
            await asyncio.to_thread(plane.close)
    finally:
        await server.close()
