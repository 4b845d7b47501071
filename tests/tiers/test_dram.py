"""Tests of :class:`kvstore.tiers.dram.DramTier`, the page-allocated memfd arena.

Payloads of every accepted buffer type come back byte-identical, including blocks split over
several page runs; the arena never holds more than its capacity; rounding waste is reported; and
the pages live in the memfd that co-located clients will map.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator

import numpy as np
import pytest
import torch

from kvstore.block import BlockHeader
from kvstore.buffers import byte_view
from kvstore.tiers.dram import DramTier

PAGE = 4096
NS = bytes(range(100, 116))


def key(n: int) -> bytes:
    return n.to_bytes(2, "little") * 8


def payload(n: int, length: int) -> bytes:
    rng = np.random.default_rng(n)
    return rng.integers(0, 256, size=length, dtype=np.uint8).tobytes()


def header(k: bytes, value: object) -> BlockHeader:
    return BlockHeader.for_payload(k, NS, byte_view(value))


async def put(tier: DramTier, k: bytes, value: object) -> bool:
    return await tier.write(header(k, value), byte_view(value))


async def read_bytes(tier: DramTier, k: bytes) -> bytes | None:
    block = (await tier.read([k]))[0]
    return None if block is None else bytes(block.payload)


@pytest.fixture
async def tier() -> AsyncIterator[DramTier]:
    dram = DramTier(8 * PAGE, page_size=PAGE)
    yield dram
    await dram.close()


# --- round trips ------------------------------------------------------------------------------


async def test_bytes_round_trip(tier: DramTier) -> None:
    data = payload(1, 5000)
    assert await put(tier, key(1), data)
    block = (await tier.read([key(1)]))[0]
    assert block is not None
    assert bytes(block.payload) == data
    assert block.header == header(key(1), data)
    assert tier.header(key(1)) == block.header
    assert key(1) in tier


async def test_bytearray_and_memoryview_round_trip(tier: DramTier) -> None:
    data = bytearray(payload(2, 3000))
    assert await put(tier, key(2), data)
    assert await put(tier, key(3), memoryview(bytes(data)))
    assert await read_bytes(tier, key(2)) == bytes(data)
    assert await read_bytes(tier, key(3)) == bytes(data)


async def test_numpy_round_trip(tier: DramTier) -> None:
    array = np.random.default_rng(3).standard_normal((7, 33)).astype(np.float32)
    assert await put(tier, key(4), array)
    raw = await read_bytes(tier, key(4))
    assert raw is not None
    back = np.frombuffer(raw, dtype=np.float32).reshape(7, 33)
    np.testing.assert_array_equal(back, array)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8])
async def test_torch_cpu_tensor_round_trip(tier: DramTier, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(4)
    tensor = (torch.randn(2, 3, 129, generator=generator) * 50).to(dtype)
    assert await put(tier, key(5), tensor)
    raw = await read_bytes(tier, key(5))
    assert raw is not None
    assert len(raw) == tensor.numel() * tensor.element_size()
    back = torch.frombuffer(bytearray(raw), dtype=dtype).reshape(tensor.shape)
    # Bitwise equality: compare the raw bits, so NaN patterns and -0.0 count too.
    assert torch.equal(back.view(torch.uint8), tensor.view(torch.uint8))
    assert torch.equal(back, tensor)


async def test_batch_read_mixes_hits_and_misses(tier: DramTier) -> None:
    a, b = payload(6, 100), payload(7, PAGE + 1)
    assert await put(tier, key(6), a)
    assert await put(tier, key(7), b)
    blocks = await tier.read([key(7), key(99), key(6)])
    assert blocks[1] is None
    assert blocks[0] is not None and bytes(blocks[0].payload) == b
    assert blocks[2] is not None and bytes(blocks[2].payload) == a


async def test_payload_length_must_match_header(tier: DramTier) -> None:
    data = payload(8, 100)
    with pytest.raises(ValueError, match="header says"):
        await tier.write(header(key(8), data), data + b"x")
    assert key(8) not in tier
    assert tier.used == 0


# --- capacity and waste -----------------------------------------------------------------------


def test_capacity_is_rounded_down_to_whole_pages() -> None:
    dram = DramTier(10_000, page_size=PAGE)
    assert dram.capacity == 2 * PAGE
    assert dram.stats()["capacity"] == 2 * PAGE
    assert os.fstat(dram.fd).st_size == 2 * PAGE


async def test_zero_capacity_tier_refuses_every_write() -> None:
    dram = DramTier(100, page_size=PAGE)
    assert dram.capacity == 0
    assert dram.fd == -1
    assert not await put(dram, key(1), b"x")
    assert dram.used == 0
    await dram.close()


def test_bad_page_size_is_refused() -> None:
    with pytest.raises(ValueError, match="page_size"):
        DramTier(PAGE, page_size=0)


async def test_footprint_is_whole_pages(tier: DramTier) -> None:
    assert tier.footprint(1) == PAGE
    assert tier.footprint(PAGE) == PAGE
    assert tier.footprint(PAGE + 1) == 2 * PAGE
    assert tier.footprint(3 * PAGE) == 3 * PAGE


async def test_capacity_is_never_exceeded_and_full_write_returns_false(tier: DramTier) -> None:
    lengths = [PAGE + 1, 2 * PAGE, 17, 3 * PAGE - 5, PAGE, 2 * PAGE]
    stored: dict[bytes, bytes] = {}
    refused = 0
    for n, length in enumerate(lengths):
        data = payload(n, length)
        used_before = tier.used
        ok = await put(tier, key(n), data)
        assert tier.used <= tier.capacity
        if ok:
            stored[key(n)] = data
            assert tier.used == used_before + tier.footprint(length)
        else:
            refused += 1
            assert tier.used == used_before, "a refused write must change nothing"
            assert key(n) not in tier
            assert tier.capacity - tier.used < tier.footprint(length)
    assert refused >= 1
    for k, data in stored.items():
        assert await read_bytes(tier, k) == data
    assert tier.stats()["blocks"] == len(stored)


async def test_wasted_bytes_is_pages_minus_payload(tier: DramTier) -> None:
    assert await put(tier, key(1), payload(1, 5000))  # 2 pages, 3192 wasted
    stats = tier.stats()
    assert stats["used"] == 2 * PAGE
    assert stats["payload_bytes"] == 5000
    assert stats["wasted_bytes"] == 2 * PAGE - 5000
    assert await put(tier, key(2), payload(2, PAGE))  # exact fit, no extra waste
    assert tier.stats()["wasted_bytes"] == 2 * PAGE - 5000
    assert await put(tier, key(3), payload(3, 1))  # one byte in a whole page
    stats = tier.stats()
    assert stats["used"] == 4 * PAGE
    assert stats["payload_bytes"] == 5000 + PAGE + 1
    assert stats["wasted_bytes"] == stats["used"] - stats["payload_bytes"]
    assert stats["wasted_bytes"] == (2 * PAGE - 5000) + (PAGE - 1)
    await tier.remove([key(1)])
    assert tier.stats()["wasted_bytes"] == PAGE - 1


# --- fragmentation -------------------------------------------------------------------------------


async def fragment(tier: DramTier) -> dict[bytes, bytes]:
    """Fill all 8 pages with one-page blocks, then free every other one; returns the survivors."""
    blocks = {key(n): payload(n, PAGE - n) for n in range(8)}
    for k, data in blocks.items():
        assert await put(tier, k, data)
    freed = [key(n) for n in range(0, 8, 2)]
    await tier.remove(freed)
    assert tier.stats()["free_runs"] == 4
    return {k: v for k, v in blocks.items() if k not in freed}


async def test_fragmented_block_reads_back_intact(tier: DramTier) -> None:
    survivors = await fragment(tier)
    big = payload(50, 3 * PAGE + 11)  # needs 4 pages; only 4 single free pages exist
    assert await put(tier, key(50), big)
    ranges = tier.extents(key(50))
    assert len(ranges) == 4, "expected a block split over several page runs"
    assert sum(size for _, size in ranges) == len(big)
    assert await read_bytes(tier, key(50)) == big
    for k, data in survivors.items():
        assert await read_bytes(tier, k) == data
    assert tier.used == tier.capacity


async def test_fragmented_block_in_memfd_matches_payload(tier: DramTier) -> None:
    await fragment(tier)
    big = payload(51, 4 * PAGE)
    assert await put(tier, key(51), big)
    pieces = [os.pread(tier.fd, size, offset) for offset, size in tier.extents(key(51))]
    assert b"".join(pieces) == big


async def test_view_is_zero_copy_for_a_single_run(tier: DramTier) -> None:
    data = payload(9, 2 * PAGE + 3)
    assert await put(tier, key(9), data)
    view = tier.view(key(9))
    assert view is not None
    assert len(view) == len(data)
    assert bytes(view) == data
    # The view is the arena itself: the memfd holds the same bytes at the block's offset.
    [(offset, size)] = tier.extents(key(9))
    assert os.pread(tier.fd, size, offset) == data
    assert tier.view(key(99)) is None
    del view


async def test_view_is_none_for_a_fragmented_block(tier: DramTier) -> None:
    await fragment(tier)
    assert await put(tier, key(52), payload(52, 2 * PAGE))
    assert len(tier.extents(key(52))) == 2
    assert tier.view(key(52)) is None


async def test_copy_into_single_and_fragmented_blocks(tier: DramTier) -> None:
    await fragment(tier)
    big = payload(53, 3 * PAGE + 100)
    assert await put(tier, key(53), big)
    target = bytearray(len(big))
    assert tier.copy_into(key(53), memoryview(target))
    assert bytes(target) == big
    small = payload(3, PAGE - 3)
    target = bytearray(len(small))
    assert tier.copy_into(key(3), memoryview(target))
    assert bytes(target) == small


async def test_copy_into_a_torch_tensor(tier: DramTier) -> None:
    tensor = torch.arange(1000, dtype=torch.bfloat16)
    assert await put(tier, key(10), tensor)
    destination = torch.zeros(1000, dtype=torch.bfloat16)
    assert tier.copy_into(key(10), byte_view(destination))
    assert torch.equal(destination, tensor)


async def test_copy_into_refuses_wrong_size_or_absent_key(tier: DramTier) -> None:
    data = payload(11, 500)
    assert await put(tier, key(11), data)
    too_small = bytearray(499)
    assert not tier.copy_into(key(11), memoryview(too_small))
    assert too_small == bytearray(499)
    assert not tier.copy_into(key(11), memoryview(bytearray(501)))
    assert not tier.copy_into(key(12), memoryview(bytearray(500)))


# --- remove and replace ----------------------------------------------------------------------


async def test_remove_frees_pages(tier: DramTier) -> None:
    assert await put(tier, key(1), payload(1, 3 * PAGE))
    assert await put(tier, key(2), payload(2, 5 * PAGE))
    assert tier.used == tier.capacity
    assert not await put(tier, key(3), payload(3, 1))
    await tier.remove([key(1), key(404)])  # absent keys are ignored
    assert key(1) not in tier
    assert await read_bytes(tier, key(1)) is None
    assert tier.used == 5 * PAGE
    assert tier.stats()["blocks"] == 1
    assert tier.stats()["payload_bytes"] == 5 * PAGE
    assert await put(tier, key(3), payload(3, 3 * PAGE))
    assert await read_bytes(tier, key(2)) == payload(2, 5 * PAGE)
    await tier.remove([key(2), key(3)])
    assert tier.used == 0
    assert tier.stats()["free_runs"] == 1
    assert tier.stats()["wasted_bytes"] == 0


async def test_replacing_a_key_keeps_only_the_new_block(tier: DramTier) -> None:
    old, new = payload(1, 2 * PAGE), payload(2, PAGE + 7)
    assert await put(tier, key(1), old)
    assert await put(tier, key(1), new)
    assert await read_bytes(tier, key(1)) == new
    assert tier.header(key(1)) == header(key(1), new)
    stats = tier.stats()
    assert (stats["blocks"], stats["used"], stats["payload_bytes"]) == (1, 2 * PAGE, PAGE + 7)


async def test_replacing_a_key_may_reuse_its_own_pages(tier: DramTier) -> None:
    assert await put(tier, key(1), payload(1, 4 * PAGE))
    assert await put(tier, key(2), payload(2, 4 * PAGE))
    # Full; the replacement fits only in the pages the old block frees.
    bigger = payload(3, 4 * PAGE)
    assert await put(tier, key(1), bigger)
    assert await read_bytes(tier, key(1)) == bigger
    assert await read_bytes(tier, key(2)) == payload(2, 4 * PAGE)


async def test_refused_replacement_keeps_the_old_block(tier: DramTier) -> None:
    old = payload(1, 2 * PAGE)
    assert await put(tier, key(1), old)
    assert await put(tier, key(2), payload(2, 6 * PAGE))
    assert not await put(tier, key(1), payload(3, 3 * PAGE))
    assert await read_bytes(tier, key(1)) == old


async def test_scan_lists_resident_headers(tier: DramTier) -> None:
    assert list(tier.scan()) == []
    assert await put(tier, key(1), b"abc")
    assert [h.key for h in tier.scan()] == [key(1)]


async def test_close_releases_the_memfd() -> None:
    dram = DramTier(2 * PAGE, page_size=PAGE)
    assert await put(dram, key(1), b"abc")
    assert dram.fd >= 0
    await dram.close()
    assert dram.fd == -1
    assert key(1) not in dram


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_arena_is_page_locked_where_cuda_exists() -> None:
    """On a GPU host the arena is registered with CUDA: a device copy from it is a DMA."""
    tier = DramTier(4 * 1024**2, page_size=64 * 1024)
    assert tier.pinned and tier.stats()["pinned"] == 1
    header = BlockHeader.for_payload(b"k" * 16, b"n" * 16, b"x" * 100_000)
    assert tier.write_sync(header, b"x" * 100_000)
    view = tier.view(b"k" * 16)
    assert view is not None
    host = torch.frombuffer(view, dtype=torch.uint8)
    device = host.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert bytes(device.cpu().numpy()) == b"x" * 100_000
    asyncio.run(tier.close())
    assert not tier.pinned


def test_arena_is_page_locked_exactly_where_cuda_exists() -> None:
    tier = DramTier(1024**2, page_size=64 * 1024)
    assert tier.pinned == torch.cuda.is_available()
    assert tier.stats()["pinned"] == int(torch.cuda.is_available())


def test_forced_cuda_check_asks_torch_even_without_the_driver_file() -> None:
    """``dram.force_cuda_check``: the answer is torch's, whether /dev/nvidiactl exists or not."""
    tier = DramTier(1024**2, page_size=64 * 1024, force_cuda_check=True)
    assert tier.pinned == torch.cuda.is_available()
    asyncio.run(tier.close())


class _FakeCudart:
    """Stands in for ``torch.cuda.cudart()`` where no GPU exists (a mock: CUDA cannot run here)."""

    def __init__(self, error: int) -> None:
        self.error = error
        self.calls: list[tuple[int, int, str]] = []

    def cudaHostRegister(self, address: int, size: int, flags: int) -> int:
        self.calls.append((size, flags, threading.current_thread().name))
        return self.error

    def cudaHostUnregister(self, address: int) -> int:
        return 0


@pytest.mark.parametrize("error", [0, 2])
def test_page_locking_asks_for_every_context_and_keeps_a_failure_off_the_caller_s_thread(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, error: int
) -> None:
    """Portable registration, so an hbm tier on another device DMAs from the arena too; the
    call runs on a thread of its own, because a failed one leaves CUDA's per-thread last error
    set, which torch's next kernel launch on that thread would report as its own."""
    fake = _FakeCudart(error)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    tier = DramTier(1024**2, page_size=64 * 1024, force_cuda_check=True)
    assert fake.calls == [(1024**2, 1, "kvstore-page-lock")]
    assert tier.pinned is (error == 0)
    if error:
        assert "cudaHostRegister of the dram arena failed with CUDA error 2" in caplog.text
    asyncio.run(tier.close())
