"""What one co-located client may cost the shared-memory server, against real ``kvstore serve``.

Each test is an attack a process allowed to connect to the socket could make: declaring huge
frames and stalling, starting a frame and never finishing it, opening connection after connection,
leasing or reserving the whole arena from one connection. Each is refused or bounded (the server's
RSS is read from ``/proc/PID/status``), the server keeps serving, and stored blocks stay
bit-identical.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import numpy as np
import pytest

from kvstore import KVStoreClient, Namespace
from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore._proto.kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.protocol.shm_frames import (
    MAX_REQUEST_BYTES,
    Cursor,
    Op,
    frame,
    pack_ids,
    pack_keys,
)
from kvstore.protocol.shm_messages import AcquireSlot, ReserveSlot

if TYPE_CHECKING:
    from harness.serve import ServerProcess
    from harness.server_factory import ServerFactory

KiB = 1024
MiB = 1024**2
NS = Namespace(model="shm-limits-test")
OK, RESOURCE_EXHAUSTED = 0, 8


def make_blocks(seed: int, count: int, size: int) -> tuple[list[bytes], list[bytes]]:
    rng = np.random.default_rng(seed)
    return [rng.bytes(16) for _ in range(count)], [rng.bytes(size) for _ in range(count)]


def shm_path(server: ServerProcess) -> str:
    with grpc.insecure_channel(server.target) as channel:
        reply = pb_grpc.KVStoreStub(channel).DataPlane(pb.DataPlaneRequest(), timeout=5)
    return str(reply.shm_socket)


def rss_bytes(server: ServerProcess) -> int:
    assert server.proc is not None
    for line in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * KiB
    raise AssertionError("no VmRSS")


def closed_by_server(sock: socket.socket, timeout: float = 3.0) -> bool:
    """True if the server hung up on ``sock`` within ``timeout`` (EOF or reset)."""
    sock.settimeout(timeout)
    try:
        while chunk := sock.recv(65536):
            del chunk  # a reply sent before hanging up is not what is asked
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


class Raw:
    """A hand-driven shm connection (HELLO done unless ``hello`` is false)."""

    def __init__(self, path: str, *, hello: bool = True) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(5)
        self.sock.connect(path)
        if hello:
            self.sock.sendall(frame(Op.HELLO, NS.fingerprint()))
            data, fds, _, _ = socket.recv_fds(self.sock, 4096, 2)
            for fd in fds:
                os.close(fd)
            status, _ = self._finish(bytearray(data))
            assert status == OK

    def _finish(self, data: bytearray) -> tuple[int, bytes]:
        while len(data) < 4 or len(data) < 4 + struct.unpack("<I", data[:4])[0]:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionResetError("server closed the connection")
            data += chunk
        length = struct.unpack("<I", data[:4])[0]
        return data[4], bytes(data[5 : 4 + length])

    def call(self, op: int, body: bytes = b"") -> tuple[int, bytes]:
        self.sock.sendall(frame(op, body))
        return self._finish(bytearray())

    def reserve(self, keys: Sequence[bytes], lengths: Sequence[int]) -> tuple[int, list[int]]:
        """Status and, when OK, per key the slot kind; reserved ids are kept in ``self.ids``."""
        status, body = self.call(
            Op.RESERVE, pack_keys(keys) + struct.pack(f"<{len(lengths)}Q", *lengths)
        )
        return status, self._slots(status, body, keys, ReserveSlot.RESERVED)

    def acquire(self, keys: Sequence[bytes]) -> tuple[int, list[int]]:
        status, body = self.call(Op.ACQUIRE, pack_keys(keys))
        return status, self._slots(status, body, keys, AcquireSlot.LEASE, inline=AcquireSlot.BYTES)

    def _slots(
        self, status: int, body: bytes, keys: Sequence[bytes], held: int, inline: int = -1
    ) -> list[int]:
        self.ids: list[int] = []
        if status != OK:
            return []
        cursor, kinds = Cursor(body), []
        for _ in keys:
            kind = cursor.u8()
            kinds.append(kind)
            if kind == held:
                self.ids.append(cursor.u64())
                cursor.ranges()
            elif kind == inline:
                cursor.take(cursor.u64())
        cursor.done()
        return kinds

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def opened() -> Iterator[list[socket.socket]]:
    socks: list[socket.socket] = []
    yield socks
    for sock in socks:
        sock.close()


def assert_serves(server: ServerProcess, keys: list[bytes], values: list[bytes]) -> None:
    """A fresh shared-memory client reads every stored block back bit-identical."""
    with KVStoreClient(server.target, namespace=NS, data_plane="shm") as client:
        assert client.get(keys) == values
        extra_keys, extra_values = make_blocks(99, 2, 32 * KiB)
        assert (
            client.put(extra_keys, extra_values).stored
            + client.put(extra_keys, extra_values).already_present
            >= 2
        )
        assert client.get(extra_keys) == extra_values


def test_huge_declared_frames_are_refused_before_anything_is_allocated(
    server_factory: ServerFactory, opened: list[socket.socket]
) -> None:
    """48 connections each declare a 16 MiB ACQUIRE and send a little of it: each is hung up
    on at once (no request can be that long) and the server's RSS barely moves (on a server
    that allocates what is declared it grows by ~768 MiB)."""
    server = server_factory(dram_capacity="16MiB")
    keys, values = make_blocks(1, 4, 64 * KiB)
    with KVStoreClient(server.target, namespace=NS, data_plane="grpc") as client:
        client.put(keys, values)
    path = shm_path(server)
    before = rss_bytes(server)
    for _ in range(48):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        opened.append(sock)
        sock.connect(path)
        sock.sendall(struct.pack("<IB", MAX_REQUEST_BYTES, Op.ACQUIRE) + bytes(4 * KiB))
    assert all(closed_by_server(sock) for sock in opened)
    assert rss_bytes(server) - before < 32 * MiB
    assert "frame" in server.stderr()  # each refusal is logged (rate-limited)
    assert_serves(server, keys, values)


def test_a_frame_longer_than_its_op_allows_is_refused(
    server_factory: ServerFactory, opened: list[socket.socket]
) -> None:
    """A LOOKUP may carry max_keys keys; a declared length past that is hung up on before its
    body is read, without waiting for it."""
    server = server_factory(env={"KVSTORE_SERVER_MAX_KEYS_PER_REQUEST": "16"})
    path = shm_path(server)
    legal = 1 + 4 + 16 * 16
    for op, length in ((Op.LOOKUP, legal + 1), (Op.SYNC, 2), (Op.RELEASE, 1 + 4 + 8 * 17)):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        opened.append(sock)
        sock.connect(path)
        sock.sendall(struct.pack("<IB", length, op))
        assert closed_by_server(sock), (op, length)
    raw = Raw(path)
    status, _ = raw.call(Op.LOOKUP, pack_keys([bytes(16)] * 16))  # the longest legal one
    raw.close()
    assert status == OK


def test_a_frame_begun_and_never_finished_is_dropped_after_the_frame_timeout(
    server_factory: ServerFactory, opened: list[socket.socket]
) -> None:
    """48 connections each send half of a legal ACQUIRE and stall: the server holds what they
    sent (read in bounded pieces), not what they declared, and hangs up on each once the frame
    timeout passes; an idle connection (no frame begun) is left alone."""
    server = server_factory(env={"KVSTORE_SHM_FRAME_TIMEOUT_S": "1"})
    keys, values = make_blocks(2, 3, 64 * KiB)
    with KVStoreClient(server.target, namespace=NS, data_plane="grpc") as client:
        client.put(keys, values)
    path = shm_path(server)
    idle = Raw(path)
    request = frame(Op.ACQUIRE, pack_keys([os.urandom(16) for _ in range(4096)]))
    before = rss_bytes(server)
    started = time.monotonic()
    for _ in range(48):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        opened.append(sock)
        sock.connect(path)
        sock.sendall(request[: len(request) // 2])
    assert rss_bytes(server) - before < 24 * MiB
    assert all(closed_by_server(sock, timeout=5) for sock in opened)
    assert time.monotonic() - started < 5
    assert "did not finish it within" in server.stderr()
    status, _ = idle.call(Op.SYNC)  # idle past the timeout, and still served
    idle.close()
    assert status == OK
    assert_serves(server, keys, values)


@pytest.mark.parametrize("limit", ["total", "per_uid"])
def test_connections_past_the_limit_are_refused_and_logged(
    server_factory: ServerFactory, limit: str
) -> None:
    """Connections beyond ``shm.max_connections`` (or per uid: every connection here
    comes from this test's uid) are closed at once with a log line; closing one admits another,
    and those admitted keep working."""
    env = {
        "KVSTORE_SHM_MAX_CONNECTIONS": "6" if limit == "total" else "100",
        "KVSTORE_SHM_MAX_CONNECTIONS_PER_UID": "6" if limit == "per_uid" else "100",
    }
    server = server_factory(env=env)
    keys, values = make_blocks(3, 2, 64 * KiB)
    with KVStoreClient(server.target, namespace=NS, data_plane="grpc") as client:
        client.put(keys, values)
    path = shm_path(server)
    admitted = [Raw(path) for _ in range(6)]
    try:
        extra = Raw(path, hello=False)
        assert closed_by_server(extra.sock)
        extra.close()
        assert "shared-memory connection refused" in server.stderr()
        for raw in admitted:
            assert raw.call(Op.SYNC)[0] == OK
        admitted.pop().close()
        # Once the server notices the hang-up (at once on an idle machine), a connection is
        # admitted again; until then a newcomer is refused like the extra one above.
        deadline = time.monotonic() + 10
        while True:
            try:
                newcomer = Raw(path)
                break
            except (ConnectionResetError, BrokenPipeError, AssertionError):
                assert time.monotonic() < deadline, "a freed connection slot was never reused"
                time.sleep(0.05)
        admitted.append(newcomer)
        assert admitted[-1].call(Op.SYNC)[0] == OK
    finally:
        for raw in admitted:
            raw.close()
    assert_serves(server, keys, values)


def test_one_connection_cannot_hold_more_of_the_arena_than_its_quota(
    server_factory: ServerFactory,
) -> None:
    """With a 1 MiB quota on a 4 MiB arena: a connection holding reservations or leases is
    refused RESOURCE_EXHAUSTED (changing nothing) for more; a connection holding nothing gets
    NO_ROOM, or the payload inline, for what is past the quota; other connections are not
    affected, and stored blocks stay intact."""
    server = server_factory(env={"KVSTORE_SHM_SESSION_BYTES": "1MiB"}, dram_capacity="4MiB")
    keys, values = make_blocks(4, 8, 256 * KiB)
    with KVStoreClient(server.target, namespace=NS, data_plane="grpc") as client:
        assert client.put(keys, values).stored == 8
        dram_before = dict(client.stats()["tiers"]["dram"])
        path = shm_path(server)
        hog = Raw(path)
        # Reads: four blocks fill the quota, the fifth is refused while they are held.
        status, kinds = hog.acquire(keys[:4])
        assert status == OK and kinds == [AcquireSlot.LEASE] * 4
        leased = hog.ids
        status, _ = hog.acquire(keys[4:5])
        assert status == RESOURCE_EXHAUSTED
        assert client.stats()["tiers"]["dram"]["leases"] == 4
        # Writes while holding the full quota: refused, nothing reserved.
        status, _ = hog.reserve([os.urandom(16)], [64 * KiB])
        assert status == RESOURCE_EXHAUSTED
        assert client.stats()["tiers"]["dram"]["reserved_bytes"] == 0
        # Another connection has a quota of its own.
        other = Raw(path)
        status, kinds = other.acquire(keys[4:8])
        assert status == OK and kinds == [AcquireSlot.LEASE] * 4
        other.sock.sendall(frame(Op.RELEASE, pack_ids(other.ids)))
        # Given back, the hog may reserve again; a batch past its quota from nothing held
        # gets NO_ROOM for the rest (what a client then sends over gRPC).
        hog.sock.sendall(frame(Op.RELEASE, pack_ids(leased)))
        status, kinds = hog.reserve([os.urandom(16) for _ in range(6)], [256 * KiB] * 6)
        assert status == OK and kinds == [ReserveSlot.RESERVED] * 4 + [ReserveSlot.NO_ROOM] * 2
        assert client.stats()["tiers"]["dram"]["reserved_bytes"] <= 1 * MiB
        hog.sock.sendall(frame(Op.CANCEL, pack_ids(hog.ids)))
        # And a read of more than its quota from nothing held: the rest comes back inline.
        status, kinds = hog.acquire(keys)
        assert status == OK and kinds == [AcquireSlot.LEASE] * 4 + [AcquireSlot.BYTES] * 4
        hog.close()
        other.close()
        deadline = time.monotonic() + 5
        while client.stats()["tiers"]["dram"]["leases"] and time.monotonic() < deadline:
            time.sleep(0.02)
        dram_after = dict(client.stats()["tiers"]["dram"])
        assert dram_after["leases"] == 0 and dram_after["reserved_bytes"] == 0
        assert dram_after["used"] == dram_before["used"]
    # A well-behaved client's batch larger than the quota still goes through, bit-identical.
    big_keys, big_values = make_blocks(5, 6, 512 * KiB)
    with KVStoreClient(server.target, namespace=NS, data_plane="shm") as fast:
        assert fast.put(big_keys, big_values).stored == 6
        assert fast.get(big_keys) == big_values
    assert_serves(server, keys, values)
