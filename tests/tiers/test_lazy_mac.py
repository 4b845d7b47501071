"""The keyed MAC is lazy and off the event loop; bytes changed since their put are never signed.

A block in memory carries only its xxh3-64 checksum (in the server's own memory); the MAC is
computed when a block is encoded for nvme or redis and checked when it is read back, in a worker
thread (nvme always, redis for batches over 64 KiB). Real LMDB and a real redis-server.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
from harness.redis_server import RedisServer

from kvstore.block import VERSION, BlockHeader, Buffer, Keyring
from kvstore.store import TieredStore
from kvstore.tiers.dram import DramTier
from kvstore.tiers.nvme import NvmeTier
from kvstore.tiers.redis import RedisTier

PAGE = 64 * 1024
NS = bytes(range(100, 116))
MIB = 1 << 20


def key(n: int) -> bytes:
    return n.to_bytes(2, "little") * 8


def payload(n: int, length: int = MIB) -> bytes:
    return np.random.default_rng(n).integers(0, 256, size=length, dtype=np.uint8).tobytes()


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
def mac_threads(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    """Names of the threads that signed and verified MACs during the test."""
    seen: dict[str, list[str]] = {"sign": [], "verify": []}
    sign, verify = Keyring.sign, Keyring.verify

    def spy_sign(
        self: Keyring, prefix: bytes, parts: Iterable[Buffer], version: int = VERSION
    ) -> bytes:
        seen["sign"].append(threading.current_thread().name)
        return sign(self, prefix, parts, version)

    def spy_verify(
        self: Keyring, prefix: bytes, parts: Sequence[Buffer], mac: bytes, version: int = VERSION
    ) -> bool:
        seen["verify"].append(threading.current_thread().name)
        return verify(self, prefix, parts, mac, version)

    monkeypatch.setattr(Keyring, "sign", spy_sign)
    monkeypatch.setattr(Keyring, "verify", spy_verify)
    return seen


async def test_dram_only_store_never_computes_a_mac(mac_threads: dict[str, list[str]]) -> None:
    store = TieredStore([DramTier(32 * MIB, page_size=PAGE, verify_reads=True)])
    try:
        keys, values = [key(n) for n in range(8)], [payload(n) for n in range(8)]
        await store.put(keys, values, NS)
        results = await store.get(keys, NS)
        assert [bytes(r.payload) for r in results if r.payload is not None] == values
    finally:
        await store.close()
    assert mac_threads == {"sign": [], "verify": []}


async def test_nvme_signs_and_verifies_in_its_worker_thread(
    tmp_path: Path, mac_threads: dict[str, list[str]]
) -> None:
    tier = NvmeTier(tmp_path / "nvme", 16 * MIB)
    try:
        data = payload(1)
        assert await tier.write(BlockHeader.for_payload(key(1), NS, data), data)
        [block] = await tier.read([key(1)])
        assert block is not None and bytes(block.payload) == data
        # The block read back carries the checksum a promotion to dram needs.
        assert block.header == BlockHeader.for_payload(key(1), NS, data)
    finally:
        await tier.close()
    main = threading.main_thread().name
    assert mac_threads["sign"] and main not in mac_threads["sign"]
    assert mac_threads["verify"] and main not in mac_threads["verify"]


async def test_redis_seals_and_verifies_large_batches_off_the_loop(
    redis_server: RedisServer, mac_threads: dict[str, list[str]]
) -> None:
    tier = RedisTier(redis_server.url, capacity=1 << 30, op_timeout_s=2.0)
    # A ring of its own: the process's ring remembers the seals of blocks earlier tests signed.
    tier.keyring = Keyring([b"lazy mac test"])
    try:
        items = [(BlockHeader.for_payload(key(n), NS, payload(n)), payload(n)) for n in range(2)]
        assert await tier.write_many(items) == [True, True]
        blocks = await tier.read([key(0), key(1)])
        assert [bytes(b.payload) for b in blocks if b is not None] == [payload(0), payload(1)]
    finally:
        await tier.close()
    main = threading.main_thread().name
    assert len(mac_threads["sign"]) == 2 and main not in mac_threads["sign"]
    assert len(mac_threads["verify"]) == 2 and main not in mac_threads["verify"]


async def test_nvme_refuses_to_sign_a_payload_changed_since_its_put(tmp_path: Path) -> None:
    tier = NvmeTier(tmp_path / "nvme", 16 * MIB)
    try:
        data = payload(2)
        header = BlockHeader.for_payload(key(2), NS, data)
        changed = bytearray(data)
        changed[1234] ^= 0x01
        assert not await tier.write(header, changed)
        assert tier.stats()["corrupt_blocks"] == 1
        assert await tier.read([key(2)]) == [None]
    finally:
        await tier.close()


async def test_redis_refuses_to_sign_a_payload_changed_since_its_put(
    redis_server: RedisServer,
) -> None:
    redis_server.client().flushall()
    tier = RedisTier(redis_server.url, capacity=1 << 30, op_timeout_s=2.0)
    try:
        good, bad = payload(3, 1000), bytearray(payload(4, 1000))
        header_bad = BlockHeader.for_payload(key(4), NS, bytes(bad))
        bad[0] ^= 0x80
        items = [(BlockHeader.for_payload(key(3), NS, good), good), (header_bad, bad)]
        assert await tier.write_many(items) == [True, False]
        assert tier.stats()["corrupt_blocks"] == 1
        assert redis_server.client().exists(tier._name(key(4))) == 0
        [stored, refused] = await tier.read([key(3), key(4)])
        assert stored is not None and bytes(stored.payload) == good and refused is None
    finally:
        await tier.close()


async def test_block_changed_in_the_arena_is_not_demoted_to_nvme(tmp_path: Path) -> None:
    dram = DramTier(2 * MIB, page_size=PAGE)
    nvme = NvmeTier(tmp_path / "nvme", 64 * MIB)
    store = TieredStore([dram, nvme])
    try:
        await store.put([key(1)], [payload(1)], NS)
        offset, _ = dram.extents(key(1))[0]
        dram.range_view(offset + 10, 1)[0] ^= 0xFF  # a client writing the shared arena
        await store.put([key(2), key(3)], [payload(2), payload(3)], NS)  # evicts key(1)
        await store.drain()
        assert key(1) not in nvme  # refused, not signed
        assert nvme.stats()["corrupt_blocks"] == 1
        [result] = await store.get([key(1)], NS)
        assert result.payload is None
    finally:
        await store.close()
