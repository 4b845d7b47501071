"""The shared-memory data plane against real ``kvstore serve`` processes.

Clients on this host pick shared memory by themselves (``KVSTORE_DATA_PLANE=auto``) and gRPC when
told to; both paths return the same bytes for every kind of buffer. The server's UNIX socket is
also driven with raw frames (:mod:`kvstore.protocol.shm_frames`), to check what no well-behaved
client does: dying while holding leases and reservations, holding a lease on a deleted block,
and sending garbage. None of it may leak arena space, change a stored byte or stop the server.

Most tests name the plane of every client they build (``data_plane="shm"`` or ``"grpc"``) and run
once; the ``each_plane`` ones build clients that follow the environment, and check both paths
across their two runs (see the ``data_plane`` fixture).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import signal
import socket
import stat
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
import pytest
import torch
from harness.shm_blocks import NS, dram, make_blocks, wait_released

from kvstore import AsyncKVStoreClient, KVStoreClient, Namespace, StoreUnavailableError
from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore._proto.kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.client import shm_link
from kvstore.client.shm import ShmDataPlane, ShmUnavailableError
from kvstore.client.shm_window import ClientWindow
from kvstore.errors import DeadlineExceededError, InvalidRequestError
from kvstore.protocol.shm_frames import (
    MAX_REQUEST_BYTES,
    Cursor,
    Hello,
    Op,
    frame,
    pack_ids,
    pack_keys,
    unpack_hello,
)
from kvstore.protocol.shm_messages import AcquireSlot, ReserveSlot

if TYPE_CHECKING:
    from harness.serve import ServerProcess
    from harness.server_factory import ServerFactory

KiB = 1024
MiB = 1024**2
NS_BYTES = NS.fingerprint()
OTHER_NS = Namespace(model="shm-test-other")
OK, INVALID_ARGUMENT, RESOURCE_EXHAUSTED, INTERNAL = 0, 3, 8, 13
POLL_S = 5.0


def shm_path(server: ServerProcess) -> str:
    """The socket the server names in its ``DataPlane`` answer ("" when off)."""
    with grpc.insecure_channel(server.target) as channel:
        reply = pb_grpc.KVStoreStub(channel).DataPlane(pb.DataPlaneRequest(), timeout=5)
    return str(reply.shm_socket)


def wait_until(condition: Callable[[], bool], what: str, timeout: float = POLL_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        time.sleep(0.02)


class RawShm:
    """A hand-driven connection to the shm socket, speaking the binary protocol directly."""

    def __init__(self, path: str, *, hello: bool = True, namespace: bytes = NS_BYTES) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(5)
        self.sock.connect(path)
        self.arena: mmap.mmap | None = None
        self.info: Hello | None = None
        if hello:
            status, body = self.hello(namespace)
            assert status == OK, bytes(body)

    def hello(self, namespace: bytes = NS_BYTES) -> tuple[int, memoryview]:
        self.sock.sendall(frame(Op.HELLO, namespace))
        data, fds, _, _ = socket.recv_fds(self.sock, 4096, 2)
        status, body = self._finish(bytearray(data))
        if fds:
            try:
                if status == OK:
                    self.info = unpack_hello(body)
                    # Read-only: the server seals its arena against every writable mapping.
                    self.arena = mmap.mmap(fds[0], self.info.arena_size, prot=mmap.PROT_READ)
            finally:
                for fd in fds:
                    os.close(fd)
        return status, body

    def _recv(self, size: int) -> bytes:
        chunk = self.sock.recv(size)
        if not chunk:
            raise ConnectionResetError("server closed the connection")
        return chunk

    def _finish(self, data: bytearray) -> tuple[int, memoryview]:
        while len(data) < 4:
            data += self._recv(4 - len(data))
        (length,) = struct.unpack("<I", data[:4])
        while len(data) < 4 + length:
            data += self._recv(4 + length - len(data))
        return data[4], memoryview(data)[5 : 4 + length]

    def send(self, raw: bytes) -> None:
        self.sock.sendall(raw)

    def reply(self) -> tuple[int, memoryview]:
        return self._finish(bytearray())

    def call(self, op: int, body: bytes = b"") -> tuple[int, memoryview]:
        self.send(frame(op, body))
        return self.reply()

    def closed_by_server(self) -> bool:
        """True if the server closed this connection (EOF within the socket timeout)."""
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

    def acquire(self, keys: Sequence[bytes]) -> list[tuple[int, Any]]:
        """Per key (kinds of :class:`AcquireSlot`): (MISS, None), (LEASE, (id, ranges)) or
        (BYTES, bytes)."""
        status, body = self.call(Op.ACQUIRE, pack_keys(keys))
        assert status == OK, bytes(body)
        cursor = Cursor(body)
        out: list[tuple[int, Any]] = []
        for _ in keys:
            kind = cursor.u8()
            if kind == AcquireSlot.LEASE:
                out.append((kind, (cursor.u64(), cursor.ranges())))
            elif kind == AcquireSlot.BYTES:
                out.append((kind, bytes(cursor.take(cursor.u64()))))
            else:
                out.append((kind, None))
        cursor.done()
        return out

    def lease(self, key: bytes) -> tuple[int, list[tuple[int, int]]]:
        [(kind, held)] = self.acquire([key])
        assert kind == AcquireSlot.LEASE, kind
        return held  # type: ignore[no-any-return]

    def reserve(self, keys: Sequence[bytes], lengths: Sequence[int]) -> list[tuple[int, Any]]:
        body = pack_keys(keys) + struct.pack(f"<{len(lengths)}Q", *lengths)
        status, reply = self.call(Op.RESERVE, body)
        assert status == OK, bytes(reply)
        cursor = Cursor(reply)
        out: list[tuple[int, Any]] = []
        for _ in keys:
            kind = cursor.u8()
            out.append(
                (kind, (cursor.u64(), cursor.ranges()) if kind == ReserveSlot.RESERVED else None)
            )
        cursor.done()
        return out

    def read(self, ranges: Sequence[tuple[int, int]]) -> bytes:
        assert self.arena is not None
        return b"".join(self.arena[offset : offset + size] for offset, size in ranges)

    def write_window(self, data: bytes) -> int:
        """Send this connection a write window holding ``data`` (at offset 0): what COMMIT_FROM
        copies blocks out of."""
        window = ClientWindow(max(len(data), 1))
        try:
            window.write(0, np.frombuffer(data, dtype=np.uint8))
            socket.send_fds(self.sock, [frame(Op.WINDOW)], [window.fd])
            status, body = self.reply()
            assert status == OK, bytes(body)
        finally:
            window.close()  # the server mapped it: the bytes stay
        return 0

    def sync(self) -> None:
        """A LOOKUP round trip: every one-way request sent before it has been handled."""
        status, body = self.call(Op.LOOKUP, pack_keys([bytes(16)]))
        assert status == OK, bytes(body)

    def close(self) -> None:
        if self.arena is not None:
            self.arena.close()
        self.sock.close()


@pytest.fixture
def raw_conns() -> Iterator[list[RawShm]]:
    """Raw connections a test opened; closed at its end."""
    opened: list[RawShm] = []
    yield opened
    for conn in opened:
        conn.close()


@pytest.fixture(scope="module")
def shared(module_server_factory: ServerFactory) -> ServerProcess:
    """One server for the tests that only touch keys of their own."""
    return module_server_factory(dram_capacity="32MiB", nvme_capacity="64MiB")


# --- (a) which path a client takes -----------------------------------------------------------


@pytest.mark.each_plane
def test_client_picks_shm_by_itself_unless_told_grpc(
    shared: ServerProcess, data_plane: str
) -> None:
    keys, values = make_blocks(1, 3, 64 * KiB)
    with KVStoreClient(shared.target, namespace=NS) as client:
        assert client.data_plane == "grpc"  # nothing decided before the first data call
        assert client.put(keys, values).stored == 3
        assert client.data_plane == ("shm" if data_plane == "auto" else "grpc")
        assert client.get(keys) == values
        assert client.lookup(keys) == 3
    with KVStoreClient(shared.target, namespace=NS, data_plane="grpc") as client:
        assert client.get(keys) == values
        assert client.data_plane == "grpc"
    with KVStoreClient(shared.target, namespace=NS, data_plane="shm") as client:
        assert client.get(keys) == values
        assert client.data_plane == "shm"
        assert client.lookup_tiers(keys).tiers == ["dram"] * 3


def test_shm_calls_move_no_payload_over_grpc(shared: ServerProcess) -> None:
    """An shm client's put is visible to a gRPC client, and the server counts the same puts."""
    keys, values = make_blocks(2, 4, 100 * KiB)
    with (
        KVStoreClient(shared.target, namespace=NS, data_plane="shm") as fast,
        KVStoreClient(shared.target, namespace=NS, data_plane="grpc") as slow,
    ):
        before = fast.stats()["counters"]
        assert fast.put(keys, values).stored == 4
        after = fast.stats()["counters"]
        assert after["blocks_put"] - before.get("blocks_put", 0) == 4
        assert after["bytes_put"] - before.get("bytes_put", 0) == 4 * 100 * KiB
        assert slow.get(keys) == values
        assert fast.put(keys, values).already_present == 4


# --- (b) buffers of every kind ---------------------------------------------------------------

NUMPY_DTYPES = [np.uint8, np.int16, np.float16, np.float32, np.int64, np.complex128]
TORCH_DTYPES = [torch.uint8, torch.bfloat16, torch.float16, torch.float32, torch.int64]


@pytest.mark.parametrize("dtype", NUMPY_DTYPES, ids=lambda d: np.dtype(d).name)
def test_numpy_put_and_get_into_across_paths(shared: ServerProcess, dtype: Any) -> None:
    rng = np.random.default_rng(np.dtype(dtype).num)
    count = 48 * KiB // np.dtype(dtype).itemsize
    arrays = [
        rng.integers(0, 100, size=count).astype(dtype).reshape(-1, 16),
        (rng.standard_normal(count) * 1000).astype(dtype),
    ]
    keys = [rng.bytes(16) for _ in arrays]
    with (
        KVStoreClient(shared.target, namespace=NS, data_plane="shm") as fast,
        KVStoreClient(shared.target, namespace=NS, data_plane="grpc") as slow,
    ):
        # Written over shm, read over gRPC ...
        assert fast.put(keys[:1], arrays[:1]).stored == 1
        assert fast.data_plane == "shm"
        assert slow.get(keys[:1]) == [arrays[0].tobytes()]
        # ... written over gRPC, read over shm, into arrays of the same shape and dtype.
        assert slow.put(keys[1:], arrays[1:]).stored == 1
        outs = [np.zeros_like(array) for array in arrays]
        assert fast.get_into(keys, outs) == [True, True]
        for out, array in zip(outs, arrays, strict=True):
            assert out.tobytes() == array.tobytes()
        assert fast.get(keys) == [array.tobytes() for array in arrays]


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_torch_put_and_get_into_across_paths(shared: ServerProcess, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(TORCH_DTYPES.index(dtype))
    shape = (2, 8, 16, 64)
    if dtype.is_floating_point:
        tensors = [torch.randn(shape, generator=generator).to(dtype) for _ in range(2)]
    else:
        tensors = [torch.randint(0, 100, shape, generator=generator).to(dtype) for _ in range(2)]
    keys = [os.urandom(16) for _ in tensors]
    with (
        KVStoreClient(shared.target, namespace=NS, data_plane="shm") as fast,
        KVStoreClient(shared.target, namespace=NS, data_plane="grpc") as slow,
    ):
        assert fast.put(keys[:1], tensors[:1]).stored == 1
        assert slow.put(keys[1:], tensors[1:]).stored == 1
        for reader in (fast, slow):
            outs = [torch.empty_like(tensor) for tensor in tensors]
            assert reader.get_into(keys, outs) == [True, True]
            for out, tensor in zip(outs, tensors, strict=True):
                assert torch.equal(out.view(torch.uint8), tensor.view(torch.uint8))
        assert fast.data_plane == "shm"


def test_get_into_bytearray_memoryview_and_misses(shared: ServerProcess) -> None:
    keys, values = make_blocks(3, 3, 64 * KiB + 17)
    missing = os.urandom(16)
    with KVStoreClient(shared.target, namespace=NS, data_plane="shm") as client:
        assert client.put(keys, values).stored == 3
        buffers: list[Any] = [bytearray(len(v)) for v in values]
        buffers[2] = memoryview(buffers[2])
        miss = bytearray(b"\xab" * 100)
        assert client.get_into([*keys, missing], [*buffers, miss]) == [True, True, True, False]
        assert [bytes(b) for b in buffers] == values
        assert miss == b"\xab" * 100
        assert client.data_plane == "shm"


@pytest.mark.each_plane
def test_get_into_a_buffer_of_the_wrong_size_is_false_and_untouched(
    shared: ServerProcess, data_plane: str
) -> None:
    keys, values = make_blocks(4, 2, 64 * KiB)
    with KVStoreClient(shared.target, namespace=NS) as client:
        assert client.put(keys, values).stored == 2
        short = bytearray(b"\x5a" * (64 * KiB - 1))
        long = np.full(64 * KiB + 4096, 7, dtype=np.uint8)
        good = bytearray(64 * KiB)
        assert client.get_into(keys + keys[:1], [short, good, long]) == [False, True, False]
        assert short == b"\x5a" * (64 * KiB - 1)
        assert (long == 7).all()
        assert bytes(good) == values[1]
        assert client.data_plane == ("shm" if data_plane == "auto" else "grpc")
        # The lease taken for the refused buffer was given back.
        wait_released(client)


def test_get_into_a_read_only_buffer_is_refused(shared: ServerProcess) -> None:
    keys, values = make_blocks(5, 1, 4 * KiB)
    frozen = np.zeros(4 * KiB, dtype=np.uint8)
    frozen.flags.writeable = False
    for mode in ("shm", "grpc"):
        with KVStoreClient(shared.target, namespace=NS, data_plane=mode) as client:
            client.put(keys, values)
            for buffer in (bytes(4 * KiB), frozen):
                with pytest.raises(InvalidRequestError):
                    client.get_into(keys, [buffer])
            assert not frozen.any()
            assert client.get(keys) == values


@pytest.mark.each_plane
def test_fragmented_arena_round_trips(server_factory: ServerFactory, data_plane: str) -> None:
    """Blocks split over many page runs go both ways intact."""
    server = server_factory("--dram-page-size", "4KiB", dram_capacity="256KiB")
    keys, values = make_blocks(6, 64, 4 * KiB)
    with (
        KVStoreClient(server.target, namespace=NS, data_plane="shm") as fast,
        KVStoreClient(server.target, namespace=NS, data_plane="grpc") as slow,
    ):
        assert fast.put(keys, values).stored == 64
        assert slow.delete(keys[::2]) == 32  # 32 free single pages, none adjacent
        assert dram(fast)["free_runs"] == 32
        big_keys, big_values = make_blocks(7, 3, 5 * 4 * KiB + 1)
        writer, other = (fast, slow) if data_plane == "auto" else (slow, fast)
        assert writer.put(big_keys, big_values).stored == 3
        assert other.lookup_tiers(big_keys).tiers == ["dram"] * 3
        for reader in (fast, slow):
            outs = [bytearray(len(v)) for v in big_values]
            assert reader.get_into(big_keys, outs) == [True] * 3
            assert [bytes(o) for o in outs] == big_values
            assert reader.get(keys[1::2]) == values[1::2]


# --- (c) promotion from nvme -----------------------------------------------------------------


def test_nvme_only_blocks_are_promoted_and_read_over_shm(server_factory: ServerFactory) -> None:
    server = server_factory(dram_capacity="1MiB")  # 16 pages of 64 KiB
    keys, values = make_blocks(8, 24, 64 * KiB)
    with KVStoreClient(server.target, namespace=NS, data_plane="shm") as client:
        assert client.put(keys, values).stored == 24
        tiers = client.lookup_tiers(keys).tiers
        assert tiers.count("nvme") == 8 and tiers.count("dram") == 16
        # Which 8 went to nvme is the policy's business (a chain ages suffix first).
        spilled = tiers.index("nvme")
        out = bytearray(64 * KiB)
        assert client.get_into([keys[spilled]], [out]) == [True]
        assert bytes(out) == values[spilled]
        assert client.lookup_tiers([keys[spilled]]).tiers == ["dram"]
        # More blocks than the arena holds in one read: leases pin the first ones, the rest
        # come back inline; all of them intact.
        assert client.get(keys) == values
        outs = [bytearray(64 * KiB) for _ in keys]
        assert client.get_into(keys, outs) == [True] * 24
        assert [bytes(o) for o in outs] == values
        assert client.data_plane == "shm"
        wait_released(client)


def test_block_bigger_than_the_arena_goes_around_it(server_factory: ServerFactory) -> None:
    server = server_factory(dram_capacity="1MiB")
    keys, values = make_blocks(9, 1, 2 * MiB)
    with KVStoreClient(server.target, namespace=NS, data_plane="shm") as client:
        assert client.put(keys, values).stored == 1  # no room in the arena: sent over gRPC
        assert client.lookup_tiers(keys).tiers == ["nvme"]
        out = np.zeros(2 * MiB, dtype=np.uint8)
        assert client.get_into(keys, [out]) == [True]  # cannot be leased: comes back inline
        assert out.tobytes() == values[0]
        assert client.get(keys) == values
        assert client.data_plane == "shm"
        wait_released(client)


# --- (d) a client killed while holding things leaks nothing ----------------------------------

HOLDER = textwrap.dedent(
    """
    import mmap, os, socket, struct, sys, time
    from kvstore.protocol.shm_frames import (
        Cursor, Op, frame, pack_keys, unpack_hello,
    )
    from kvstore.protocol.shm_messages import AcquireSlot, ReserveSlot

    path, namespace, leased, reserved, length = sys.argv[1:]
    namespace = bytes.fromhex(namespace)
    leased = [bytes.fromhex(k) for k in leased.split(",")]
    reserved = [bytes.fromhex(k) for k in reserved.split(",")]
    length = int(length)

    def recv_reply(sock, data=b""):
        data = bytearray(data)
        while len(data) < 4 or len(data) < 4 + struct.unpack("<I", data[:4])[0]:
            chunk = sock.recv(65536)
            assert chunk, "server closed"
            data += chunk
        assert data[4] == 0, bytes(data[5:])
        return memoryview(data)[5:]

    def connect():
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        sock.sendall(frame(Op.HELLO, namespace))
        data, fds, _, _ = socket.recv_fds(sock, 4096, 2)
        hello = unpack_hello(recv_reply(sock, data))
        arena = mmap.mmap(fds[0], hello.arena_size, prot=mmap.PROT_READ)
        for fd in fds:
            os.close(fd)
        return sock, arena

    held = []
    for keys in (leased, leased[:1]):  # two connections, both leasing
        sock, arena = connect()
        held.append((sock, arena))
        sock.sendall(frame(Op.ACQUIRE, pack_keys(keys)))
        cursor = Cursor(recv_reply(sock))
        for _ in keys:
            assert cursor.u8() == AcquireSlot.LEASE
            cursor.u64()
            cursor.ranges()
    sock, arena = held[0]
    body = pack_keys(reserved) + struct.pack(f"<{len(reserved)}Q", *[length] * len(reserved))
    sock.sendall(frame(Op.RESERVE, body))
    cursor = Cursor(recv_reply(sock))
    for _ in reserved:
        assert cursor.u8() == ReserveSlot.RESERVED
        cursor.u64()
        cursor.ranges()  # reserved, never written nor committed
    print("holding", flush=True)
    time.sleep(60)
    """
)


def test_killed_client_leaks_no_leases_or_reservations(server_factory: ServerFactory) -> None:
    server = server_factory(dram_capacity="4MiB")
    keys, values = make_blocks(10, 6, 64 * KiB)
    new_keys, _ = make_blocks(11, 4, 64 * KiB)
    with KVStoreClient(server.target, namespace=NS, data_plane="grpc") as client:
        assert client.put(keys, values).stored == 6
        before = wait_released(client)
        assert before["used"] == 6 * 64 * KiB
        holder = subprocess.Popen(
            [
                sys.executable,
                "-c",
                HOLDER,
                shm_path(server),
                NS_BYTES.hex(),
                ",".join(k.hex() for k in keys),
                ",".join(k.hex() for k in new_keys),
                str(64 * KiB),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert holder.stdout is not None
            line = holder.stdout.readline()
            assert line.strip() == "holding", holder.stderr.read() if holder.stderr else ""
            holding = dram(client)
            assert holding["leases"] == 7  # six on one connection, one on the other
            assert holding["reserved_bytes"] == 4 * 64 * KiB
            assert holding["used"] == before["used"] + 4 * 64 * KiB
            holder.send_signal(signal.SIGKILL)
            holder.wait(timeout=10)
        finally:
            holder.kill()
            holder.wait()
        after = wait_released(client, used=before["used"])
        assert after["blocks"] == 6
        assert client.lookup(new_keys) == 0  # the half-written reservations never became blocks
        assert client.get(keys) == values
        assert client.get(new_keys) == [None] * 4
        # The space is usable again: everything fits without evicting anything.
        more_keys, more_values = make_blocks(12, 58, 64 * KiB)
        assert client.put(more_keys, more_values).stored == 58
        assert dram(client)["evictions"] == 0
        assert client.get(keys + more_keys) == values + more_values
        assert server.running


def test_closing_a_connection_gives_back_what_it_held(
    server_factory: ServerFactory, raw_conns: list[RawShm]
) -> None:
    server = server_factory(dram_capacity="4MiB")
    keys, values = make_blocks(13, 2, 64 * KiB)
    with KVStoreClient(server.target, namespace=NS, data_plane="grpc") as client:
        client.put(keys, values)
        before = wait_released(client)
        raw = RawShm(shm_path(server))
        raw_conns.append(raw)
        assert [kind for kind, _ in raw.acquire(keys)] == [AcquireSlot.LEASE] * 2
        [(kind, _)] = raw.reserve([os.urandom(16)], [3 * 64 * KiB])
        assert kind == ReserveSlot.RESERVED
        assert dram(client)["leases"] == 2
        raw.close()
        wait_released(client, used=before["used"])


# --- (e) a deleted block stays intact for the reader that leases it --------------------------


def test_deleted_block_stays_intact_for_its_leaseholder(
    server_factory: ServerFactory, raw_conns: list[RawShm]
) -> None:
    server = server_factory(dram_capacity="1MiB")  # 16 pages of 64 KiB
    keys, values = make_blocks(14, 4, 64 * KiB)
    with (
        KVStoreClient(server.target, namespace=NS) as client,
        KVStoreClient(server.target, namespace=NS, data_plane="shm") as fast,
        KVStoreClient(server.target, namespace=NS, data_plane="grpc") as slow,
    ):
        assert client.put(keys, values).stored == 4
        raw = RawShm(shm_path(server))
        raw_conns.append(raw)
        lease_id, ranges = raw.lease(keys[0])
        assert raw.read(ranges) == values[0]
        assert client.delete(keys[:1]) == 1
        for other in (client, fast, slow):
            assert other.get(keys[:1]) == [None]
            assert other.lookup(keys[:1]) == 0
            assert other.get_into(keys[:1], [bytearray(64 * KiB)]) == [False]
        stats = dram(client)
        assert stats["retired_bytes"] == 64 * KiB
        assert stats["leases"] == 1
        # Fill the arena many times over; the leased pages are never handed out.
        more_keys, more_values = make_blocks(15, 40, 64 * KiB)
        for start in range(0, 40, 8):
            fast.put(more_keys[start : start + 8], more_values[start : start + 8])
            assert raw.read(ranges) == values[0]
        assert dram(client)["used"] <= 16 * 64 * KiB
        assert fast.get(more_keys) == more_values
        assert raw.read(ranges) == values[0]
        # Putting the key again gives a new block; the reader's old one is still untouched.
        assert client.put(keys[:1], [values[1]]).stored == 1
        assert client.get(keys[:1]) == [values[1]]
        assert raw.read(ranges) == values[0]
        raw.send(frame(Op.RELEASE, pack_ids([lease_id])))
        raw.sync()
        after = wait_released(client)
        assert after["retired_bytes"] == 0
        assert client.get(keys[1:]) == values[1:]


# --- (f) a robust socket ---------------------------------------------------------------------


def _assert_intact(server: ServerProcess, keys: list[bytes], values: list[bytes]) -> None:
    assert server.running
    with KVStoreClient(server.target, namespace=NS, data_plane="shm") as client:
        assert client.get(keys) == values
        outs = [bytearray(len(v)) for v in values]
        assert client.get_into(keys, outs) == [True] * len(keys)
        assert [bytes(o) for o in outs] == values
        assert client.data_plane == "shm"
        wait_released(client)


def test_a_client_cannot_resize_the_arena_or_write_the_index(shared: ServerProcess) -> None:
    """Both fds of the greeting are sealed: shrinking the arena would crash the server (SIGBUS)
    on its next access, and the index is the server's alone to write."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(shm_path(shared))
        sock.sendall(frame(Op.HELLO, NS_BYTES))
        _, fds, _, _ = socket.recv_fds(sock, 4096, 2)
        try:
            assert len(fds) == 2
            arena_fd, index_fd = fds
            with pytest.raises(PermissionError):
                os.ftruncate(arena_fd, 0)
            with pytest.raises(PermissionError):
                os.ftruncate(index_fd, 0)
            with pytest.raises(PermissionError):
                mmap.mmap(index_fd, 4096)
            mmap.mmap(index_fd, 4096, prot=mmap.PROT_READ).close()
            for fd in fds:  # no seal can be added either (it would lock later clients out)
                with pytest.raises(PermissionError):
                    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, 0x0010)  # F_SEAL_FUTURE_WRITE
        finally:
            for fd in fds:
                os.close(fd)
    keys, values = make_blocks(44, 1, 64 * KiB)
    with KVStoreClient(shared.target, namespace=NS, data_plane="shm") as client:
        assert client.put(keys, values).stored == 1
        assert client.get(keys) == values


def test_malformed_requests_are_answered_invalid_argument(
    shared: ServerProcess, raw_conns: list[RawShm]
) -> None:
    server = shared
    keys, values = make_blocks(16, 3, 64 * KiB)
    with KVStoreClient(server.target, namespace=NS, data_plane="grpc") as client:
        client.put(keys, values)
    path = shm_path(server)

    before_hello = RawShm(path, hello=False)
    raw_conns.append(before_hello)
    status, _ = before_hello.call(Op.LOOKUP, pack_keys(keys))
    assert status == INVALID_ARGUMENT
    status, _ = before_hello.call(Op.ACQUIRE, pack_keys(keys))
    assert status == INVALID_ARGUMENT
    status, body = before_hello.hello(NS_BYTES[:15])  # a short namespace
    assert status == INVALID_ARGUMENT, bytes(body)
    status, body = before_hello.hello()  # the connection still works
    assert status == OK and before_hello.arena is not None

    raw = RawShm(path)
    raw_conns.append(raw)
    max_keys = raw.info.max_keys if raw.info else 0
    bad_requests = {
        "unknown op": frame(99, b"whatever"),
        "op zero": frame(0),
        "truncated keys": frame(Op.ACQUIRE, struct.pack("<I", 3) + keys[0]),
        "trailing bytes": frame(Op.LOOKUP, pack_keys(keys) + b"\x00"),
        "no key count": frame(Op.LOOKUP, b"\x01"),
        "too many keys": frame(Op.ACQUIRE, struct.pack("<I", max_keys + 1)),
        "no keys": frame(Op.ACQUIRE, pack_keys([])),
        "missing lengths": frame(Op.RESERVE, pack_keys(keys[:1])),
        "empty value": frame(Op.RESERVE, pack_keys([os.urandom(16)]) + struct.pack("<Q", 0)),
        "truncated ids": frame(Op.COMMIT, struct.pack("<IQ", 2, 1)),
        "unknown reservation": frame(Op.COMMIT, pack_ids([12345])),
    }
    for name, request in bad_requests.items():
        raw.send(request)
        status, body = raw.reply()
        assert status == INVALID_ARGUMENT, (name, status, bytes(body))
        assert bytes(body), name  # a message says what was wrong
    raw.send(frame(Op.RESERVE, pack_keys([os.urandom(16)]) + struct.pack("<Q", 2**62)))
    assert raw.reply()[0] == RESOURCE_EXHAUSTED
    # One-way requests with bad bodies or unknown ids get no reply and change nothing.
    raw.send(frame(Op.RELEASE, b"\x07"))
    raw.send(frame(Op.RELEASE, pack_ids([1, 2, 3])))
    raw.send(frame(Op.CANCEL, pack_ids([999])))
    raw.sync()
    assert [kind for kind, _ in raw.acquire(keys)][:1] == [AcquireSlot.LEASE]
    raw.close()
    _assert_intact(server, keys, values)


@pytest.mark.parametrize(
    "garbage",
    [
        b"\xde\xad\xbe\xef" * 16,
        struct.pack("<I", MAX_REQUEST_BYTES + 1) + bytes([Op.LOOKUP]),
        struct.pack("<I", 0xFFFFFFFF),
        struct.pack("<I", 0) + b"\x02",
    ],
    ids=["garbage", "oversized", "max-u32", "zero-length"],
)
def test_bad_frame_lengths_close_only_that_connection(
    shared: ServerProcess, raw_conns: list[RawShm], garbage: bytes
) -> None:
    server = shared
    keys, values = make_blocks(17, 2, 64 * KiB)
    with KVStoreClient(server.target, namespace=NS, data_plane="grpc") as client:
        client.put(keys, values)
    path = shm_path(server)
    bystander = RawShm(path)
    raw_conns.append(bystander)
    lease_id, ranges = bystander.lease(keys[0])
    for hello in (False, True):
        raw = RawShm(path, hello=hello)
        raw_conns.append(raw)
        if hello:
            raw.lease(keys[1])  # what it held is given back when it is dropped
        raw.send(garbage)
        assert raw.closed_by_server()
    # Other connections go on as if nothing happened.
    bystander.sync()
    assert bystander.read(ranges) == values[0]
    bystander.send(frame(Op.RELEASE, pack_ids([lease_id])))
    bystander.sync()
    _assert_intact(server, keys, values)


def test_truncated_frames_then_hangup(shared: ServerProcess, raw_conns: list[RawShm]) -> None:
    server = shared
    keys, values = make_blocks(18, 2, 64 * KiB)
    with KVStoreClient(server.target, namespace=NS, data_plane="grpc") as client:
        client.put(keys, values)
    path = shm_path(server)
    for partial in (b"\x05\x00", frame(Op.ACQUIRE, pack_keys(keys))[:-7], frame(Op.HELLO)[:4]):
        raw = RawShm(path)
        raw_conns.append(raw)
        raw.lease(keys[0])
        raw.send(partial)
        raw.sock.shutdown(socket.SHUT_WR)
        assert raw.closed_by_server()
    _assert_intact(server, keys, values)


def test_commit_naming_one_reservation_twice_leaks_nothing(
    server_factory: ServerFactory, raw_conns: list[RawShm]
) -> None:
    server = server_factory(dram_capacity="4MiB")
    with KVStoreClient(server.target, namespace=NS, data_plane="grpc") as client:
        before = wait_released(client)
        raw = RawShm(shm_path(server))
        raw_conns.append(raw)
        new_key = os.urandom(16)
        data = os.urandom(64 * KiB)
        [(kind, (reservation_id, _))] = raw.reserve([new_key], [len(data)])
        assert kind == ReserveSlot.RESERVED
        offset = raw.write_window(data)
        ids = pack_ids([reservation_id, reservation_id])
        status, body = raw.call(Op.COMMIT_FROM, ids + struct.pack("<QQ", offset, offset))
        raw.close()
        # Whatever the answer, the connection is gone now: nothing it reserved may stay held.
        stored = client.get([new_key])
        assert stored in ([None], [data])
        used = before["used"] + (64 * KiB if stored == [data] else 0)
        wait_released(client, used=used)
        # A malformed request is the client's fault, not an internal error.
        assert status in (OK, INVALID_ARGUMENT), (status, bytes(body))


# --- (g) a server restart --------------------------------------------------------------------


@pytest.mark.each_plane
def test_live_client_survives_a_server_restart(
    server_factory: ServerFactory, data_plane: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shm_link, "RETRY_AFTER_S", 0.2)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = server_factory("--listen", f"127.0.0.1:{port}", dram_capacity="4MiB")
    keys, values = make_blocks(19, 4, 64 * KiB)
    with KVStoreClient(server.target, namespace=NS, timeout=10) as client:
        assert client.put(keys, values).stored == 4
        assert client.get(keys) == values
        before = client.data_plane
        server.restart()  # dram is saved to nvme on the way down
        assert server.target == f"127.0.0.1:{port}"

        def read_back() -> bool:
            try:
                return client.get(keys) == values
            except StoreUnavailableError:  # the channel may still be reconnecting
                return False

        wait_until(read_back, "the restarted server to serve the old blocks", timeout=10)
        more_keys, more_values = make_blocks(20, 4, 64 * KiB)
        assert client.put(more_keys, more_values).stored == 4
        outs = [bytearray(64 * KiB) for _ in keys + more_keys]
        assert client.get_into(keys + more_keys, outs) == [True] * 8
        assert [bytes(o) for o in outs] == values + more_values
        assert client.lookup(keys + more_keys) == 8
        if data_plane == "auto":
            assert before == "shm"

            def back_on_shm() -> bool:
                client.lookup(keys)
                return client.data_plane == "shm"

            wait_until(back_on_shm, "the client to reconnect to the new socket")
            assert client.get(keys + more_keys) == values + more_values


# --- (g2) reads through the published index ---------------------------------------------------


def counters(client: KVStoreClient) -> dict[str, int]:
    return dict(client.stats()["counters"])


def test_blocks_in_the_index_are_read_without_leases(
    shared: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys, values = make_blocks(40, 4, 96 * KiB)
    with KVStoreClient(shared.target, namespace=NS, data_plane="shm") as client:
        assert client.put(keys, values).stored == 4
        before = counters(client)
        outs = [bytearray(96 * KiB) for _ in keys]
        filled = client.get_into([*keys, bytes(16)], [*outs, bytearray(1)])
        assert filled == [True] * 4 + [False]
        assert [bytes(o) for o in outs] == values
        assert client.get(keys) == values

        def counted() -> bool:  # the TOUCH is one-way: the server counts it a moment later
            after = counters(client)
            return after.get("blocks_read_direct", 0) - before.get("blocks_read_direct", 0) == 8

        wait_until(counted, "the server to count the direct reads")
        assert counters(client).get("blocks_leased", 0) == before.get("blocks_leased", 0)
    # Turned off, the same reads lease their pages from the server instead.
    monkeypatch.setenv("KVSTORE_SHM_DIRECT_READS", "0")
    with KVStoreClient(shared.target, namespace=NS, data_plane="shm") as client:
        before = counters(client)
        assert client.get(keys) == values
        after = counters(client)
        assert after["blocks_leased"] - before.get("blocks_leased", 0) == 4
        assert after.get("blocks_read_direct", 0) == before.get("blocks_read_direct", 0)


def test_the_first_read_faults_the_blocks_pages_in(
    server_factory: ServerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lookups leave the arena alone; a reader's first read starts the prefaulter, which maps
    the pages of the namespace's blocks (2 MiB here, not the 64 MiB arena, nor another
    namespace's blocks); KVSTORE_SHM_PREFAULT=0 turns it off."""
    server = server_factory(dram_capacity="64MiB", nvme_capacity="64MiB")
    keys, values = make_blocks(48, 8, 256 * KiB)
    other_keys, other_values = make_blocks(49, 8, 256 * KiB)
    with KVStoreClient(server.target, namespace=OTHER_NS, data_plane="shm") as writer:
        assert writer.put(other_keys, other_values).stored == 8
    with KVStoreClient(server.target, namespace=NS, data_plane="shm") as writer:
        assert writer.put(keys, values).stored == 8
    with KVStoreClient(server.target, namespace=NS, data_plane="shm") as reader:
        assert reader.lookup(keys) == 8
        plane = reader._shm.plane
        assert plane is not None and plane._prefaulter is None
        assert reader.get(keys[:1]) == values[:1]
        prefaulter = plane._prefaulter
        assert prefaulter is not None and prefaulter.wait(timeout=30)
        assert prefaulter.completed
        # Each block's bytes (payload and header) rounded out to pages; its arena pages apart.
        assert 2 * MiB <= prefaulter.populated <= 2 * MiB + 8 * 64 * KiB
    monkeypatch.setenv("KVSTORE_SHM_PREFAULT", "0")
    with KVStoreClient(server.target, namespace=NS, data_plane="shm") as reader:
        assert reader.get(keys) == values
        assert reader._shm.plane is not None and reader._shm.plane._prefaulter is None


def test_lookups_answered_from_the_index_match_the_servers(
    server_factory: ServerFactory,
) -> None:
    """Leading dram keys are answered by the client itself; the rest, and every mix of tiers,
    misses and namespaces, must read exactly as the server (gRPC) says."""
    server = server_factory(dram_capacity="1MiB", nvme_capacity="16MiB")
    keys, values = make_blocks(45, 24, 64 * KiB)
    other_keys, other_values = make_blocks(46, 2, 64 * KiB)
    missing, _ = make_blocks(47, 2, 64 * KiB)
    with (
        KVStoreClient(server.target, namespace=NS, data_plane="shm") as shm,
        KVStoreClient(server.target, namespace=NS, data_plane="grpc") as grpc_client,
        KVStoreClient(server.target, namespace=OTHER_NS, data_plane="grpc") as other,
    ):
        assert shm.put(keys, values).stored == 24  # 1 MiB of dram: the first ones went to nvme
        assert other.put(other_keys, other_values).stored == 2
        tiers = grpc_client.lookup_tiers(keys).tiers
        assert {"dram", "nvme"} <= set(tiers)
        in_dram = [k for k, t in zip(keys, tiers, strict=True) if t == "dram"]
        in_nvme = [k for k, t in zip(keys, tiers, strict=True) if t == "nvme"]
        before = counters(grpc_client).get("lookups", 0)
        cases = [
            in_dram,
            in_dram[:3] + in_nvme[:2],
            in_dram[:2] + missing + in_dram[2:4],
            in_dram[:2] + other_keys[:1] + in_dram[2:3],
            in_nvme[:1] + in_dram[:3],
            missing,
        ]
        for case in cases:
            assert shm.lookup_tiers(case) == grpc_client.lookup_tiers(case), case
        # Every lookup is counted once, whoever answered it (stats() waits for the TOUCH).
        assert counters(shm).get("lookups", 0) - before == 2 * len(cases)


def test_a_call_read_partly_through_the_index_counts_one_get(
    server_factory: ServerFactory,
) -> None:
    server = server_factory(dram_capacity="1MiB", nvme_capacity="16MiB")
    keys, values = make_blocks(50, 24, 64 * KiB)
    with KVStoreClient(server.target, namespace=NS, data_plane="shm") as client:
        assert client.put(keys, values).stored == 24
        tiers = client.lookup_tiers(keys).tiers
        dram_at, nvme_at = tiers.index("dram"), tiers.index("nvme")
        before = counters(client)
        outs = [bytearray(64 * KiB), bytearray(64 * KiB)]
        assert client.get_into([keys[dram_at], keys[nvme_at]], outs) == [True, True]
        assert [bytes(o) for o in outs] == [values[dram_at], values[nvme_at]]
        after = counters(client)
        assert {n: after[n] - before.get(n, 0) for n in ("gets", "hits", "blocks_leased")} == {
            "gets": 1,
            "hits": 2,
            "blocks_leased": 1,
        }


def test_direct_reads_resume_once_the_touch_socket_is_replaced(shared: ServerProcess) -> None:
    """A failed SYNC drops the TOUCH socket; reads go on through the index, and the next TOUCH
    opens a new socket (to the same server) and is counted."""
    keys, values = make_blocks(51, 2, 64 * KiB)
    with KVStoreClient(shared.target, namespace=NS, data_plane="shm") as client:
        assert client.put(keys, values).stored == 2
        before = counters(client)
        plane = client._shm.plane
        assert plane is not None
        with pytest.raises(DeadlineExceededError):
            plane.flush_reads(timeout=1e-9)
        assert plane._touch_conn is None
        assert client.get(keys) == values
        after = counters(client)  # the TOUCH went out on a new socket
        assert after["blocks_read_direct"] - before.get("blocks_read_direct", 0) == 2
        assert after.get("blocks_leased", 0) == before.get("blocks_leased", 0)


def test_a_deleted_block_is_not_read_through_the_index(shared: ServerProcess) -> None:
    keys, values = make_blocks(41, 2, 64 * KiB)
    with KVStoreClient(shared.target, namespace=NS, data_plane="shm") as client:
        assert client.put(keys, values).stored == 2
        assert client.get(keys) == values
        assert client.delete(keys[:1]) == 1
        assert client.get(keys) == [None, values[1]]
        assert client.get_into(keys[:1], [bytearray(64 * KiB)]) == [False]


def test_another_namespace_does_not_read_through_the_index(shared: ServerProcess) -> None:
    keys, values = make_blocks(42, 2, 64 * KiB)
    with (
        KVStoreClient(shared.target, namespace=NS, data_plane="shm") as owner,
        KVStoreClient(shared.target, namespace=OTHER_NS, data_plane="shm") as stranger,
    ):
        assert owner.put(keys, values).stored == 2
        assert stranger.get(keys) == [None, None]
        assert stranger.get_into(keys, [bytearray(64 * KiB) for _ in keys]) == [False, False]
        assert owner.get(keys) == values


def test_churn_never_hands_back_wrong_bytes(server_factory: ServerFactory) -> None:
    """Readers copy blocks while a writer keeps evicting them and reusing their pages.

    Every block's bytes follow from its key, so any copy that raced a reuse and was kept anyway
    shows up as a mismatch. Direct reads that lose the race go down the leased path instead.
    """
    server = server_factory(dram_capacity="2MiB", nvme_capacity="64MiB")
    sizes = [64 * KiB, 128 * KiB, 192 * KiB]
    keys, values = [], []
    for n in range(48):
        block_keys, block_values = make_blocks(1000 + n, 1, sizes[n % 3])
        keys += block_keys
        values += block_values
    expected = dict(zip(keys, values, strict=True))
    stop = threading.Event()
    failures: list[str] = []
    read_ok = [0, 0]

    def write(client: KVStoreClient) -> None:
        rng = np.random.default_rng(1)
        while not stop.is_set():
            chosen = [keys[i] for i in rng.choice(len(keys), 4, replace=False)]
            client.delete(chosen)
            client.put(chosen, [expected[k] for k in chosen])

    def read(client: KVStoreClient, seed: int) -> None:
        rng = np.random.default_rng(seed)
        while not stop.is_set():
            chosen = [keys[i] for i in rng.choice(len(keys), 6, replace=False)]
            outs = [np.zeros(len(expected[k]), dtype=np.uint8) for k in chosen]
            filled = client.get_into(chosen, outs)
            for k, out, ok in zip(chosen, outs, filled, strict=True):
                read_ok[ok] += 1
                if ok and out.tobytes() != expected[k]:
                    failures.append(k.hex())

    with KVStoreClient(server.target, namespace=NS, data_plane="shm", timeout=20) as client:
        assert client.put(keys, values).stored == 48
        threads = [threading.Thread(target=write, args=(client,))]
        threads += [threading.Thread(target=read, args=(client, seed)) for seed in (2, 3)]
        for thread in threads:
            thread.start()
        # 4 s of churn, and on a loaded machine longer, until the readers have both hit and
        # missed enough (within a deadline) for the race to have been tried.
        started = time.monotonic()
        while time.monotonic() - started < 60 and (
            time.monotonic() - started < 4 or not (read_ok[True] > 100 and read_ok[False] > 0)
        ):
            time.sleep(0.1)
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
        assert failures == []
        assert read_ok[True] > 100 and read_ok[False] > 0, read_ok
        stats = client.stats()
        assert stats["counters"].get("blocks_read_direct", 0) > 0
        assert stats["tiers"]["dram"]["evictions"] > 0
        assert client.get(keys) == values  # nothing was damaged either


def test_a_new_server_on_the_same_socket_is_not_mistaken_for_the_old_one(
    server_factory: ServerFactory, tmp_path: Path
) -> None:
    """The old server's arena stays mapped in the client; the new server's answers (or its
    absence of them) must never be applied to it. Found by review: a client whose TOUCH socket
    had just been dropped went on reading the dead server's arena."""
    path = str(tmp_path / "kv.sock")
    old = server_factory("--shm-socket", path, dram_capacity="4MiB")
    [key], _ = make_blocks(49, 1, 4 * KiB)
    old_value, new_value = b"A" * 4096, b"B" * 4096
    with KVStoreClient(old.target, namespace=NS, data_plane="shm", timeout=2) as client:
        assert client.put([key], [old_value]).stored == 1
        assert client.get([key]) == [old_value]
        plane = client._shm.plane
        assert plane is not None and plane.direct_reads
        with pytest.raises(DeadlineExceededError):  # drops the TOUCH socket
            plane.flush_reads(timeout=1e-9)
        old.kill()
        new = server_factory("--shm-socket", path, dram_capacity="4MiB")
        with KVStoreClient(new.target, namespace=NS, data_plane="grpc") as other:
            assert other.put([key], [new_value]).stored == 1
        for _ in range(3):
            out = bytearray(4096)
            with pytest.raises(StoreUnavailableError):  # the old server's target is dead
                client.get_into([key], [out])
            assert bytes(out) != old_value
        # Spoken to directly, the plane refuses the new server instead of trusting it.
        with pytest.raises(ShmUnavailableError):
            plane.get_into([key], [bytearray(4096)])


def test_closing_a_plane_under_busy_readers_only_ever_refuses(shared: ServerProcess) -> None:
    """Found by review: a reader inside the index while another thread closed the plane hit an
    IndexError instead of falling back."""
    keys, values = make_blocks(48, 4, 64 * KiB)
    with KVStoreClient(shared.target, namespace=NS, data_plane="grpc") as client:
        assert client.put(keys, values).stored == 4
    for _ in range(5):
        assert _close_under_readers(ShmDataPlane(shm_path(shared), NS_BYTES), keys, values) == []


def _close_under_readers(
    plane: ShmDataPlane, keys: list[bytes], values: list[bytes]
) -> list[BaseException]:
    """Close ``plane`` while two threads read ``keys`` through it; what went wrong for them."""
    errors: list[BaseException] = []
    stop = threading.Event()
    reads: list[None] = []  # one per read begun, by either thread

    def read() -> None:
        while not stop.is_set():
            reads.append(None)
            outs = [bytearray(len(value)) for value in values]
            try:
                filled = plane.get_into(keys, outs)
                found = plane.lookup(keys).hits
            except ShmUnavailableError:
                continue
            except BaseException as exc:
                errors.append(exc)
                return
            if found not in (0, len(keys)) or any(
                ok and bytes(out) != value
                for ok, out, value in zip(filled, outs, values, strict=True)
            ):
                errors.append(AssertionError(f"wrong answer: {filled}, {found}"))

    threads = [threading.Thread(target=read) for _ in range(2)]
    for thread in threads:
        thread.start()
    # (a reader that failed has stopped: what it found is the answer)
    wait_until(lambda: len(reads) >= 4 or bool(errors), "the readers under way")
    plane.close()
    closed_at = len(reads)
    wait_until(lambda: len(reads) >= closed_at + 4 or bool(errors), "reads on the closed plane")
    stop.set()
    for thread in threads:
        thread.join(timeout=10)
    return errors


def test_a_dead_server_is_not_read_through_its_orphaned_arena(
    server_factory: ServerFactory,
) -> None:
    """The arena outlives a killed server in every client that mapped it.

    Its index can no longer change, so a read that validated is still the block's bytes; but the
    client must notice within moments (its background TOUCH fails) and stop using it.
    """
    server = server_factory(dram_capacity="4MiB")
    keys, values = make_blocks(43, 2, 64 * KiB)
    with KVStoreClient(server.target, namespace=NS, data_plane="shm", timeout=2) as client:
        assert client.put(keys, values).stored == 2
        assert client.get(keys) == values
        server.kill()

        def refused() -> bool:
            outs = [bytearray(64 * KiB) for _ in keys]
            try:
                filled = client.get_into(keys, outs)
            except StoreUnavailableError:
                return True
            assert filled == [True, True] and [bytes(o) for o in outs] == values
            return False

        wait_until(refused, "the client to stop reading a dead server's arena")
        with pytest.raises(StoreUnavailableError):  # and it stays that way
            client.get(keys)


# --- (h) the data plane turned off -----------------------------------------------------------


def test_shm_socket_off(server_factory: ServerFactory) -> None:
    server = server_factory("--shm-socket", "", dram_capacity="4MiB")
    assert shm_path(server) == ""
    keys, values = make_blocks(21, 2, 64 * KiB)
    with KVStoreClient(server.target, namespace=NS, data_plane="auto") as client:
        assert client.put(keys, values).stored == 2
        assert client.get(keys) == values
        assert client.data_plane == "grpc"
    with KVStoreClient(server.target, namespace=NS, data_plane="shm") as client:
        with pytest.raises(StoreUnavailableError):
            client.get(keys)
        # "shm" insists: an immediate second call must not quietly go through gRPC either.
        with pytest.raises(StoreUnavailableError):
            client.get(keys)
        assert client.data_plane == "grpc"


def test_a_socket_that_cannot_be_created_leaves_grpc_serving(
    server_factory: ServerFactory, tmp_path: Path
) -> None:
    missing = tmp_path / "no-such-dir" / "kvstore.sock"
    server = server_factory("--shm-socket", str(missing), dram_capacity="4MiB")
    assert shm_path(server) == ""
    log = server.stderr()
    assert "shared-memory data plane off" in log and str(missing) in log and "gRPC" in log
    keys, values = make_blocks(24, 2, 64 * KiB)
    with KVStoreClient(server.target, namespace=NS) as client:
        assert client.put(keys, values).stored == 2
        assert client.get(keys) == values
        assert client.data_plane == "grpc"
    assert not missing.parent.exists()


def test_the_socket_mode_flag_sets_the_socket_mode(
    server_factory: ServerFactory, tmp_path: Path
) -> None:
    path = tmp_path / "kvstore.sock"
    server = server_factory("--shm-socket", str(path), "--shm-socket-mode", "0600")
    assert shm_path(server) == str(path)
    assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600
    keys, values = make_blocks(25, 2, 64 * KiB)
    with KVStoreClient(server.target, namespace=NS, data_plane="shm") as client:
        assert client.put(keys, values).stored == 2
        assert client.get(keys) == values
        assert client.data_plane == "shm"


# --- (i) threads, (j) asyncio ----------------------------------------------------------------


@pytest.mark.each_plane
def test_threads_of_one_client_get_their_own_bytes(shared: ServerProcess, data_plane: str) -> None:
    common_keys, common_values = make_blocks(22, 8, 32 * KiB)
    errors: list[BaseException] = []
    with KVStoreClient(shared.target, namespace=NS) as client:
        client.put(common_keys, common_values)

        def work(seed: int) -> None:
            try:
                rng = np.random.default_rng(seed)
                for round_ in range(15):
                    keys, values = make_blocks(
                        seed * 100 + round_, 3, int(rng.integers(1, 96)) * KiB
                    )
                    result = client.put(keys, values)
                    assert result.stored + result.already_present == 3
                    outs = [np.empty(len(v), dtype=np.uint8) for v in values]
                    assert client.get_into(keys, outs) == [True] * 3
                    assert [o.tobytes() for o in outs] == values
                    order = rng.permutation(len(common_keys))
                    picked = [common_keys[i] for i in order]
                    assert client.get(picked) == [common_values[i] for i in order]
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(seed,)) for seed in range(1, 5)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert not any(thread.is_alive() for thread in threads)
        if errors:
            raise errors[0]
        assert client.data_plane == ("shm" if data_plane == "auto" else "grpc")
        wait_released(client)


async def test_async_client_over_shm(shared: ServerProcess) -> None:
    keys, values = make_blocks(23, 5, 80 * KiB)
    tensor = torch.randn(4, 1024, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    tensor_key = os.urandom(16)
    async with AsyncKVStoreClient(shared.target, namespace=NS, data_plane="shm") as client:
        assert (await client.put(keys, values)).stored == 5
        assert client.data_plane == "shm"
        assert (await client.put([tensor_key], [tensor])).stored == 1
        assert await client.lookup(keys) == 5
        assert (await client.lookup_tiers(keys)).tiers == ["dram"] * 5
        assert await client.get(keys) == values
        outs = [bytearray(len(v)) for v in values]
        assert await client.get_into(keys, outs) == [True] * 5
        assert [bytes(o) for o in outs] == values
        out = torch.empty_like(tensor)
        assert await client.get_into([tensor_key], [out]) == [True]
        assert torch.equal(out.view(torch.uint8), tensor.view(torch.uint8))
    with KVStoreClient(shared.target, namespace=NS, data_plane="grpc") as slow:
        assert slow.get(keys) == values
        wait_released(slow)
