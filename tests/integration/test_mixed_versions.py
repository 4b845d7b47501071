"""A rolling upgrade, for real: the previous release and this one in one cluster, losing nothing.

The previous release (:data:`kvstore.formats.PREVIOUS_RELEASE`) is built from this repository's
own history: a ``git worktree`` of that commit in a temporary directory, run with the same
interpreter (``PYTHONPATH`` = the worktree: the dependencies are the same). One node of each
release shares one real redis-server, both as the shared tier and as the cluster index, with
``cluster.shared_data = both`` (peers first, then Redis) and write-through on.

* Peers both ways: each node reads the other's blocks straight from it (each verifies the
  other's sealed headers, and believes the other's node description: this release writes the
  version the previous one reads, ``cluster.write_formats = previous``).
* Write-through both ways: with the writer stopped, each node reads the other's blocks from
  Redis (and each block in Redis verifies under this release's code, byte for byte).
* Nothing deleted: the Redis keys before the reads are all there after them, no node counted a
  corrupt block, and a block labelled with a header version newer than this release reads is a
  miss for the new node and stays in Redis.
* The shared-memory socket both ways: this release's client puts, looks up, leases, reads and
  reserves through a previous-release node's arena without falling back to gRPC, and the
  previous release's own frame code (:mod:`kvstore.protocol.shm_frames` as it was) reads this
  release's HELLO, LOOKUP, ACQUIRE and RESERVE replies (its client proper maps the arena
  writable, which this release's sealed arena refuses: it uses gRPC, as it always did there).

Every payload read is compared with what was put.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from harness.cluster_nodes import NS, blocks_for, cluster_env, holders
from harness.polling import poll
from harness.previous_release import previous_release_checkout

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore._proto.kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.block import Keyring, decode_value, encode_header

if TYPE_CHECKING:
    from harness.serve import ServerProcess
    from harness.server_factory import ServerFactory

from harness.redis_server import RedisServer

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SECRET = "mixed-version test secret"
PAYLOAD_PREFIX = b"kvstore:v1:"


@pytest.fixture(scope="module")
def previous_release(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A checkout of the previous release: a git worktree of :data:`PREVIOUS_RELEASE`."""
    with previous_release_checkout(tmp_path_factory.mktemp("previous") / "release") as where:
        yield where


def node_env(url: str, node: str, code: Path) -> dict[str, str]:
    return {
        **cluster_env(url, node),
        "KVSTORE_REDIS_URL": url,
        "KVSTORE_CLUSTER_SHARED_DATA": "both",
        "KVSTORE_INTEGRITY_SECRETS": SECRET,
        "PYTHONPATH": str(code),  # which release's kvstore the node runs
        # Not the working directory first (python -m would put it there: this checkout).
        "PYTHONSAFEPATH": "1",
    }


def grpc(node: ServerProcess) -> Any:
    # gRPC only: a block must come from the node's tiers or its peers, not from another plane.
    return node.client(NS, data_plane="grpc", timeout=5.0)


def counters(node: ServerProcess) -> dict[str, int]:
    return dict(node.stats()["counters"])


def tier_stat(node: ServerProcess, tier: str, name: str) -> int:
    return int(node.stats()["tiers"].get(tier, {}).get(name, 0))


def block_names(redis_server: RedisServer) -> set[bytes]:
    hex_digits = set(b"0123456789abcdef")
    names = redis_server.client().scan_iter(match=PAYLOAD_PREFIX + b"*")
    return {name for name in names if set(name[len(PAYLOAD_PREFIX) :]) <= hex_digits}


def block_values(redis_server: RedisServer) -> dict[bytes, bytes]:
    """Every block value in Redis by its name."""
    client = redis_server.client()
    return {name: client.get(name) for name in block_names(redis_server)}


def check_nothing_refused(node: ServerProcess) -> None:
    """No block this node read was taken for corrupt (in Redis, on nvme, from a peer)."""
    assert tier_stat(node, "redis", "corrupt_blocks") == 0, node.stderr()
    assert tier_stat(node, "nvme", "corrupt_blocks") == 0, node.stderr()
    assert counters(node).get("peer_corrupt_blocks", 0) == 0, node.stderr()


def test_previous_and_this_release_share_a_cluster_losing_nothing(
    previous_release: Path, server_factory: ServerFactory, redis_server: RedisServer
) -> None:
    url = redis_server.url
    old = server_factory(env=node_env(url, "old", previous_release))
    new = server_factory(env=node_env(url, "new", REPO))
    # Each runs its own release: only this one counts blocks of a later release.
    assert "newer_format_blocks" not in old.stats()["tiers"]["redis"]
    assert "newer_format_blocks" in new.stats()["tiers"]["redis"]

    # --- peers both ways -----------------------------------------------------------------
    from_old, old_values = blocks_for(0, 4)
    from_new, new_values = blocks_for(5_000, 4)
    with grpc(old) as writer:
        assert writer.put(from_old, old_values).stored == 4
    with grpc(new) as writer:
        assert writer.put(from_new, new_values).stored == 4
    poll(lambda: holders(url, from_old).get("old") is not None, 10.0, "old node's index entries")
    poll(lambda: holders(url, from_new).get("new") is not None, 10.0, "new node's index entries")
    with grpc(new) as reader:
        assert reader.get(from_old) == old_values
    with grpc(old) as reader:
        assert reader.get(from_new) == new_values
    assert counters(new)["peer_hits"] == 4  # read from the old node, its seals verified
    assert counters(old)["peer_hits"] == 4  # read from the new node: it believed its description

    # --- write-through both ways -----------------------------------------------------------
    via_old, via_old_values = blocks_for(10_000, 3)
    via_new, via_new_values = blocks_for(15_000, 3)
    with grpc(old) as writer:
        assert writer.put(via_old, via_old_values).stored == 3
    with grpc(new) as writer:
        assert writer.put(via_new, via_new_values).stored == 3
    written = dict(zip(from_old + from_new, old_values + new_values, strict=True))
    written.update(zip(via_old + via_new, via_old_values + via_new_values, strict=True))
    expected = {PAYLOAD_PREFIX + key.hex().encode() for key in written}
    poll(lambda: expected <= block_names(redis_server), 10.0, "write-through of every block")
    # What each release wrote to Redis verifies under this release's code, byte for byte.
    ring = Keyring([SECRET.encode()])
    direct = redis_server.client()
    for key, value in written.items():
        raw = direct.get(PAYLOAD_PREFIX + key.hex().encode())
        assert raw is not None
        _, payload = decode_value(key, raw, ring)
        assert bytes(payload) == value

    # A block labelled with a header version newer than this release reads (a later release's).
    future_keys, future_values = blocks_for(20_000, 1)
    future = bytearray(encode_header(future_keys[0], NS.fingerprint(), future_values[0], ring))
    future[4:6] = (9).to_bytes(2, "little")
    future_name = PAYLOAD_PREFIX + future_keys[0].hex().encode()
    direct.set(future_name, bytes(future) + future_values[0], px=600_000)
    before = block_values(redis_server)
    assert len(before) == len(written) + 1

    # The old node gone (its index entries withdrawn): the new node reads its blocks from Redis.
    check_nothing_refused(old)
    old.stop()
    with grpc(new) as reader:
        assert reader.get(via_old) == via_old_values
        assert reader.get(future_keys) == [None]  # a miss, left in place
    assert tier_stat(new, "redis", "newer_format_blocks") >= 1
    check_nothing_refused(new)
    # The old node back, the new one gone: the old node reads the new one's from Redis.
    old.start()
    new.stop()
    with grpc(old) as reader:
        assert reader.get(via_new) == via_new_values
    check_nothing_refused(old)

    # --- nothing deleted ---------------------------------------------------------------------
    after = block_values(redis_server)
    assert after == before


def release_env(code: Path) -> dict[str, str]:
    """The environment of a process that runs the kvstore of ``code``."""
    return {"PYTHONPATH": str(code), "PYTHONSAFEPATH": "1"}


def shm_socket_of(node: ServerProcess) -> str:
    """The socket the node names in its ``DataPlane`` answer."""
    import grpc as grpc_lib

    with grpc_lib.insecure_channel(node.target) as channel:
        reply = pb_grpc.KVStoreStub(channel).DataPlane(pb.DataPlaneRequest(), timeout=5)
    assert reply.shm_socket, "the node serves no shared-memory socket"
    return str(reply.shm_socket)


def test_this_release_speaks_shared_memory_to_the_previous_one(
    previous_release: Path, server_factory: ServerFactory
) -> None:
    old = server_factory(env=release_env(previous_release))
    keys, values = blocks_for(30_000, 4)
    missing, _ = blocks_for(35_000, 1)
    with old.client(NS, data_plane="shm", timeout=5.0) as client:
        assert client.put(keys[:3], values[:3]).stored == 3  # RESERVE, then COMMIT (unsealed)
        assert client.lookup_tiers(keys[:3] + missing).hits == 3
        assert client.get(keys[:3] + missing) == [*values[:3], None]
        lease = client.lease(keys[:2] + missing)  # not all in the index: ACQUIRE
        assert lease is not None
        with lease:
            assert [None if v is None else v.tobytes() for v in lease.views] == [
                *values[:2],
                None,
            ]
        reservation = client.reserve(keys[2:], [len(values[2]), len(values[3])])
        assert reservation is not None
        assert reservation.states == ["present", "reserved"]
        reservation.write(1, values[3])
        assert reservation.commit().stored == 1
        assert client.get(keys) == values
        assert client.data_plane == "shm"  # never fell back


OLD_FRAMES = textwrap.dedent(
    """
    import json, mmap, os, socket, struct, sys
    import kvstore
    from kvstore.protocol.shm_frames import Cursor, Op, Slot, frame, pack_keys, unpack_hello

    path, namespace, stored, absent = sys.argv[1:]
    namespace = bytes.fromhex(namespace)
    stored = [bytes.fromhex(k) for k in stored.split(",")]
    absent = bytes.fromhex(absent)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(path)

    def reply(data=b""):
        data = bytearray(data)
        while len(data) < 4 or len(data) < 4 + struct.unpack("<I", data[:4])[0]:
            chunk = sock.recv(65536)
            assert chunk, "server closed"
            data += chunk
        assert data[4] == 0, bytes(data[5:])
        return memoryview(data)[5:]

    sock.sendall(frame(Op.HELLO, namespace))
    data, fds, _, _ = socket.recv_fds(sock, 4096, 2)
    hello = unpack_hello(reply(data))
    arena = mmap.mmap(fds[0], hello.arena_size, prot=mmap.PROT_READ)
    out = {"code": kvstore.__file__, "tiers": hello.tiers}
    sock.sendall(frame(Op.LOOKUP, pack_keys(stored + [absent])))
    cursor = Cursor(reply())
    out["hits"] = cursor.u32()
    out["lookup"] = list(cursor.take(len(stored) + 1))
    cursor.done()
    sock.sendall(frame(Op.ACQUIRE, pack_keys(stored + [absent])))
    cursor = Cursor(reply())
    out["acquire"], out["blocks"] = [], []
    for _ in range(len(stored) + 1):
        kind = cursor.u8()
        out["acquire"].append(kind)
        if kind == Slot.LEASE:
            cursor.u64()
            out["blocks"].append(b"".join(arena[o : o + n] for o, n in cursor.ranges()).hex())
    cursor.done()
    sock.sendall(frame(Op.RESERVE, pack_keys([stored[0], absent]) + struct.pack("<QQ", 8, 8)))
    cursor = Cursor(reply())
    out["reserve"] = []
    for _ in range(2):
        kind = cursor.u8()
        out["reserve"].append(kind)
        if kind == Slot.RESERVED:
            cursor.u64()
            cursor.ranges()
    cursor.done()
    print(json.dumps(out))
    """
)


def test_the_previous_release_reads_this_ones_shared_memory_replies(
    previous_release: Path, server_factory: ServerFactory
) -> None:
    new = server_factory(env=release_env(REPO))
    keys, values = blocks_for(40_000, 2)
    absent, _ = blocks_for(45_000, 1)
    with grpc(new) as writer:
        assert writer.put(keys, values).stored == 2
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            OLD_FRAMES,
            shm_socket_of(new),
            NS.fingerprint().hex(),
            ",".join(key.hex() for key in keys),
            absent[0].hex(),
        ],
        env=release_env(previous_release),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert Path(seen["code"]).is_relative_to(previous_release)  # the old frame code, not ours
    assert seen["tiers"][0] == "dram" and seen["hits"] == 2
    assert seen["lookup"] == [0, 0, 255]  # dram, dram, absent
    assert seen["acquire"] == [1, 1, 0]  # LEASE, LEASE, MISS
    assert seen["blocks"] == [value.hex() for value in values]
    assert seen["reserve"] == [1, 2]  # PRESENT, RESERVED
