"""Keyed block integrity against real servers, a real redis-server and real LMDB files.

Anyone able to write to the shared Redis (or to another user's LMDB file) can put bytes under a
block's key, with a well-formed header: an old-format header whose plain checksum they recompute,
or a new one with a MAC under a secret of their own. No node may ever serve those bytes: each is a
miss, counted in the tier's ``corrupt_blocks`` and deleted. Secrets rotate (an old secret still
verifies while it is listed), a block found under another namespace is a miss, the files the
server creates are private, and the automatic shm socket lives in a fresh private directory.
"""

from __future__ import annotations

import os
import stat
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from harness.block_forgery import rewrite_payload

from kvstore import ChunkHasher, KVStoreClient, Namespace

if TYPE_CHECKING:
    from harness.server_factory import ServerFactory

from harness.redis_server import RedisServer

NS = Namespace(model="integrity", num_layers=2, num_kv_heads=2, head_size=64)
OTHER_NS = Namespace(model="integrity-other", num_layers=2, num_kv_heads=2, head_size=64)
HASHER = ChunkHasher(chunk_size=16, namespace=NS)
BLOCK_BYTES = 64 * 1024
PREFIX = "kvstore:v1:"  # redis.key_prefix's default


def blocks(seed: int, count: int) -> tuple[list[bytes], list[bytes]]:
    keys = HASHER.keys(list(range(seed * 1000, seed * 1000 + 16 * count)))
    rng = np.random.default_rng(seed)
    return keys, [rng.integers(0, 256, BLOCK_BYTES, dtype=np.uint8).tobytes() for _ in keys]


def secret(value: str) -> dict[str, str]:
    return {"KVSTORE_INTEGRITY_SECRETS": value}


def tier_stats(client: KVStoreClient, tier: str) -> dict[str, Any]:
    return dict(client.stats()["tiers"][tier])


def test_blocks_forged_in_redis_are_never_served(
    server_factory: ServerFactory, tmp_path: Path
) -> None:
    with RedisServer(tmp_path / "redis") as redis_server:
        flags = ("--redis-url", redis_server.url)
        writer = server_factory(*flags, env=secret("cluster"))
        reader = server_factory(*flags, env=secret("cluster"))
        keys, values = blocks(1, 5)
        with writer.client(NS) as client:
            assert client.put(keys, values).stored == 5
        raw = redis_server.client()
        names = [PREFIX + key.hex() for key in keys]
        deadline = time.monotonic() + 5.0
        while None in (stored := raw.mget(names)):  # the write-through is asynchronous
            assert time.monotonic() < deadline, "write-through to redis not within 5 s"
            time.sleep(0.05)
        # Someone with write access to Redis rewrites two blocks with other bytes and a header
        # that is well-formed: the old format with its plain checksum recomputed, and the new
        # format with a MAC under their own secret.
        raw.set(names[1], rewrite_payload(stored[1], "v1"))
        raw.set(names[2], rewrite_payload(stored[2], "mac"))

        with reader.client(NS) as client:
            got = client.get(keys[:3])
            assert got == [values[0], None, None], "a forged block was served"
            assert tier_stats(client, "redis")["corrupt_blocks"] == 2
            assert raw.exists(names[1], names[2]) == 0  # deleted, as rotted blocks are
            # A genuine block read under another namespace is a miss too, and stays stored.
            with reader.client(OTHER_NS) as other:
                before = other.stats()["counters"].get("namespace_mismatches", 0)
                assert other.get(keys[3:4]) == [None]
                assert other.stats()["counters"]["namespace_mismatches"] == before + 1
            assert client.get(keys[3:]) == values[3:]
            assert tier_stats(client, "redis")["corrupt_blocks"] == 2
        raw.close()


def test_secret_rotation_and_a_node_without_the_secret(
    server_factory: ServerFactory, tmp_path: Path
) -> None:
    with RedisServer(tmp_path / "redis") as redis_server:
        flags = ("--redis-url", redis_server.url)
        old = server_factory(*flags, env=secret("old"))
        rotated = server_factory(*flags, env=secret("new,old"))
        keys, values = blocks(2, 4)
        with old.client(NS) as client:
            assert client.put(keys, values).stored == 4
        redis_server.wait_for_blocks(keys)
        with rotated.client(NS) as client:  # old secret still listed: verifies
            assert client.get(keys[:2]) == values[:2]
            assert tier_stats(client, "redis")["corrupt_blocks"] == 0
            # New blocks are signed with the first secret ("new").
            fresh_keys, fresh = blocks(3, 1)
            assert client.put(fresh_keys, fresh).stored == 1
        redis_server.wait_for_blocks(fresh_keys)
        # The last step of the rotation: the node that knew only "old" has gone (a node still
        # there that shares no secret would keep this one off the shared tier at start:
        # test_keyring_check), and a node that dropped the old secret reads its blocks as misses.
        old.stop()
        dropped = server_factory(*flags, env=secret("new"))
        with dropped.client(NS) as client:  # old secret dropped: a miss, never the bytes
            assert client.get(keys[2:]) == [None, None]
            assert tier_stats(client, "redis")["corrupt_blocks"] == 2
            assert client.get(fresh_keys) == fresh


def test_server_files_are_private_and_namespace_is_checked_on_nvme(
    server_factory: ServerFactory,
) -> None:
    server = server_factory(dram_capacity="0")
    keys, values = blocks(4, 3)
    with server.client(NS) as client:
        assert client.put(keys, values).stored == 3
    path = server.nvme_path
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    for name in ("data.mdb", "lock.mdb", "integrity.key"):
        assert stat.S_IMODE((path / name).stat().st_mode) == 0o600, name
    key_file = (path / "integrity.key").read_bytes()
    server.restart()
    assert (path / "integrity.key").read_bytes() == key_file  # generated once, kept
    with server.client(OTHER_NS) as other:
        assert other.get(keys) == [None] * 3
    with server.client(NS) as client:
        assert client.get(keys) == values  # warm restart: same secret, blocks verify
        assert tier_stats(client, "nvme")["corrupt_blocks"] == 0


def test_auto_shm_socket_is_in_a_fresh_private_directory(
    server_factory: ServerFactory, tmp_path: Path
) -> None:
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    started = time.time()
    server = server_factory(env={"XDG_RUNTIME_DIR": str(runtime)}, dram_capacity="4MiB")
    assert server.proc is not None
    # Not the old predictable name (one there now is stale, left by a killed server of old).
    old_path = Path(tempfile.gettempdir()) / f"kvstore-{server.proc.pid}.sock"
    assert not old_path.exists() or old_path.stat().st_mtime < started - 1
    (directory,) = list(runtime.iterdir())
    assert directory.name.startswith("kvstore-") and directory.name != "kvstore-"
    # Group may reach the socket (mode 0660) but not list the directory; others nothing.
    assert stat.S_IMODE(directory.stat().st_mode) == 0o710
    socket = directory / "shm.sock"
    assert stat.S_ISSOCK(socket.stat().st_mode)
    assert stat.S_IMODE(socket.stat().st_mode) == 0o660
    keys, values = blocks(5, 2)
    with KVStoreClient(server.target, namespace=NS, data_plane="shm") as client:
        assert client.put(keys, values).stored == 2
        assert client.get(keys) == values
        assert client.data_plane == "shm"
    server.stop()
    assert list(runtime.iterdir()) == [], "socket directory left behind"
    assert not os.path.exists(socket)
