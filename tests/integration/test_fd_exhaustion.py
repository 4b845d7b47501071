"""A server out of file descriptors, against a real ``kvstore serve``.

Co-located clients can open shared-memory connections until the server's process hits its
``RLIMIT_NOFILE``. That must pause the shared-memory plane (accepting backs off, with a log line),
not end it: once the connections go, it serves again; and SIGTERM afterwards still saves the
blocks that were only in DRAM to NVMe and closes LMDB cleanly (exit code 0), so a restart on the
same NVMe directory has them bit-identical.
"""

from __future__ import annotations

import os
import resource
import socket
import time
from typing import TYPE_CHECKING

import grpc
import numpy as np
import pytest
from harness.polling import poll

from kvstore import KVStoreClient, Namespace
from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore._proto.kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.protocol.shm_frames import Op, frame, pack_keys

if TYPE_CHECKING:
    from harness.server_factory import ServerFactory

KiB = 1024
NS = Namespace(model="fd-exhaustion-test")
HEADROOM_FDS = 12  # descriptors left to the server beyond what it has open when idle
CONNECTIONS = 48  # well past the headroom, within the socket's listen backlog


def shm_hello(path: str) -> int:
    """Connect, greet, and return the reply's status (raises if none comes within 5 s)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(path)
        sock.sendall(frame(Op.HELLO, NS.fingerprint()))
        data, fds, _, _ = socket.recv_fds(sock, 4096, 2)
        for fd in fds:
            os.close(fd)
        assert data, "the server hung up"
        sock.sendall(frame(Op.LOOKUP, pack_keys([bytes(16)])))
        assert sock.recv(4096), "no LOOKUP reply"
        return data[4]


@pytest.mark.parametrize("wait_for_the_plane", [True, False], ids=["plane-back", "sigterm-at-once"])
def test_running_out_of_fds_pauses_the_shm_plane_and_shutdown_still_saves_dram(
    server_factory: ServerFactory, wait_for_the_plane: bool
) -> None:
    """Exhaust the server's descriptors with shm connections, then close them: the shm plane
    serves again (``plane-back``), and SIGTERM, whether the plane came back or not yet
    (``sigterm-at-once``), exits cleanly having saved the DRAM-only blocks to NVMe."""
    server = server_factory(
        env={
            "KVSTORE_SHM_MAX_CONNECTIONS": "1000",
            "KVSTORE_SHM_MAX_CONNECTIONS_PER_UID": "1000",
        },
        dram_capacity="16MiB",
        nvme_capacity="64MiB",
    )
    rng = np.random.default_rng(7)
    keys = [rng.bytes(16) for _ in range(6)]
    values = [rng.bytes(64 * KiB) for _ in range(6)]
    with KVStoreClient(server.target, namespace=NS, data_plane="grpc") as client:
        assert client.put(keys, values).stored == 6
        assert client.lookup_tiers(keys).tiers == ["dram"] * 6  # nowhere else yet
        with grpc.insecure_channel(server.target) as channel:
            path = pb_grpc.KVStoreStub(channel).DataPlane(pb.DataPlaneRequest(), timeout=5)
        path = str(path.shm_socket)
        assert shm_hello(path) == 0

        assert server.proc is not None
        pid = server.proc.pid
        open_fds = len(os.listdir(f"/proc/{pid}/fd"))
        limit = open_fds + HEADROOM_FDS
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (limit, limit))

        socks: list[socket.socket] = []
        try:
            for _ in range(CONNECTIONS):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(5)
                socks.append(sock)
                sock.connect(path)
            deadline = time.monotonic() + 5
            while len(os.listdir(f"/proc/{pid}/fd")) < limit:
                assert time.monotonic() < deadline, "the server never ran out of descriptors"
                time.sleep(0.05)
            # accept() has failed with EMFILE (said once in the log; it keeps trying meanwhile).
            poll(lambda: "cannot accept a connection" in server.stderr(), 10.0, "the EMFILE line")
        finally:
            for sock in socks:
                sock.close()

        if not wait_for_the_plane:
            back = limit - HEADROOM_FDS // 2
            poll(lambda: len(os.listdir(f"/proc/{pid}/fd")) <= back, 10.0, "the descriptors back")
        # Descriptors given back: the shared-memory plane serves again (it retries within 1 s).
        deadline = time.monotonic() + 5
        while wait_for_the_plane:
            try:
                assert shm_hello(path) == 0
                break
            except (OSError, AssertionError):
                assert time.monotonic() < deadline, server.stderr()
                time.sleep(0.1)
        if wait_for_the_plane:
            assert "cannot accept a connection" in server.stderr()  # it said why it paused
            with KVStoreClient(server.target, namespace=NS, data_plane="shm") as fast:
                assert fast.get(keys) == values
                assert fast.data_plane == "shm"
        assert client.lookup_tiers(keys).tiers == ["dram"] * 6

    # SIGTERM: a clean exit (stop() asserts 0) that saved the DRAM-only blocks to NVMe.
    server.restart()
    with KVStoreClient(server.target, namespace=NS, data_plane="grpc") as client:
        assert client.lookup_tiers(keys).tiers == ["nvme"] * 6
        assert client.get(keys) == values
