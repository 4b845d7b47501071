"""The UCX data path over loopback: real ``kvstore serve`` processes with ``--ucx-listen``.

Nothing is mocked. Servers come from conftest's factories (``kvstore serve --ucx-listen
127.0.0.1:0``); their UCX address is what the ``DataPlane`` RPC advertises. Two kinds of client
drive them: :class:`UcxDataClient` on a gRPC client's channel, for the transport's own contract
(``None`` means "use gRPC"), and :class:`KVStoreClient` with ``data_plane="ucx"`` or ``"auto"``,
for what users get. Where a test needs a server to lose its UCX listener it stops the server and
starts it again on the same gRPC port (and nvme directory), without ``--ucx-listen`` or with it on
the same UCX port. No GPU is needed.

These tests need ``ucxx`` (the ``ucx`` extra). Without it the module fails at collection, loudly,
unless ``KVSTORE_SKIP_UCX=1`` says that this environment is not meant to have UCX: a missing
dependency must not turn into a quietly skipped suite.
"""

from __future__ import annotations

import itertools
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
from harness.ports import free_port
from harness.shm_blocks import wait_released
from harness.ucx_servers import (
    NO_SHM,
    UCX,
    keys_of,
    kv_client,
    ucx_address,
    ucx_client,
    values_of,
)
from harness.ucx_servers import address as address  # fixtures, shared
from harness.ucx_servers import kv as kv
from harness.ucx_servers import ucx_server as ucx_server

from kvstore import KVStoreClient, Namespace
from kvstore.client.ucx import UcxDataClient
from kvstore.errors import InvalidRequestError, NamespaceMismatchError, StoreUnavailableError
from kvstore.integrations.vllm.common import Breaker, warm_up

if TYPE_CHECKING:
    from harness.serve import ServerProcess
    from harness.server_factory import ServerFactory

OTHER = Namespace(model="ucx-test-other", num_layers=2, num_kv_heads=2, head_size=64)
SIZES = [1, 4095, 8192, 65536 + 7, 1024**2, 3 * 1024**2 + 1]


@pytest.fixture(scope="module", autouse=True)
def data_plane() -> str:
    """One pass, not conftest's two (``auto`` then ``grpc`` through ``KVSTORE_DATA_PLANE``).

    Every client here names its data plane itself (a :class:`UcxDataClient`, or a
    :class:`KVStoreClient` built with ``data_plane="ucx"``, ``"auto"`` or ``"grpc"`` on purpose),
    so the environment variable would change nothing and a second pass would repeat every test
    and every server start. Kept as a fixture because ``module_server_factory`` depends on it."""
    return "ucx"


# -- helpers ----------------------------------------------------------------------------------


def as_bytes(values: list[np.ndarray]) -> list[bytes | None]:
    return [value.tobytes() for value in values]


def pinned_ucx_server(server_factory: ServerFactory) -> ServerProcess:
    """A UCX server on a fixed gRPC port, so that a restart comes back at the same target.

    The flag comes after the free port :class:`ServerProcess` picks, and the last ``--listen``
    wins."""
    return server_factory("--listen", f"127.0.0.1:{free_port()}", *UCX)


def restart_without_ucx(server: ServerProcess) -> None:
    """Stop cleanly (asserting exit code 0) and start again without the UCX listener."""
    at = server.flags.index("--ucx-listen")
    del server.flags[at : at + 2]
    server.restart()


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture
def ucx(kv: KVStoreClient, address: str) -> Iterator[UcxDataClient]:
    client = ucx_client(kv, address, timeout=10.0)
    yield client
    client.close()


# -- UcxDataClient: the transport's contract --------------------------------------------------


def test_put_get_into_get_round_trip_bit_identical(ucx: UcxDataClient) -> None:
    keys = keys_of(len(SIZES))
    values = values_of(SIZES)
    result = ucx.put(keys, values)
    assert result is not None, ucx.last_error
    assert (result.stored, result.already_present, result.dropped) == (len(keys), 0, 0)

    buffers = [np.zeros(size, dtype=np.uint8) for size in SIZES]
    assert ucx.get_into(keys, buffers) == [True] * len(keys)
    for value, buffer in zip(values, buffers, strict=True):
        assert np.array_equal(value, buffer)

    assert ucx.get(keys) == as_bytes(values)
    assert ucx.counters["fallbacks"] == 0 and ucx.counters["connects"] == 1
    assert ucx.counters["transfers"] == 3

    again = ucx.put(keys, values)
    assert again is not None and again.already_present == len(keys)


def test_accepts_bytes_bytearray_memoryview_and_tensors(ucx: UcxDataClient) -> None:
    import torch

    keys = keys_of(4)
    values = [b"a" * 1000, bytearray(b"b" * 70000), memoryview(b"c" * 3000), torch.arange(512)]
    assert ucx.put(keys, values) is not None
    out = torch.zeros(512, dtype=torch.int64)
    buffers = [bytearray(1000), bytearray(70000), memoryview(bytearray(3000)), out]
    assert ucx.get_into(keys, buffers) == [True] * 4
    assert bytes(buffers[0]) == values[0] and bytes(buffers[1]) == values[1]
    assert bytes(buffers[2]) == bytes(values[2]) and torch.equal(out, values[3])


def test_misses_and_size_mismatches_are_false(ucx: UcxDataClient) -> None:
    keys = keys_of(3)
    values = values_of([5000, 6000, 7000], seed=1)
    assert ucx.put(keys[:2], values[:2]) is not None
    buffers = [np.zeros(5000, np.uint8), np.zeros(1234, np.uint8), np.zeros(7000, np.uint8)]
    # key 1 is stored with another size, key 2 is missing: neither touches its buffer.
    assert ucx.get_into(keys, buffers) == [True, False, False]
    assert np.array_equal(buffers[0], values[0])
    assert not buffers[1].any() and not buffers[2].any()
    assert ucx.get(keys) == [values[0].tobytes(), values[1].tobytes(), None]
    # The endpoint is still in sync after unsent payloads: the next transfer is exact.
    assert ucx.get_into(keys[:1], buffers[:1]) == [True]
    assert ucx.counters["fallbacks"] == 0


def test_a_get_s_leases_come_back_after_its_sends_and_checksums(
    ucx: UcxDataClient, kv: KVStoreClient
) -> None:
    """The server hashes a get's blocks from their leased pages while it sends them: the leases
    come back once both have ended, for whole gets, gets with a miss and gets of several
    messages (blocks of one staging array, and blocks over 4 MiB)."""
    sizes = [1024**2, 1024**2, 5 * 1024**2]
    keys = keys_of(len(sizes))
    values = values_of(sizes, seed=7)
    assert ucx.put(keys, values) is not None, ucx.last_error
    staging = np.zeros(sum(sizes), dtype=np.uint8)
    starts = np.cumsum([0, *sizes])
    views = [staging[a:b] for a, b in itertools.pairwise(starts)]
    for _ in range(3):
        assert ucx.get_into(keys, views) == [True] * len(keys)
        assert np.array_equal(staging, np.concatenate(values))
        assert ucx.get_into([keys[0], keys_of(1)[0]], views[:2]) == [True, False]
        assert ucx.get(keys) == as_bytes(values)
    assert ucx.counters["fallbacks"] == 0
    assert wait_released(kv)["leases"] == 0


def test_ucx_and_grpc_paths_see_the_same_blocks(ucx: UcxDataClient, kv: KVStoreClient) -> None:
    via_ucx, via_grpc = keys_of(2), keys_of(2)
    values = values_of([200_000, 300_000], seed=2)
    assert ucx.put(via_ucx, values) is not None
    kv.put(via_grpc, values)
    assert kv.get(via_ucx) == as_bytes(values)
    assert ucx.get(via_grpc) == as_bytes(values)


def test_namespaces_are_kept_apart(ucx: UcxDataClient, kv: KVStoreClient, address: str) -> None:
    keys = keys_of(2)
    values = values_of([10_000, 20_000], seed=3)
    assert ucx.put(keys, values) is not None
    other = ucx_client(kv, address, OTHER)
    try:
        assert other.get(keys) == [None, None]
        assert other.get_into(keys, [bytearray(10_000), bytearray(20_000)]) == [False, False]
        with pytest.raises(NamespaceMismatchError):
            other.put(keys, values)
        assert other.usable, "a request error must not switch UCX off"
        fresh = keys_of(1)
        assert other.put(fresh, values[:1]) is not None
        assert ucx.get(fresh) == [None]
    finally:
        other.close()


def test_request_errors_raise_and_the_client_recovers(ucx: UcxDataClient) -> None:
    with pytest.raises(InvalidRequestError):
        ucx.put(keys_of(2), [b"x" * 100, b""])
    with pytest.raises(InvalidRequestError):
        ucx.get([b"short"])
    assert ucx.usable and ucx.counters["fallbacks"] == 0
    keys = keys_of(1)
    assert ucx.put(keys, [b"y" * 50_000]) is not None
    assert ucx.get(keys) == [b"y" * 50_000]


def test_retries_after_the_backoff(kv: KVStoreClient, address: str) -> None:
    keys = keys_of(4)
    values = values_of([16 * 1024**2] * 4, seed=5)
    client = ucx_client(kv, address, timeout=10.0, retry_after_s=1.0)
    try:
        assert client.put(keys, values) is not None, client.last_error
        # 64 MiB cannot arrive within 2 ms: the transfer fails, the server stays up.
        assert client.get(keys, timeout=0.002) is None
        assert not client.usable and client.counters["fallbacks"] == 1
        # Within the backoff the client does not even try.
        assert client.get(keys) is None
        assert client.counters["fallbacks"] == 1 and client.counters["transfers"] == 1
        deadline = time.monotonic() + 5.0
        while not client.usable:
            assert time.monotonic() < deadline, "the backoff never ended"
            time.sleep(0.05)
        assert client.get(keys) == as_bytes(values), client.last_error
        assert client.counters["connects"] == 2 and client.counters["transfers"] == 2
    finally:
        client.close()


_DOOMED_CLIENT = textwrap.dedent(
    """
    import os, sys, numpy as np
    from kvstore import KVStoreClient, Namespace
    target, mode = sys.argv[1:3]
    ns = Namespace(model="ucx-test", num_layers=2, num_kv_heads=2, head_size=64)
    kv = KVStoreClient(target, namespace=ns, timeout=30.0, data_plane="ucx")
    keys = [os.urandom(16) for _ in range(16)]
    values = [np.full(4 * 1024**2, i, np.uint8) for i in range(16)]
    kv.put(keys, values)
    assert kv._ucx is not None and kv._ucx.counters["transfers"] == 1, kv._ucx
    print("ready", flush=True)
    while True:
        if mode == "get":
            kv.get_into(keys, values)
        else:
            kv.put([os.urandom(16) for _ in keys], values)
    """
)


@pytest.mark.parametrize("mode", ["get", "put"])
def test_a_killed_client_does_not_wedge_the_server(
    mode: str, ucx: UcxDataClient, ucx_server: ServerProcess, tmp_path: Path
) -> None:
    script = tmp_path / "doomed.py"
    script.write_text(_DOOMED_CLIENT)
    doomed = subprocess.Popen(
        [sys.executable, str(script), ucx_server.target, mode], stdout=subprocess.PIPE, text=True
    )
    try:
        assert doomed.stdout is not None
        assert doomed.stdout.readline().strip() == "ready"
        time.sleep(0.3)  # sleep: killed at some moment in the middle of its transfer loop
        doomed.kill()
        doomed.wait()
    finally:
        if doomed.poll() is None:
            doomed.kill()
    started = time.monotonic()
    keys = keys_of(4)
    values = values_of([2 * 1024**2] * 4, seed=4)
    assert ucx.put(keys, values, timeout=10.0) is not None, ucx.last_error
    buffers = [np.zeros_like(v) for v in values]
    assert ucx.get_into(keys, buffers, timeout=10.0) == [True] * 4
    assert all(np.array_equal(v, b) for v, b in zip(values, buffers, strict=True))
    assert time.monotonic() - started < 10.0
    assert ucx_server.running


# -- KVStoreClient: what users get ------------------------------------------------------------


def test_client_with_data_plane_ucx_moves_the_bytes_over_ucx(
    ucx_server: ServerProcess, kv: KVStoreClient
) -> None:
    keys, grpc_keys = keys_of(len(SIZES)), keys_of(2)
    values, grpc_values = values_of(SIZES, seed=6), values_of([70_000, 1024**2], seed=7)
    with kv_client(ucx_server, "ucx") as client:
        result = client.put(keys, values)
        assert result.stored == len(keys)
        ucx = client._ucx
        assert ucx is not None and ucx.counters["transfers"] == 1, "put did not go over UCX"

        buffers = [np.zeros(size, dtype=np.uint8) for size in SIZES]
        assert client.get_into(keys, buffers) == [True] * len(keys)
        assert all(np.array_equal(v, b) for v, b in zip(values, buffers, strict=True))
        assert ucx.counters["transfers"] == 2
        assert client.get(keys) == as_bytes(values)
        assert ucx.counters["transfers"] == 3

        # The gRPC-only client reads what UCX put, and UCX reads what gRPC put.
        assert kv.get(keys) == as_bytes(values)
        kv.put(grpc_keys, grpc_values)
        assert client.get(grpc_keys) == as_bytes(grpc_values)
        assert kv._ucx is None and kv.data_plane == "grpc"

        # A request error raises as on gRPC and leaves UCX on.
        with pytest.raises(InvalidRequestError):
            client.put(keys_of(2), [b"x" * 100, b""])
        assert client.get(grpc_keys[:1]) == [grpc_values[0].tobytes()]
        assert ucx.counters["transfers"] == 5 and ucx.counters["fallbacks"] == 0
        assert ucx.counters["connects"] in (1, 2)  # the refused put may cost the endpoint


def test_auto_picks_ucx_when_shared_memory_is_off(
    server_factory: ServerFactory, ucx_server: ServerProcess
) -> None:
    server = server_factory(*NO_SHM, *UCX)
    keys = keys_of(3)
    values = values_of([4096, 500_000, 2 * 1024**2], seed=8)
    with kv_client(server, "auto") as client:
        client.put(keys, values)
        assert client.get(keys) == as_bytes(values)
        buffers = [np.zeros_like(v) for v in values]
        assert client.get_into(keys, buffers) == [True] * 3
        assert all(np.array_equal(v, b) for v, b in zip(values, buffers, strict=True))
        assert client.data_plane == "ucx"  # not shared memory
        assert client._ucx is not None and client._ucx.address == ucx_address(server)
        assert client._ucx.counters["transfers"] == 3 and client._ucx.counters["fallbacks"] == 0
    # Where shared memory is possible, "auto" prefers it and never opens UCX.
    with kv_client(ucx_server, "auto") as client:
        client.put(keys, values)
        assert client.get(keys) == as_bytes(values)
        assert client.data_plane == "shm" and client._ucx is None


def test_the_connector_s_warm_up_settles_the_data_path_before_any_load(
    server_factory: ServerFactory, ucx_server: ServerProcess
) -> None:
    """A CUDA worker picks its load path from ``data_plane`` on its first load: unsettled
    (``"grpc"``) then, it would never receive into device memory on its first load."""
    server = server_factory(*NO_SHM, *UCX)
    for target, plane in ((server, "ucx"), (ucx_server, "shm")):
        with kv_client(target, "auto") as client:
            assert client.data_plane == "grpc"  # nothing decided before the first data call
            breaker = Breaker(retry_after_s=5.0)
            warm_up(client, breaker, timeout=10.0)
            assert not breaker.is_open()  # the store answered
            assert client.data_plane == plane
            assert client.open_data_plane() == plane  # settled once, asked again: the same
            if plane == "ucx":
                assert client._ucx is not None and client._ucx.address == ucx_address(server)
    with kv_client(server_factory(*NO_SHM), "auto") as client:  # no shm, no UCX: gRPC
        assert client.open_data_plane(timeout=10.0) == "grpc"


def test_data_plane_ucx_without_a_ucx_listener_uses_grpc(server_factory: ServerFactory) -> None:
    server = server_factory()
    assert ucx_address(server) == ""
    keys = keys_of(2)
    values = values_of([8192, 1024**2], seed=9)
    with kv_client(server, "ucx") as client:
        assert client.put(keys, values).stored == 2
        assert client.get(keys) == as_bytes(values)
        buffers = [np.zeros_like(v) for v in values]
        assert client.get_into(keys, buffers) == [True, True]
        assert all(np.array_equal(v, b) for v, b in zip(values, buffers, strict=True))
        assert client._ucx is None and client.data_plane == "grpc"


def test_falls_back_to_grpc_when_the_listener_is_gone(server_factory: ServerFactory) -> None:
    server = pinned_ucx_server(server_factory)
    keys = keys_of(3)
    values = values_of([1000, 300_000, 1024**2], seed=10)
    with kv_client(server, "ucx", timeout=2.0) as client:
        client.put(keys, values)
        ucx = client._ucx
        assert ucx is not None and ucx.counters["transfers"] == 1
        # Same gRPC address and nvme directory (the blocks survive), no UCX listener: the address
        # the client learnt leads nowhere.
        restart_without_ucx(server)
        assert ucx_address(server) == ""
        started = time.monotonic()
        assert client.get(keys) == as_bytes(values)
        buffers = [np.zeros_like(v) for v in values]
        assert client.get_into(keys, buffers) == [True] * 3
        assert all(np.array_equal(v, b) for v, b in zip(values, buffers, strict=True))
        fresh = keys_of(1)
        client.put(fresh, [b"w" * 10])
        # One UCX attempt (at most the call's deadline), then gRPC until the backoff ends.
        assert time.monotonic() - started < 2.0 + 5.0
        assert ucx.counters["fallbacks"] == 1 and ucx.counters["transfers"] == 1
        assert not ucx.usable and ucx.last_error
    with kv_client(server, "grpc") as kv:
        assert kv.get(fresh) == [b"w" * 10]


def test_a_dead_server_fails_over_within_the_deadline(server_factory: ServerFactory) -> None:
    server = server_factory(*UCX)
    keys = keys_of(2)
    with kv_client(server, "ucx", timeout=2.0) as client:
        # The first call opens the endpoint in half its deadline: more than 2 s leaves for it on
        # a loaded machine (at load 10, 1 s was not always enough and the put went over gRPC).
        client.put(keys, values_of([1024**2, 1024**2]), timeout=30.0)
        ucx = client._ucx
        assert ucx is not None and ucx.counters["transfers"] == 1
        server.kill()
        # Whether UCX notices first (endpoint error, fallback to gRPC) or the control call does
        # (UNAVAILABLE) is a race; either way: an error, not a hang, every time.
        for _ in range(2):
            started = time.monotonic()
            with pytest.raises(StoreUnavailableError):
                client.get_into(keys, [bytearray(1024**2), bytearray(1024**2)])
            assert time.monotonic() - started < 2.0 + 5.0
        assert ucx.counters["fallbacks"] <= 1


def test_server_stops_cleanly_with_clients_connected(server_factory: ServerFactory) -> None:
    server = server_factory(*UCX)
    with kv_client(server, "ucx") as client:
        client.put(keys_of(1), [b"q" * 4096])
        ucx = client._ucx
        assert ucx is not None and ucx.counters["transfers"] == 1
        connection = ucx.lanes.live()[0]
        assert connection is not None
        server.stop()  # asserts exit code 0
        assert f"dropping UCX client {connection.client_id.hex()}: server closing" in (
            server.stderr()
        )


def _listening_addresses(port: int) -> set[str]:
    """Local addresses (IPv4 and IPv6) with a TCP listener on ``port``, from ``/proc/net``."""
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        path = Path("/proc/net") / table
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].split(":")
            if fields[3] == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                # The kernel prints each 32-bit word of the address in host order.
                raw = b"".join(
                    int(address[i : i + 8], 16).to_bytes(4, sys.byteorder)
                    for i in range(0, len(address), 8)
                )
                found.add(socket.inet_ntop(family, raw))
    return found


def test_a_listener_asked_for_loopback_warns_that_it_takes_every_interface(
    ucx_server: ServerProcess, address: str
) -> None:
    """ucxx binds its listener to every interface whatever HOST says; the server must say so.

    If a ucxx release learns to bind one address, the first assertion fails and the warning (and
    the README's note) must go."""
    port = int(address.rpartition(":")[2])
    bound = _listening_addresses(port)
    assert bound and bound <= {"0.0.0.0", "::"}, bound  # wildcards only
    assert f"the UCX listener on port {port} takes every interface" in ucx_server.stderr()
