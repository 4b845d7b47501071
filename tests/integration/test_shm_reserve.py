"""Writing blocks in place (``KVStoreClient.reserve``) against a real ``kvstore serve``.

The vLLM connector's CPU saves gather KV blocks straight into arena pages the server reserved,
then commit; these check that what is committed is exactly what was written (read back through
a get and a lease), that keys the store holds already are reported without pages, that whatever
is not committed is stored nowhere and its pages come back, and that misuse is refused.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import numpy as np
import pytest
from harness.shm_blocks import NS, dram, make_blocks, wait_released

from kvstore import AsyncKVStoreClient, KVStoreClient
from kvstore.errors import InvalidRequestError

if TYPE_CHECKING:
    from harness.server_factory import ServerFactory

KiB = 1024
PAGE = 64 * KiB  # the server's default dram page


def test_written_in_place_and_committed_blocks_read_back_exactly(
    server_factory: ServerFactory,
) -> None:
    server = server_factory(dram_capacity="8MiB")
    keys, values = make_blocks(41, 3, 3 * PAGE + 5)
    with KVStoreClient(server.target, namespace=NS, data_plane="shm") as client:
        assert client.put(keys[:1], values[:1]).stored == 1  # already there: no pages for it
        held = client.reserve(keys, [len(v) for v in values])
        assert held is not None
        assert held.states == ["present", "reserved", "reserved"]
        assert held.views[0] is None
        assert dram(client)["reserved_bytes"] > 0
        for index in (1, 2):
            view = held.views[index]
            assert view is not None and view.nbytes == len(values[index])
            view[:] = np.frombuffer(values[index], dtype=np.uint8)
        result = held.commit()
        assert (result.stored, result.already_present, result.dropped) == (2, 1, 0)
        assert client.get(keys) == values
        lease = client.lease(keys)
        assert lease is not None
        assert [bytes(v) for v in lease.views if v is not None] == values
        lease.release()
        wait_released(client)


def test_only_the_written_keys_are_committed_and_the_rest_given_back(
    server_factory: ServerFactory,
) -> None:
    server = server_factory(dram_capacity="2MiB")
    keys, values = make_blocks(42, 3, PAGE)
    with KVStoreClient(server.target, namespace=NS, data_plane="shm") as client:
        used = dram(client)["used"]
        held = client.reserve(keys, [PAGE] * 3)
        assert held is not None
        held.write(1, values[1])
        assert held.commit([1]).stored == 1
        assert client.get(keys) == [None, values[1], None]
        with pytest.raises(InvalidRequestError, match="already committed"):
            held.commit()
        held.cancel()  # after a commit: nothing to do
        with client.reserve(keys[:1], [PAGE]) as unused:  # type: ignore[union-attr]
            assert unused.states == ["reserved"]
        assert client.get(keys[:1]) == [None]  # leaving the block cancels
        wait_released(client, used=used + PAGE)


def test_pages_that_are_not_contiguous_are_written_through_one_window_view(
    server_factory: ServerFactory,
) -> None:
    """Every other page freed: a three-page block gets scattered arena pages, yet the caller
    writes one contiguous view (of its write window; the server scatters it at the commit)."""
    server = server_factory(dram_capacity="1MiB")  # 16 pages
    fill, fill_values = make_blocks(43, 16, PAGE)
    keys, values = make_blocks(44, 1, 3 * PAGE)
    with KVStoreClient(server.target, namespace=NS, data_plane="shm") as client:
        assert client.put(fill, fill_values).stored == 16
        assert client.delete(fill[::2]) == 8
        held = client.reserve(keys, [3 * PAGE])
        assert held is not None and held.states == ["reserved"]
        view = held.views[0]
        assert view is not None and len(view) == 3 * PAGE and view.flags.writeable
        with pytest.raises(InvalidRequestError, match="reserved 196608 bytes"):
            held.write(0, b"short")
        view[:] = np.frombuffer(values[0], dtype=np.uint8)
        assert held.commit().stored == 1
        assert client.get(keys) == values
        assert client.get(fill[1::2]) == fill_values[1::2]  # the neighbours are untouched


def test_a_client_that_closes_without_committing_stores_nothing(
    server_factory: ServerFactory,
) -> None:
    server = server_factory(dram_capacity="1MiB")
    keys, values = make_blocks(45, 2, PAGE)
    with KVStoreClient(server.target, namespace=NS, data_plane="shm") as client:
        held = client.reserve(keys, [PAGE, PAGE])
        assert held is not None
        held.write(0, values[0])
        held.write(1, values[1])
    with KVStoreClient(server.target, namespace=NS, data_plane="shm") as client:
        wait_released(client)
        assert client.get(keys) == [None, None]


def test_bad_reservations_are_refused(server_factory: ServerFactory) -> None:
    server = server_factory(dram_capacity="1MiB")
    keys, _ = make_blocks(46, 2, 1)
    with KVStoreClient(server.target, namespace=NS, data_plane="shm") as client:
        with pytest.raises(InvalidRequestError, match="1 sizes for 2 keys"):
            client.reserve(keys, [PAGE])
        held = client.reserve(keys, [PAGE, 4 * 1024**2])  # more than the whole arena
        assert held is not None and held.states == ["reserved", "no_room"]
        with pytest.raises(InvalidRequestError, match="no reserved pages"):
            held.write(1, b"x")
        held.cancel()
        wait_released(client)
        assert client.get(keys) == [None, None]  # the server still serves


def test_reserve_is_none_off_shared_memory_and_async_too(server_factory: ServerFactory) -> None:
    server = server_factory(dram_capacity="1MiB")
    keys, values = make_blocks(47, 1, PAGE)
    with KVStoreClient(server.target, namespace=NS, data_plane="grpc") as client:
        assert client.reserve(keys, [PAGE]) is None

    async def main() -> None:
        async with AsyncKVStoreClient(server.target, namespace=NS, data_plane="shm") as client:
            held = await client.reserve(keys, [PAGE])
            assert held is not None
            held.write(0, values[0])
            assert held.commit().stored == 1
            assert await client.get(keys) == values

    asyncio.run(main())
