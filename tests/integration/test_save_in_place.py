"""The connector's CPU saves gather straight into the store's arena (a real ``kvstore serve``).

:class:`~kvstore.integrations.vllm.saves.SaveQueue` reserves arena pages for a step's chunks,
gathers each chunk's blocks out of the paged cache into them and commits: no host buffer and no
put. These check the bytes stored against the reference gather, that chunks the store holds
already are not gathered again, and that chunks without room still reach the store by a put.
The client is a real :class:`KVStoreClient`, wrapped only to count which calls the queue made.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import kvstore_kernels  # type: ignore[import-not-found, unused-ignore]
import torch
from harness.shm_blocks import NS, make_blocks

from kvstore import KVStoreClient
from kvstore.integrations.paged.device_pipeline import Device, Event
from kvstore.integrations.vllm.common import Breaker
from kvstore.integrations.vllm.saves import SaveJob, SaveQueue
from kvstore.integrations.vllm.stats import ConnectorCounters

if TYPE_CHECKING:
    from harness.server_factory import ServerFactory

LAYERS, BPC, BLOCKS = 3, 2, 32
CHUNK_SHAPE = (LAYERS, BPC, 2, 16, 64)  # [layers, blocks per chunk, *block] (bf16)
CHUNK_BYTES = 3 * 2 * 2 * 16 * 64 * 2  # 24 KiB
LAYOUT = kvstore_kernels.CacheLayout("t", block_dim=0, ndim=4)


class CountingClient:
    """A real client; counts the calls the save queue makes on it."""

    def __init__(self, client: KVStoreClient) -> None:
        self.client = client
        self.calls: dict[str, int] = {"reserve": 0, "put": 0}

    def reserve(self, *args: Any, **kwargs: Any) -> Any:
        self.calls["reserve"] += 1
        return self.client.reserve(*args, **kwargs)

    def put(self, *args: Any, **kwargs: Any) -> Any:
        self.calls["put"] += 1
        return self.client.put(*args, **kwargs)


def _caches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randn(BLOCKS, 2, 16, 64, generator=gen).to(torch.bfloat16) for _ in range(LAYERS)]


def _expected(caches: list[torch.Tensor], ids: list[int]) -> bytes:
    gathered = kvstore_kernels.gather_blocks(caches, ids, LAYOUT)
    return bytes(gathered.contiguous().view(torch.uint8).numpy())


def _save(
    client: CountingClient, caches: list[torch.Tensor], keys: list[bytes], ids: list[int]
) -> ConnectorCounters:
    counters = ConnectorCounters()
    queue = SaveQueue(client, Breaker(5.0), counters, 64)  # type: ignore[arg-type]
    queue.set_target(Device(torch.device("cpu")), caches, LAYOUT, CHUNK_SHAPE)
    queue.submit(SaveJob("r", keys, ids, Event()))
    assert queue.shutdown()  # after the queued saves reached the store
    figures = counters.take()
    assert figures is not None and figures["saved_tokens"] == 64 * len(keys), figures
    return counters


def test_chunks_are_gathered_into_reserved_pages_and_committed(
    server_factory: ServerFactory,
) -> None:
    server = server_factory(dram_capacity="4MiB")
    caches = _caches()
    keys, _ = make_blocks(51, 3, 1)
    ids = [7, 8, 20, 21, 3, 4]
    with KVStoreClient(server.target, namespace=NS, data_plane="shm") as raw:
        client = CountingClient(raw)
        _save(client, caches, keys, ids)
        assert client.calls == {"reserve": 1, "put": 0}
        want = [_expected(caches, ids[i * BPC : (i + 1) * BPC]) for i in range(3)]
        assert raw.get(keys) == want


def test_chunks_the_store_holds_are_not_gathered_again(server_factory: ServerFactory) -> None:
    """The store keeps what it had: a chunk reported present is neither gathered nor written."""
    server = server_factory(dram_capacity="4MiB")
    caches = _caches()
    keys, _ = make_blocks(52, 2, 1)
    ids = [1, 2, 9, 10]
    with KVStoreClient(server.target, namespace=NS, data_plane="shm") as raw:
        marker = b"\x01" * CHUNK_BYTES  # not what the cache holds: would be overwritten
        assert raw.put(keys[:1], [marker]).stored == 1
        client = CountingClient(raw)
        _save(client, caches, keys, ids)
        assert raw.get(keys) == [marker, _expected(caches, ids[2:])]
        assert client.calls == {"reserve": 1, "put": 0}


def test_chunks_without_room_in_the_arena_still_reach_the_store(
    server_factory: ServerFactory,
) -> None:
    """An arena of 4 pages (a quarter of it per connection): some chunks get no pages and are
    gathered into a host buffer and put (the put lands them in the nvme tier)."""
    server = server_factory(dram_capacity="256KiB")
    caches = _caches()
    keys, _ = make_blocks(53, 8, 1)
    ids = [(5 * i) % BLOCKS for i in range(8 * BPC)]
    with KVStoreClient(server.target, namespace=NS, data_plane="shm") as raw:
        client = CountingClient(raw)
        _save(client, caches, keys, ids)
        assert client.calls == {"reserve": 1, "put": 1}
        want = [_expected(caches, ids[i * BPC : (i + 1) * BPC]) for i in range(8)]
        assert raw.get(keys) == want
