"""Reading blocks in place under a lease (``KVStoreClient.lease``) against a real ``kvstore serve``.

The vLLM connector's CPU loads read each chunk straight out of the store's arena, layer by layer,
while the server keeps the leased pages as they are; these check that the views hold exactly
the stored bytes for as long as the lease is held, that a release gives everything back, and
that the connector's worker loads bit-exact KV through it.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import TYPE_CHECKING

import kvstore_kernels  # type: ignore[import-not-found, unused-ignore]
import numpy as np
import torch
from harness.shm_blocks import NS, dram, make_blocks, wait_released

from kvstore import KVStoreClient
from kvstore.client.settings import ClientSettings
from kvstore.integrations.paged.device_pipeline import Device, LoadPipeline
from kvstore.integrations.vllm.common import LoadSpec

if TYPE_CHECKING:
    from harness.server_factory import ServerFactory

KiB = 1024


def _no_direct_reads() -> ClientSettings:
    return dataclasses.replace(ClientSettings.from_env({}), shm_direct_reads=False)


def test_leased_views_hold_the_blocks_until_released(server_factory: ServerFactory) -> None:
    """A missing key makes the index path step aside: the server leases the blocks."""
    server = server_factory(dram_capacity="1MiB")  # 16 pages of 64 KiB
    keys, values = make_blocks(31, 4, 64 * KiB)
    missing, _ = make_blocks(32, 1, 64 * KiB)
    with KVStoreClient(server.target, namespace=NS, data_plane="shm") as client:
        assert client.put(keys, values).stored == 4
        lease = client.lease([*keys, *missing])
        assert lease is not None
        views = lease.views
        assert views[-1] is None
        assert [bytes(v) for v in views[:-1] if v is not None] == values
        assert dram(client)["leases"] == 4
        assert lease.intact() == [True] * 4 + [False]
        # Deleting and overwriting the arena many times over leaves the leased bytes alone.
        assert client.delete(keys) == 4
        more_keys, more_values = make_blocks(33, 40, 64 * KiB)
        for start in range(0, 40, 8):
            client.put(more_keys[start : start + 8], more_values[start : start + 8])
        assert [bytes(v) for v in views[:-1] if v is not None] == values
        assert lease.intact() == [True] * 4 + [False]
        lease.release()
        lease.release()  # once only
        wait_released(client)


def test_blocks_in_the_index_are_read_without_a_lease_and_checked_after(
    server_factory: ServerFactory,
) -> None:
    """Every key published: views straight from the index, no server lease; a block deleted
    and overwritten meanwhile is reported not intact (its bytes may be torn)."""
    server = server_factory(dram_capacity="1MiB")
    keys, values = make_blocks(36, 4, 64 * KiB)
    with KVStoreClient(server.target, namespace=NS, data_plane="shm") as client:
        assert client.put(keys, values).stored == 4
        lease = client.lease(keys)
        assert lease is not None
        assert [bytes(v) for v in lease.views if v is not None] == values
        assert dram(client)["leases"] == 0
        assert lease.intact() == [True] * 4
        assert client.delete(keys[1:2]) == 1
        assert lease.intact() == [True, False, True, True]
        lease.release()
    with KVStoreClient(
        server.target, namespace=NS, data_plane="shm", settings=_no_direct_reads()
    ) as client:
        lease = client.lease([keys[0]])  # no index reads: the server leases it
        assert lease is not None and dram(client)["leases"] == 1
        lease.release()
        wait_released(client)


def test_lease_is_none_without_shared_memory(server_factory: ServerFactory) -> None:
    server = server_factory(dram_capacity="1MiB")
    keys, values = make_blocks(34, 1, 64 * KiB)
    with KVStoreClient(server.target, namespace=NS, data_plane="grpc") as client:
        assert client.put(keys, values).stored == 1
        assert client.lease(keys) is None


def test_a_load_copies_leased_chunks_straight_into_the_cache(
    server_factory: ServerFactory,
) -> None:
    """The CPU load path the connector takes over shared memory: bf16 chunks stored, then
    leased and copied layer by layer into scattered cache blocks, equal to the reference
    scatter; a chunk of the wrong size fails alone; the lease is released at the end."""
    server = server_factory(dram_capacity="4MiB")
    layers, bpc, blocks = 3, 2, 16
    chunk_shape = (layers, bpc, 2, 8, 16)
    layout = kvstore_kernels.CacheLayout("t", block_dim=0, ndim=4)
    chunks = [torch.randn(chunk_shape).to(torch.bfloat16) for _ in range(3)]
    keys, _ = make_blocks(35, 3, 1)
    stored = [c.view(torch.uint8).numpy().tobytes() for c in chunks]
    stored[2] = stored[2][:-2]  # another size than a chunk
    caches = [torch.zeros(blocks, 2, 8, 16, dtype=torch.bfloat16) for _ in range(layers)]
    pipeline = LoadPipeline(Device(torch.device("cpu")), caches, layout, chunk_shape, bpc, 1)
    with KVStoreClient(server.target, namespace=NS, data_plane="shm") as client:
        assert client.put(keys, stored).stored == 3
        spec = LoadSpec("r", keys, [9, 3, 4, 5, 12, 13])
        load = pipeline.new_load([spec], torch.zeros(3, *chunk_shape, dtype=torch.bfloat16))

        def fetch(_: object) -> list[bool]:
            from kvstore.integrations.paged.device_pipeline import arena_chunk

            lease = client.lease(keys)
            assert lease is not None
            load.sources = [
                None if v is None else arena_chunk(v, chunk_shape, torch.bfloat16)
                for v in lease.views
            ]
            load.release = lease.release
            return [s is not None for s in load.sources]

        pipeline.run(load, fetch)
        assert load.ok == [True, True, False] and not load.crashed
        expected = [torch.zeros_like(c) for c in caches]
        kvstore_kernels.scatter_blocks(chunks[0], expected, [9, 3], layout)
        kvstore_kernels.scatter_blocks(chunks[1], expected, [4, 5], layout)
        for cache, want in zip(caches, expected, strict=True):
            assert torch.equal(cache.view(torch.int16), want.view(torch.int16))
        assert np.count_nonzero(caches[0][12:14].view(torch.int16).numpy()) == 0
        wait_released(client)


def test_the_async_client_leases_too(server_factory: ServerFactory) -> None:
    """``AsyncKVStoreClient.lease``: the same views as the blocking client's, ``None`` off
    shared memory."""
    from kvstore import AsyncKVStoreClient

    server = server_factory(dram_capacity="1MiB")
    keys, values = make_blocks(37, 3, 64 * KiB)
    missing, _ = make_blocks(38, 1, 64 * KiB)

    async def main() -> None:
        async with AsyncKVStoreClient(server.target, namespace=NS, data_plane="shm") as client:
            assert (await client.put(keys, values)).stored == 3
            lease = await client.lease([keys[0], *missing, *keys[1:]])
            assert lease is not None
            assert lease.views[1] is None
            assert [bytes(v) for v in lease.views if v is not None] == values
            lease.release()
        async with AsyncKVStoreClient(server.target, namespace=NS, data_plane="grpc") as client:
            assert await client.lease(keys) is None

    asyncio.run(main())
