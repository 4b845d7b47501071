"""The UCX data path over loopback: a real server process with a UCX listener, a real client.

Nothing is mocked: the server is ``tests/integration/ucx_serve.py`` (the store, the KVStore service
and ``add_ucx_to_server``) in a subprocess; the client is :class:`UcxDataClient` on a
:class:`KVStoreClient`'s channel. No GPU is needed.

These tests need ``ucxx`` (the ``ucx`` extra). Without it the module fails at collection, loudly,
unless ``KVSTORE_SKIP_UCX=1`` says that this environment is not meant to have UCX: a missing
dependency must not turn into a quietly skipped suite.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvstore import KVStoreClient, Namespace
from kvstore._wire import namespace_bytes
from kvstore.errors import InvalidRequestError, NamespaceMismatchError
from kvstore.transport.ucx import ucx_unavailable_reason

_REASON = ucx_unavailable_reason()
if _REASON is not None:
    if os.environ.get("KVSTORE_SKIP_UCX") == "1":
        pytest.skip(f"KVSTORE_SKIP_UCX=1: {_REASON}", allow_module_level=True)
    raise ImportError(
        f"{_REASON}\nInstall the ucx extra (pip install -e '.[ucx]'), or set KVSTORE_SKIP_UCX=1 "
        "where UCX is not expected."
    )

from kvstore.transport.ucx_client import UcxDataClient  # noqa: E402

SERVE = Path(__file__).with_name("ucx_serve.py")
NAMESPACE = Namespace(model="ucx-test", num_layers=2, num_kv_heads=2, head_size=64)
OTHER = Namespace(model="ucx-test-other", num_layers=2, num_kv_heads=2, head_size=64)
START_TIMEOUT_S = 30.0


class UcxServer:
    """``ucx_serve.py`` in a subprocess: its gRPC target and UCX address once ready."""

    def __init__(self, workdir: Path) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.log = workdir / "serve.err"
        self.out = workdir / "serve.out"
        command = [
            sys.executable,
            str(SERVE),
            "--dram-capacity",
            "256MiB",
            "--nvme-path",
            str(workdir / "nvme"),
            "--nvme-capacity",
            "256MiB",
        ]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with self.out.open("wb") as out, self.log.open("wb") as err:
            self.proc = subprocess.Popen(command, stdout=out, stderr=err, env=env)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            text = self.out.read_text()
            if "kvstore serving on " in text and text.endswith("\n"):
                words = text.split("kvstore serving on ", 1)[1].split()
                self.target, self.ucx_address = words[0], words[2]
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"ucx_serve did not start:\n{self.log.read_text()}")
            time.sleep(0.02)

    def alive(self) -> bool:
        """True while the process runs."""
        return self.proc.poll() is None

    def stop(self) -> int:
        """SIGTERM and wait; the exit code."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=20)

    def kill(self) -> None:
        """SIGKILL if still running."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module", autouse=True)
def data_plane() -> str:
    """One pass, not conftest's two: these tests drive :class:`UcxDataClient` directly, so the
    data plane ``KVStoreClient`` would choose for itself does not change what they exercise."""
    return "ucx"


@pytest.fixture(scope="module")
def ucx_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UcxServer]:
    server = UcxServer(tmp_path_factory.mktemp("ucx"))
    yield server
    if server.alive():
        assert server.stop() == 0, server.log.read_text()


@pytest.fixture
def kv(ucx_server: UcxServer) -> Iterator[KVStoreClient]:
    with KVStoreClient(ucx_server.target, namespace=NAMESPACE, timeout=10.0) as client:
        yield client


def ucx_client(
    kv: KVStoreClient, address: str, namespace: Namespace = NAMESPACE, **kwargs: float
) -> UcxDataClient:
    return UcxDataClient(kv._channel, address, namespace_bytes(namespace), **kwargs)


@pytest.fixture
def ucx(kv: KVStoreClient, ucx_server: UcxServer) -> Iterator[UcxDataClient]:
    client = ucx_client(kv, ucx_server.ucx_address, timeout=10.0)
    yield client
    client.close()


def keys_of(count: int) -> list[bytes]:
    return [os.urandom(16) for _ in range(count)]


def values_of(sizes: list[int], seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for size in sizes]


SIZES = [1, 4095, 8192, 65536 + 7, 1024**2, 3 * 1024**2 + 1]


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

    got = ucx.get(keys)
    assert got == [value.tobytes() for value in values]
    assert ucx.counters["fallbacks"] == 0 and ucx.counters["connects"] == 1

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


def test_ucx_and_grpc_paths_see_the_same_blocks(ucx: UcxDataClient, kv: KVStoreClient) -> None:
    via_ucx, via_grpc = keys_of(2), keys_of(2)
    values = values_of([200_000, 300_000], seed=2)
    assert ucx.put(via_ucx, values) is not None
    kv.put(via_grpc, values)
    assert kv.get(via_ucx) == [v.tobytes() for v in values]
    assert ucx.get(via_grpc) == [v.tobytes() for v in values]


def test_namespaces_are_kept_apart(
    ucx: UcxDataClient, kv: KVStoreClient, ucx_server: UcxServer
) -> None:
    keys = keys_of(2)
    values = values_of([10_000, 20_000], seed=3)
    assert ucx.put(keys, values) is not None
    other = ucx_client(kv, ucx_server.ucx_address, OTHER)
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


def test_falls_back_when_the_listener_is_gone(kv: KVStoreClient) -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        free_port = sock.getsockname()[1]
    dead = ucx_client(kv, f"127.0.0.1:{free_port}", timeout=5.0, retry_after_s=60.0)
    try:
        started = time.monotonic()
        assert dead.get_into(keys_of(1), [bytearray(10)]) is None
        assert dead.put(keys_of(1), [b"z"]) is None
        assert dead.get(keys_of(1)) is None
        assert time.monotonic() - started < 15.0
        assert not dead.usable and dead.last_error
        # The gRPC path the caller falls back to still works.
        keys = keys_of(1)
        kv.put(keys, [b"w" * 10])
        assert kv.get(keys) == [b"w" * 10]
    finally:
        dead.close()


def test_retries_after_the_backoff(kv: KVStoreClient, ucx_server: UcxServer) -> None:
    client = ucx_client(kv, ucx_server.ucx_address, retry_after_s=0.5)
    try:
        client._retry_at = time.monotonic() + 0.5  # as after a failure
        assert client.get(keys_of(1)) is None
        time.sleep(0.6)
        assert client.get(keys_of(1)) == [None]
    finally:
        client.close()


_DOOMED_CLIENT = textwrap.dedent(
    """
    import os, sys, numpy as np
    from kvstore import KVStoreClient, Namespace
    from kvstore._wire import namespace_bytes
    from kvstore.transport.ucx_client import UcxDataClient
    target, address, mode = sys.argv[1:4]
    ns = Namespace(model="ucx-test", num_layers=2, num_kv_heads=2, head_size=64)
    kv = KVStoreClient(target, namespace=ns)
    ucx = UcxDataClient(kv._channel, address, namespace_bytes(ns), timeout=30.0)
    keys = [os.urandom(16) for _ in range(16)]
    values = [np.full(4 * 1024**2, i, np.uint8) for i in range(16)]
    assert ucx.put(keys, values) is not None
    print("ready", flush=True)
    while True:
        if mode == "get":
            ucx.get_into(keys, values)
        else:
            ucx.put([os.urandom(16) for _ in keys], values)
    """
)


@pytest.mark.parametrize("mode", ["get", "put"])
def test_a_killed_client_does_not_wedge_the_server(
    mode: str, ucx: UcxDataClient, ucx_server: UcxServer, tmp_path: Path
) -> None:
    script = tmp_path / "doomed.py"
    script.write_text(_DOOMED_CLIENT)
    doomed = subprocess.Popen(
        [sys.executable, str(script), ucx_server.target, ucx_server.ucx_address, mode],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert doomed.stdout is not None
        assert doomed.stdout.readline().strip() == "ready"
        time.sleep(0.3)  # in the middle of its transfer loop
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
    assert ucx_server.alive()


def test_a_dead_server_fails_over_within_the_deadline(tmp_path: Path) -> None:
    server = UcxServer(tmp_path / "doomed-server")
    try:
        with KVStoreClient(server.target, namespace=NAMESPACE, timeout=3.0) as kv:
            client = ucx_client(kv, server.ucx_address, timeout=3.0)
            keys = keys_of(2)
            assert client.put(keys, values_of([1024**2, 1024**2])) is not None
            server.kill()
            started = time.monotonic()
            assert client.get_into(keys, [bytearray(1024**2), bytearray(1024**2)]) is None
            assert time.monotonic() - started < 3.0 + 5.0
            assert not client.usable
            client.close()
    finally:
        server.kill()


def test_server_stops_cleanly_with_clients_connected(tmp_path: Path) -> None:
    server = UcxServer(tmp_path / "stopping-server")
    try:
        with KVStoreClient(server.target, namespace=NAMESPACE) as kv:
            client = ucx_client(kv, server.ucx_address)
            assert client.put(keys_of(1), [b"q" * 4096]) is not None
            assert server.stop() == 0, server.log.read_text()
            assert '"put_transfers": 1' in server.out.read_text()
            client.close()
    finally:
        server.kill()
