"""The UCX data path of :class:`AsyncKVStoreClient`, over loopback against real servers.

Nothing is mocked: servers come from conftest's factories (``kvstore serve --ucx-listen
127.0.0.1:0``). The async client takes the same path as the blocking one (shared memory, then
UCX, then gRPC, chosen by one core); its UCX transfers run on the UCX client's own loop thread and
are awaited from a worker thread, so the caller's event loop keeps running meanwhile.

Like ``test_ucx.py``, this module needs ``ucxx`` and fails at collection without it, unless
``KVSTORE_SKIP_UCX=1`` says that this environment is not meant to have UCX.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import pytest
from harness.ucx_guard import require_ucx

from kvstore import AsyncKVStoreClient, KVStoreClient, Namespace
from kvstore.errors import InvalidRequestError, StoreUnavailableError

if TYPE_CHECKING:
    from harness.serve import ServerProcess
    from harness.server_factory import ServerFactory

require_ucx()

T = TypeVar("T")

NAMESPACE = Namespace(model="ucx-async-test", num_layers=2, num_kv_heads=2, head_size=64)
UCX = ("--ucx-listen", "127.0.0.1:0", "--allow-unauthenticated")  # it binds every interface
NO_SHM = ("--shm-socket", "")
SIZES = [1, 4095, 65536 + 7, 1024**2, 3 * 1024**2 + 1]


@pytest.fixture(scope="module", autouse=True)
def data_plane() -> str:
    """One pass, not conftest's two: every client here names its data plane itself."""
    return "ucx"


def keys_of(count: int) -> list[bytes]:
    return [os.urandom(16) for _ in range(count)]


def values_of(sizes: list[int], seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for size in sizes]


def as_bytes(values: list[np.ndarray]) -> list[bytes | None]:
    return [value.tobytes() for value in values]


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coroutine)


def aclient(server: ServerProcess, data_plane: str, timeout: float = 10.0) -> AsyncKVStoreClient:
    return AsyncKVStoreClient(
        server.target, namespace=NAMESPACE, timeout=timeout, data_plane=data_plane
    )


@pytest.fixture(scope="module")
def ucx_server(module_server_factory: ServerFactory) -> ServerProcess:
    """UCX listener on, shared memory off: ``auto`` and ``ucx`` both move bytes over UCX."""
    return module_server_factory(*NO_SHM, *UCX, dram_capacity="256MiB", nvme_capacity="256MiB")


@pytest.mark.parametrize("mode", ["ucx", "auto"])
def test_async_client_moves_the_bytes_over_ucx(ucx_server: ServerProcess, mode: str) -> None:
    keys = keys_of(len(SIZES))
    values = values_of(SIZES, seed=1)

    async def scenario() -> None:
        async with aclient(ucx_server, mode) as client:
            assert (await client.put(keys, values)).stored == len(keys)
            ucx = client._ucx
            assert ucx is not None and ucx.counters["transfers"] == 1, "put did not go over UCX"
            assert client.data_plane == "ucx"
            buffers = [np.zeros(size, dtype=np.uint8) for size in SIZES]
            assert await client.get_into(keys, buffers) == [True] * len(keys)
            assert all(np.array_equal(v, b) for v, b in zip(values, buffers, strict=True))
            assert await client.get(keys) == as_bytes(values)
            assert await client.lookup(keys) == len(keys)  # lookups stay on gRPC
            assert ucx.counters["transfers"] == 3 and ucx.counters["fallbacks"] == 0

    run(scenario())
    # What went over UCX is what a gRPC-only client reads.
    with KVStoreClient(ucx_server.target, namespace=NAMESPACE, data_plane="grpc") as kv:
        assert kv.get(keys) == as_bytes(values)


def test_concurrent_async_calls_share_the_ucx_path(ucx_server: ServerProcess) -> None:
    batches = [keys_of(3) for _ in range(6)]
    values = [values_of([200_000, 70_000, 1024**2], seed=i) for i in range(6)]

    async def scenario() -> None:
        async with aclient(ucx_server, "ucx") as client:
            # The first call finds the UCX listener; calls made meanwhile go over gRPC.
            await client.put(keys_of(1), [b"w" * 4096])
            puts = [client.put(k, v) for k, v in zip(batches, values, strict=True)]
            assert [r.stored for r in await asyncio.gather(*puts)] == [3] * 6
            got = await asyncio.gather(*(client.get(k) for k in batches))
            assert got == [as_bytes(v) for v in values]
            ucx = client._ucx
            assert ucx is not None and ucx.counters["transfers"] == 13
            assert ucx.counters["fallbacks"] == 0 and ucx.counters["connects"] == 1

    run(scenario())


def test_ucx_transfers_do_not_block_the_event_loop(ucx_server: ServerProcess) -> None:
    keys = keys_of(8)
    values = values_of([8 * 1024**2] * 8, seed=2)
    gaps: list[float] = []

    async def heartbeat(done: asyncio.Event) -> None:
        last = time.monotonic()
        while not done.is_set():
            await asyncio.sleep(0.001)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    async def scenario() -> float:
        async with aclient(ucx_server, "ucx") as client:
            await client.put(keys[:1], values[:1])  # connect first
            done = asyncio.Event()
            beat = asyncio.create_task(heartbeat(done))
            started = time.monotonic()
            result = await client.put(keys, values)
            assert await client.get(keys) == as_bytes(values)
            took = time.monotonic() - started
            done.set()
            await beat
            assert result.stored == 7 and result.already_present == 1
            ucx = client._ucx
            assert ucx is not None and ucx.counters["transfers"] == 3
            return took

    took = run(scenario())
    # 128 MiB both ways: the loop kept ticking all along, never held for the transfer's length.
    assert len(gaps) >= 5, (took, gaps)
    assert max(gaps) < max(took / 2, 0.05), (took, max(gaps))


def test_request_errors_raise_and_ucx_stays_on(ucx_server: ServerProcess) -> None:
    async def scenario() -> None:
        async with aclient(ucx_server, "ucx") as client:
            keys = keys_of(1)
            await client.put(keys, [b"z" * 50_000])
            with pytest.raises(InvalidRequestError):
                await client.put(keys_of(2), [b"x" * 100, b""])
            assert await client.get(keys) == [b"z" * 50_000]
            ucx = client._ucx
            assert ucx is not None and ucx.usable and ucx.counters["fallbacks"] == 0

    run(scenario())


def test_async_client_falls_back_to_grpc_when_the_listener_is_gone(
    server_factory: ServerFactory,
) -> None:
    port = _free_port()
    server = server_factory("--listen", f"127.0.0.1:{port}", *NO_SHM, *UCX)
    keys = keys_of(3)
    values = values_of([1000, 300_000, 1024**2], seed=3)

    async def scenario() -> None:
        async with aclient(server, "auto", timeout=5.0) as client:
            await client.put(keys, values)
            ucx = client._ucx
            assert ucx is not None and ucx.counters["transfers"] == 1
            at = server.flags.index("--ucx-listen")
            del server.flags[at : at + 2]
            await asyncio.to_thread(server.restart)  # same gRPC port and nvme directory
            started = time.monotonic()
            for _ in range(50):  # the channel may still be reconnecting
                try:
                    got = await client.get(keys)
                    break
                except StoreUnavailableError:
                    await asyncio.sleep(0.1)
            assert got == as_bytes(values)
            assert time.monotonic() - started < 5.0 + 5.0
            assert ucx.counters["fallbacks"] == 1 and not ucx.usable
            assert client.data_plane == "grpc"

    run(scenario())


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
