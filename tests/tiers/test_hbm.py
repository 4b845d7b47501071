"""The ``hbm`` tier: a page-allocated device pool.

Every test runs on a ``cpu`` tensor (the tier's code is device-independent but for the copies) and,
marked ``gpu``, on ``cuda`` where a CUDA device exists.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore.block import BlockHeader
from kvstore.config import load_config
from kvstore.tiers import build_tiers
from kvstore.tiers.dram import DramTier
from kvstore.tiers.hbm import COPIER_THREAD, HbmTier

PAGE = 4096
NS = b"n" * 16

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]


def key(n: int) -> bytes:
    return n.to_bytes(4, "little") * 4


def payload(n: int, length: int) -> bytes:
    return np.random.default_rng(n).integers(0, 256, size=length, dtype=np.uint8).tobytes()


def header(n: int, data: bytes) -> BlockHeader:
    return BlockHeader.for_payload(key(n), NS, data)


@pytest.mark.parametrize("device", DEVICES)
async def test_blocks_round_trip_through_the_device(device: str) -> None:
    tier = HbmTier(8 * PAGE, page_size=PAGE, device=device)
    blocks = {n: payload(n, length) for n, length in ((1, 10), (2, PAGE), (3, 2 * PAGE + 1))}
    for n, data in blocks.items():
        assert await tier.write(header(n, data), data)
    read = await tier.read([key(n) for n in blocks] + [key(9)])
    assert [None if r is None else bytes(r.payload) for r in read] == [*blocks.values(), None]
    assert read[0] is not None and read[0].header == header(1, blocks[1])
    stats = tier.stats()
    assert stats["blocks"] == 3 and stats["used"] == 5 * PAGE == tier.used  # 1 + 1 + 3 pages
    assert stats["payload_bytes"] == sum(map(len, blocks.values()))
    assert stats["wasted_bytes"] == stats["used"] - stats["payload_bytes"]
    await tier.close()


@pytest.mark.parametrize("device", DEVICES)
async def test_full_pool_refuses_and_changes_nothing(device: str) -> None:
    tier = HbmTier(2 * PAGE, page_size=PAGE, device=device)
    first = payload(1, 2 * PAGE)
    assert await tier.write(header(1, first), first)
    second = payload(2, 1)
    assert not await tier.write(header(2, second), second)
    assert [bytes(r.payload) for r in await tier.read([key(1)]) if r] == [first]
    # Replacing a block may reuse its own pages.
    again = payload(3, 2 * PAGE)
    assert await tier.write(BlockHeader.for_payload(key(1), NS, again), again)
    assert [bytes(r.payload) for r in await tier.read([key(1)]) if r] == [again]
    assert await tier.remove([key(1), key(7)])
    assert tier.used == 0 and tier.stats()["payload_bytes"] == 0
    assert await tier.write(header(2, second), second)


async def test_fragmented_pool_holds_a_block_in_several_runs() -> None:
    tier = HbmTier(6 * PAGE, page_size=PAGE, device="cpu")
    for n in range(6):
        data = payload(n, PAGE)
        assert await tier.write(header(n, data), data)
    await tier.remove([key(1), key(3), key(5)])
    big = payload(9, 3 * PAGE)
    assert await tier.write(header(9, big), big)  # three separate free pages
    assert [bytes(r.payload) for r in await tier.read([key(9)]) if r] == [big]
    await tier.close()


@pytest.mark.parametrize("device", DEVICES)
async def test_copies_run_on_the_copier_thread_not_the_event_loop(device: str) -> None:
    tier = HbmTier(8 * PAGE, page_size=PAGE, device=device)
    data = payload(1, 3 * PAGE)
    assert await tier.write(header(1, data), data)
    assert tier.copy_thread.startswith(COPIER_THREAD)
    tier.copy_thread = ""
    assert [bytes(r.payload) for r in await tier.read([key(1)]) if r] == [data]
    assert tier.copy_thread.startswith(COPIER_THREAD) and tier.copies == 2
    await tier.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
async def test_cuda_copies_use_the_tiers_stream_from_the_page_locked_arena() -> None:
    tier = HbmTier(8 * PAGE, page_size=PAGE, device="cuda")
    assert tier.stream is not None and tier.stream != torch.cuda.default_stream()
    arena = DramTier(4 * PAGE, page_size=PAGE, force_cuda_check=True)
    assert arena.pinned
    data = payload(2, 2 * PAGE)
    assert await arena.write(header(2, data), data)
    view = arena.view(key(2))
    assert view is not None and torch.frombuffer(view, dtype=torch.uint8).is_pinned()
    assert await tier.write(header(2, data), view)
    read = await tier.read([key(2)])
    assert read[0] is not None and bytes(read[0].payload) == data
    await tier.close()
    await arena.close()


async def test_length_mismatch_is_a_bug_not_a_write() -> None:
    tier = HbmTier(2 * PAGE, page_size=PAGE, device="cpu")
    with pytest.raises(ValueError, match="header says"):
        await tier.write(header(1, b"abc"), b"abcd")


def test_built_only_where_its_device_exists(caplog: pytest.LogCaptureFixture) -> None:
    config = load_config(env={"KVSTORE_HBM_CAPACITY": "1MiB", "KVSTORE_NVME_PATH": ""})
    names = [tier.name for tier in build_tiers(config)]
    if torch.cuda.is_available():
        assert names == ["hbm", "dram"]
    else:
        assert names == ["dram"]
        assert "no CUDA device" in caplog.text
    cpu = load_config(
        env={"KVSTORE_HBM_CAPACITY": "1MiB", "KVSTORE_HBM_DEVICE": "cpu", "KVSTORE_NVME_PATH": ""}
    )
    assert [tier.name for tier in build_tiers(cpu)] == ["hbm", "dram"]
