"""The N-1 promise (:mod:`kvstore.formats`): data in a version newer than this release reads is a
miss left where it is, never deleted and never taken for forged; damaged data in a version it
reads is still corrupt and deleted.

Real media: a real redis-server (the shared tier), a real LMDB directory (the nvme tier), and the
cluster index in Redis.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Iterator
from pathlib import Path

import lmdb
import pytest
from harness.redis_server import RedisServer
from redis.asyncio import Redis

from kvstore.block import BlockHeader, CorruptBlockError, Keyring, decode_value, encode_header
from kvstore.cluster.index import ClusterIndex
from kvstore.cluster.layout import Layout
from kvstore.cluster.records import NodeInfo, RecordError, reads_now, record_keyring
from kvstore.formats import BLOCK, RECORD, NewerFormatError
from kvstore.node.peer_blocks import SealedBlock, sealed_newer, verify_blocks
from kvstore.tiers.nvme import NvmeTier
from kvstore.tiers.redis import RedisTier

NS = bytes(range(100, 116))
PAYLOAD = bytes((i * 31 + 5) % 256 for i in range(20_000))
SECRET = b"formats secret"


def key(n: int) -> bytes:
    return n.to_bytes(2, "little") * 8


def relabel(value: bytes, version: int) -> bytes:
    """``value`` with its header's version field set to ``version`` (MAC left as it was)."""
    raw = bytearray(value)
    struct.pack_into("<H", raw, 4, version)
    return bytes(raw)


def stored(n: int, ring: Keyring, version: int | None = None) -> bytes:
    value = encode_header(key(n), NS, PAYLOAD, ring) + PAYLOAD
    return value if version is None else relabel(value, version)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path / "redis") as running:
        yield running


def test_a_later_header_version_is_newer_not_corrupt() -> None:
    ring = Keyring([SECRET])
    with pytest.raises(NewerFormatError, match="version 4 is newer"):
        decode_value(key(1), stored(1, ring, version=4), ring)
    # Older than every version read, or another magic: corrupt as before.
    for version in (0, 1):
        with pytest.raises(CorruptBlockError):
            decode_value(key(1), stored(1, ring, version=version), ring)
    with pytest.raises(CorruptBlockError):
        decode_value(key(1), b"XXXX" + stored(1, ring)[4:], ring)
    assert BLOCK.is_newer(4) and not BLOCK.is_newer(3)


def test_a_peer_block_sealed_by_a_later_release_is_refused_but_not_forged() -> None:
    ring = Keyring([SECRET])
    header = encode_header(key(1), NS, PAYLOAD, ring)
    newer = SealedBlock(relabel(header, 7), PAYLOAD)
    forged = SealedBlock(encode_header(key(1), NS, PAYLOAD, Keyring([b"rogue"])), PAYLOAD)
    assert verify_blocks([key(1)] * 2, NS, [newer, forged], ring, 1 << 20) == [False, False]
    assert sealed_newer(newer.header)
    assert not sealed_newer(forged.header)
    assert not sealed_newer(b"")


async def test_redis_keeps_a_newer_block_and_still_deletes_a_forged_one(
    server: RedisServer,
) -> None:
    ring = Keyring([SECRET])
    tier = RedisTier(server.url, capacity=1 << 30)
    tier.keyring = ring
    direct = Redis.from_url(server.url)
    try:
        await direct.set(b"kvstore:v1:" + key(1).hex().encode(), stored(1, ring, version=9))
        await direct.set(b"kvstore:v1:" + key(2).hex().encode(), stored(2, Keyring([b"rogue"])))
        await direct.set(b"kvstore:v1:" + key(3).hex().encode(), stored(3, ring))
        before = await direct.dbsize()
        blocks = await tier.read([key(1), key(2), key(3)])
        assert blocks[0] is None and blocks[1] is None
        assert blocks[2] is not None and bytes(blocks[2].payload) == PAYLOAD
        assert tier.stats()["newer_format_blocks"] == 1
        assert tier.stats()["corrupt_blocks"] == 1
        # The forged one is gone, the later release's one is exactly where it was.
        assert await direct.dbsize() == before - 1
        assert await direct.get(b"kvstore:v1:" + key(1).hex().encode()) == stored(
            1, ring, version=9
        )
        # Read again: still a miss, still there.
        assert (await tier.read([key(1)]))[0] is None
        assert await direct.exists(b"kvstore:v1:" + key(1).hex().encode()) == 1
    finally:
        await tier.close()
        await direct.aclose()


async def test_nvme_leaves_a_newer_block_on_disk_through_scan_and_read(tmp_path: Path) -> None:
    ring = Keyring([SECRET])
    path = tmp_path / "nvme"
    tier = NvmeTier(path, 64 << 20)
    tier.keyring = ring
    assert await tier.write(BlockHeader.for_payload(key(3), NS, PAYLOAD), PAYLOAD)
    await tier.close()
    with lmdb.open(str(path), map_size=64 << 20) as env, env.begin(write=True) as txn:
        txn.put(key(1), stored(1, ring, version=4))  # a later release's block
        txn.put(key(2), b"KVB1" + b"\x00" * 10)  # a broken one
    tier = NvmeTier(path, 64 << 20)
    tier.keyring = ring
    try:
        indexed = {header.key for header in tier.scan()}
        assert indexed == {key(3)}
        assert tier.stats()["newer_format_blocks"] == 1
        assert tier.stats()["corrupt_blocks"] == 1
        # Asked for anyway (another node's index says so): a miss, not a deletion.
        got = await tier.read([key(1), key(3)])
        assert got[0] is None and got[1] is not None
        assert tier.stats()["newer_format_blocks"] == 2
    finally:
        await tier.close()
    with lmdb.open(str(path), map_size=64 << 20) as env, env.begin() as txn:
        assert txn.get(key(1)) == stored(1, ring, version=4)
        assert txn.get(key(2)) is None


# --- node descriptions ----------------------------------------------------------------------------


def info(version: int) -> NodeInfo:
    return NodeInfo(
        "n1", 3, "127.0.0.1:1", "", {"dram": 1}, keys=("k",), version=version, formats=reads_now()
    )


def raw(fields: dict[str, str]) -> dict[bytes, bytes]:
    return {k.encode(): v.encode() for k, v in fields.items()}


def test_descriptions_of_every_version_read_verify() -> None:
    ring = record_keyring(Keyring([SECRET]))
    expires = int((time.time() + 60) * 1000)
    for version in RECORD.reads:
        described = info(version)
        if version == 1:
            described = NodeInfo("n1", 3, "127.0.0.1:1", "", {"dram": 1}, keys=None)
        got = NodeInfo.verified("n1", raw(described.signed(ring, expires)), ring)
        assert got.version == version
        assert got.formats == (reads_now() if version >= 3 else {})
    # What the default writes is what the previous release reads (v2: no v field).
    assert RECORD.writes("previous") == 2 and "v" not in info(2).fields()


def test_a_later_description_is_newer_and_a_relabelled_one_refused() -> None:
    ring = record_keyring(Keyring([SECRET]))
    expires = int((time.time() + 60) * 1000)
    signed = info(3).signed(ring, expires)
    with pytest.raises(NewerFormatError, match="node description version 4"):
        NodeInfo.verified("n1", raw({**signed, "v": "4"}), ring)
    # A v3 description passed off as v2 (its version dropped), or its formats changed: forged.
    stripped = {k: v for k, v in signed.items() if k not in ("v", "formats")}
    with pytest.raises(RecordError, match="MAC"):
        NodeInfo.verified("n1", raw(stripped), ring)
    with pytest.raises(RecordError, match="MAC"):
        NodeInfo.verified("n1", raw({**signed, "formats": '{"block": [2]}'}), ring)


async def test_the_index_reads_around_a_later_node_without_calling_it_refused(
    server: RedisServer,
) -> None:
    keyring = Keyring([SECRET])
    ring = record_keyring(keyring)
    client = Redis.from_url(server.url)
    layout = Layout("kvstore:cluster:v1:")
    expires = int((time.time() + 60) * 1000)
    try:
        for node, fields in (
            ("old", NodeInfo("old", 1, "h:1", keys=()).signed(ring, expires)),
            ("new", {**info(3).signed(ring, expires), "v": "5"}),
        ):
            await client.hset(layout.node(node), mapping=fields)  # type: ignore[arg-type]
            await client.sadd(layout.nodes, node)
            await client.set(layout.lease(node), fields["epoch"])
        # A later entry version appends fields after the tier: the tier still counts.
        await client.hset(layout.entry(key(1)), "old", "1:dram;v=2;x=y")
        index = ClusterIndex(client, layout, keyring)
        nodes = await index.nodes()
        assert set(nodes) == {"old"}
        assert index.newer == {"new": 3}  # by epoch, as refusals are
        assert index.refused == {} and index.refused_count == 0
        holders = await index.holders([key(1)])
        assert holders["old"].tiers == ["dram"]
        assert await client.exists(layout.node("new")) == 1
    finally:
        await client.aclose()
