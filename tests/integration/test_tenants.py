"""Tenants enforced by a real ``kvstore serve``: tenant B can neither read, delete, probe nor
overwrite tenant A's blocks, through gRPC, shared memory, Redis or the files on disk.

Each tenant is configured in a TOML file (``[tenants.NAME]``) with the token names that act as it;
the tests call with those real tokens. A process of another local user is a real subprocess run
as ``nobody`` (the suite runs as root), speaking the shared-memory socket's protocol by hand.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import numpy as np
import pytest

from kvstore import KVStoreClient
from kvstore.errors import KVStoreError, PermissionDeniedError
from kvstore.protocol.messages import namespace_bytes
from kvstore.protocol.shm_frames import Op, frame

if TYPE_CHECKING:
    from harness.serve import ServerProcess
    from harness.server_factory import ServerFactory

from harness.redis_server import RedisServer
from harness.serve import clean_env
from harness.tenant_config import (
    BLOCK_BYTES,
    NOBODY,
    NOGROUP,
    NS,
    OTHER_NS,
    TOKENS,
    blocks,
    client,
    data_plane_of,
    write_config,
)


@pytest.fixture
def tenant_server(server_factory: ServerFactory, tmp_path: Path) -> ServerProcess:
    return server_factory("--config", str(write_config(tmp_path)))


@pytest.fixture(params=["uids", "gids"])
def apart_server(
    request: pytest.FixtureRequest, server_factory: ServerFactory, tmp_path: Path
) -> Iterator[ServerProcess]:
    """Tenant a's socket admits root only, tenant b's nobody only (by uid, or by its group).

    Its sockets' directories go in a directory other users may pass through (the suite's own
    temporary directories are root's alone), so that only the server's check keeps them out.
    """
    passable = tempfile.mkdtemp(prefix="kvt-tenants-")
    os.chmod(passable, 0o711)
    try:
        config = write_config(tmp_path, b_uids=f"[{NOBODY}]")
        if request.param == "gids":
            text = config.read_text().replace("uids = [0]", "gids = [0]")
            config.write_text(text.replace(f"uids = [{NOBODY}]", f"gids = [{NOGROUP}]"))
        yield server_factory("--config", str(config), env={"TMPDIR": passable})
    finally:
        shutil.rmtree(passable, ignore_errors=True)


def test_b_cannot_read_delete_probe_or_overwrite_a(tenant_server: ServerProcess) -> None:
    keys, values = blocks(1)
    _, others = blocks(2)
    with client(tenant_server, "alice") as a, client(tenant_server, "bob") as b:
        assert a.put(keys, values).stored == 4
        # Read and probe: the keys are simply absent for b, in every way it can ask.
        assert b.lookup(keys) == 0
        assert b.get(keys) == [None] * 4
        progress = b.wait_prefetch(b.prefetch(keys), timeout=10)
        assert (progress.ready, progress.missing) == (0, 4)
        assert b.stats()["blocks"] == 0
        # Delete: nothing of a's goes.
        assert b.delete(keys) == 0
        # Overwrite and probe by put: b's put of the same keys under another namespace stores
        # b's own copies. On a shared store it would answer "stored under another namespace",
        # telling b which prompts a has cached.
        with KVStoreClient(
            tenant_server.target, namespace=OTHER_NS, token=TOKENS["bob"]
        ) as b_other:
            assert b_other.put(keys, others).stored == 4
            assert b_other.get(keys) == others
        assert b.get(keys) == [None] * 4  # b's copies are under b's other namespace
        assert a.get(keys) == values
        assert a.lookup(keys) == 4 and a.stats()["blocks"] == 4
        # a's prefetch ids are not b's to read or cancel.
        a_prefetch = a.prefetch(keys)
        with pytest.raises(KVStoreError, match="NOT_FOUND"):
            b.prefetch_status(a_prefetch + 100)


def test_credentials_of_no_tenant_are_refused_everywhere(tenant_server: ServerProcess) -> None:
    keys, values = blocks(3)
    with client(tenant_server, "carol") as carol:
        for call in (
            lambda: carol.put(keys, values),
            lambda: carol.lookup(keys),
            lambda: carol.get(keys),
            lambda: carol.delete(keys),
            lambda: carol.stats(),
        ):
            with pytest.raises(PermissionDeniedError, match="belong to no tenant") as failure:
                call()
            # The answer names what carol presented, nothing of the tenants that exist.
            assert "alice" not in str(failure.value) and "tenants.a" not in str(failure.value)


# Run as another user: connect to a socket, say HELLO, report the reply's size and fd count.
_AS_OTHER_USER = """
import array, socket, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.settimeout(5)
sock.connect(sys.argv[1])
try:  # a refused peer is hung up on at once: sending may already fail
    sock.sendall(bytes.fromhex(sys.argv[2]))
    data, ancillary, _, _ = sock.recvmsg(4096, socket.CMSG_SPACE(16 * 4))
except (BrokenPipeError, ConnectionResetError):
    data, ancillary = b"", []
fds = array.array("i")
for _, _, payload in ancillary:
    fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
print(len(data), len(fds))
"""


def hello_as(uid: int, socket_path: str) -> tuple[int, int]:
    """(reply bytes, descriptors received) for a HELLO sent by a process of user ``uid``."""
    hello = frame(Op.HELLO, namespace_bytes(NS)).hex()
    done = subprocess.run(
        ["/usr/bin/python3", "-c", _AS_OTHER_USER, socket_path, hello],
        user=uid,
        group=NOGROUP,
        extra_groups=[],
        capture_output=True,
        text=True,
        timeout=20,
        cwd="/",
    )
    assert done.returncode == 0, done.stderr
    size, fds = done.stdout.split()
    return int(size), int(fds)


def test_each_tenant_maps_only_its_own_arena(apart_server: ServerProcess) -> None:
    tenant_server = apart_server
    keys, values = blocks(4)
    a_plane, b_plane = data_plane_of(tenant_server, "alice"), data_plane_of(tenant_server, "bob")
    assert a_plane.shm_socket and b_plane.shm_socket
    assert a_plane.shm_socket != b_plane.shm_socket
    assert a_plane.instance_id != b_plane.instance_id
    # a's client (root) maps a's arena; b's socket refuses root, so b's client runs on gRPC.
    with (
        client(tenant_server, "alice", data_plane="shm") as a,
        client(tenant_server, "bob", data_plane="grpc") as b,
    ):
        assert a.put(keys, values).stored == 4
        assert b.get(keys) == [None] * 4
        assert a.get(keys) == values
        with (
            client(tenant_server, "bob", data_plane="shm") as b_shm,
            pytest.raises(KVStoreError, match="shared-memory data plane unavailable"),
        ):
            b_shm.get(keys)
    # A process of b's user gets b's arena and never a's: the kernel says who connects.
    reply, fds = hello_as(NOBODY, b_plane.shm_socket)
    assert reply > 0 and fds >= 1
    assert hello_as(NOBODY, a_plane.shm_socket) == (0, 0)
    assert "is not among this socket's" in tenant_server.stderr()


def test_a_value_copied_between_tenants_in_redis_is_never_served(
    server_factory: ServerFactory, tmp_path: Path
) -> None:
    keys, values = blocks(5)
    with RedisServer(tmp_path / "redis") as redis_server:
        config = write_config(tmp_path, f'[redis]\nurl = "{redis_server.url}"\n')
        server = server_factory("--config", str(config))
        raw = redis_server.client()
        a_names = [f"kvstore:v1:t:a:{key.hex()}" for key in keys]
        with client(server, "alice") as a, client(server, "bob") as b:
            assert a.put(keys, values).stored == 4
            deadline = time.monotonic() + 5.0
            while None in (stored := raw.mget(a_names)):  # the write-through is asynchronous
                assert time.monotonic() < deadline, "write-through to redis not within 5 s"
                time.sleep(0.05)
            # Someone with write access to Redis copies a's values to b's place, untouched.
            for key, value in zip(keys, stored, strict=True):
                raw.set(f"kvstore:v1:t:b:{key.hex()}", value)
            assert b.get(keys) == [None] * 4, "a's block was served to b"
            assert b.stats()["tiers"]["redis"]["corrupt_blocks"] == 4
            assert a.get(keys) == values
        raw.close()


def test_tenants_keep_their_own_lmdb_directories_and_quotas(
    tenant_server: ServerProcess,
) -> None:
    keys, values = blocks(6)
    with client(tenant_server, "alice") as a, client(tenant_server, "bob") as b:
        assert a.put(keys, values).stored == 4
        a_tiers, b_tiers = a.stats()["tiers"], b.stats()["tiers"]
        assert a_tiers["dram"]["capacity"] == 16 * 1024**2
        assert 8 * 1024**2 < a_tiers["nvme"]["capacity"] <= 16 * 1024**2
        assert a_tiers["dram"]["used"] > 0 and b_tiers["dram"]["used"] == 0
    tenant_server.stop()
    tenants_dir = tenant_server.nvme_path / "tenants"
    assert sorted(os.listdir(tenants_dir)) == ["a", "b"]
    for name in ("a", "b"):
        assert os.stat(tenants_dir / name).st_mode & 0o777 == 0o700
    # a's blocks were saved into a's directory on shutdown, and come back to a alone.
    tenant_server.start()
    with client(tenant_server, "alice") as a, client(tenant_server, "bob") as b:
        assert a.get(keys) == values
        assert b.get(keys) == [None] * 4


@pytest.mark.parametrize(
    ("extra", "tokens", "message"),
    [
        ("", False, "auth.tokens_file"),
        ("", True, "no token names"),
    ],
    ids=["no-credentials", "identity-without-token"],
)
def test_tenants_that_cannot_be_told_apart_refuse_to_start(
    tmp_path: Path, extra: str, tokens: bool, message: str
) -> None:
    config = write_config(tmp_path, extra)
    text = config.read_text()
    if tokens:
        text = text.replace('identities = ["bob"]', 'identities = ["bobby"]')
    else:
        text = "\n".join(line for line in text.splitlines() if "tokens_file" not in line)
    config.write_text(text)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvstore.cli",
            "serve",
            "--config",
            str(config),
            # Never the defaults: a user's own `kvstore serve` may hold them.
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env({"KVSTORE_NVME_PATH": str(tmp_path / "nvme")}),
    )
    assert done.returncode != 0
    assert message in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "nvme").exists(), "a refused start opened the data directory"


def test_a_ucx_endpoint_serves_only_the_tenant_that_first_used_it(
    server_factory: ServerFactory, tmp_path: Path
) -> None:
    """The endpoint's hello carries no credentials; the first authenticated control call binds
    it to its tenant, and another tenant that learnt the endpoint's id is refused."""
    from kvstore._proto.kvstore.v1 import ucx_pb2 as ucx_pb
    from kvstore._proto.kvstore.v1 import ucx_pb2_grpc as ucx_pb_grpc
    from kvstore.client.ucx import UcxDataClient

    config = write_config(tmp_path)
    server = server_factory("--config", str(config), "--ucx-listen", "127.0.0.1:0")
    address = data_plane_of(server, "alice").ucx_address
    keys, values = blocks(7)
    with client(server, "alice", data_plane="grpc") as a, client(server, "bob") as b:
        ucx = UcxDataClient(a._transport.channel, address, namespace_bytes(NS), ucx_control=True)
        try:
            stored = ucx.put(keys, values)
            assert stored is not None and stored.stored == 4, ucx.last_error
            buffers = [np.zeros(BLOCK_BYTES, dtype=np.uint8) for _ in keys]
            assert ucx.get_into(keys, buffers) == [True] * 4
            assert [buffer.tobytes() for buffer in buffers] == values
            connection = ucx.lanes.live()[0]
            assert connection is not None
            request = ucx_pb.UcxGetRequest(
                client_id=connection.client_id,
                keys=keys,
                namespace=namespace_bytes(NS),
                transfer_id=99,
            )
            with pytest.raises(grpc.RpcError) as failure:
                ucx_pb_grpc.UcxTransferStub(b._transport.channel).UcxGet(request, timeout=10)
            assert failure.value.code() == grpc.StatusCode.PERMISSION_DENIED
            # Nor can it bind a's endpoint to get a control-message key for it.
            bind = ucx_pb.UcxBindRequest(client_ids=[connection.client_id], versions=[1])
            with pytest.raises(grpc.RpcError) as failure:
                ucx_pb_grpc.UcxTransferStub(b._transport.channel).UcxBind(bind, timeout=10)
            assert failure.value.code() == grpc.StatusCode.PERMISSION_DENIED
            # a's endpoint still serves a, its control calls over the endpoint itself.
            assert ucx.get(keys) == values
            assert ucx.counters["control_ucx"] == 3 and ucx.counters["control_grpc"] == 0
        finally:
            ucx.close()
