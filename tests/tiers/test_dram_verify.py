"""``dram.verify_reads``: with it, every server-side read of the arena checks the block's MAC.

The arena's pages are shared with co-located clients (writable for reservations), so bytes can
change under a resident block. With ``verify_reads`` such a block is dropped, counted in
``corrupt_blocks`` and is a miss on every server path (copy, copy into a buffer, zero-copy view,
lease); without it (the default, DRAM trusted) the changed bytes are served, as documented.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import numpy as np
import pytest

from kvstore.block import BlockHeader
from kvstore.tiers.dram import DramTier

PAGE = 4096
NS = bytes(range(100, 116))


def key(n: int) -> bytes:
    return n.to_bytes(2, "little") * 8


def payload(n: int, length: int) -> bytes:
    return np.random.default_rng(n).integers(0, 256, size=length, dtype=np.uint8).tobytes()


@pytest.fixture(params=[True, False], ids=["verify", "trust"])
async def tier(request: pytest.FixtureRequest) -> AsyncIterator[DramTier]:
    dram = DramTier(16 * PAGE, page_size=PAGE, verify_reads=request.param)
    yield dram
    await dram.close()


async def store(tier: DramTier, k: bytes, data: bytes) -> None:
    assert await tier.write(BlockHeader.for_payload(k, NS, data), memoryview(data))


def tamper(tier: DramTier, k: bytes, at: int) -> None:
    """Flip one byte of ``k``'s payload, at payload offset ``at``, in the arena itself."""
    for offset, size in tier.extents(k):
        if at < size:
            tier.range_view(offset + at, 1)[0] ^= 0xFF
            return
        at -= size


@pytest.mark.parametrize("length", [5000, 3 * PAGE + 7])
async def test_intact_blocks_read_on_every_path(tier: DramTier, length: int) -> None:
    data = payload(1, length)
    await store(tier, key(1), data)
    block = tier.read_sync(key(1))
    assert block is not None and bytes(block.payload) == data
    out = bytearray(length)
    assert tier.copy_into(key(1), memoryview(out)) and bytes(out) == data
    lease = tier.lease(key(1))
    assert lease is not None
    tier.release(lease)
    assert tier.stats()["corrupt_blocks"] == 0


@pytest.mark.parametrize("path", ["read", "copy_into", "view", "lease"])
async def test_changed_arena_bytes_are_never_served_when_verifying(
    tier: DramTier, path: str
) -> None:
    data, other = payload(2, 6000), payload(3, 100)
    await store(tier, key(2), data)
    await store(tier, key(3), other)
    tamper(tier, key(2), 4321)
    if path == "read":
        got = tier.read_sync(key(2))
        served = got is not None
    elif path == "copy_into":
        served = tier.copy_into(key(2), memoryview(bytearray(len(data))))
    elif path == "view":
        # A block in one page run has a view; 6000 bytes fit two contiguous 4 KiB pages.
        served = tier.view(key(2)) is not None
    else:
        lease = tier.lease(key(2))
        served = lease is not None
        if lease is not None:
            tier.release(lease)
    if tier.verify_reads:
        assert not served
        assert tier.stats()["corrupt_blocks"] == 1
        assert tier.header(key(2)) is None  # dropped: the store forgets it and reads below
        assert tier.stats()["blocks"] == 1
    else:
        assert served  # trusted memory: not checked (the documented default)
        assert tier.stats()["corrupt_blocks"] == 0
    block = tier.read_sync(key(3))  # the neighbour is untouched either way
    assert block is not None and bytes(block.payload) == other
