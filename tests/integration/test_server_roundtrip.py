"""Round trips through a real ``kvstore serve`` subprocess: clients, processes, restarts, CLI.

Tests that only add blocks under keys of their own share one server (``shared``); tests that
restart, corrupt or stop a server start their own.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import lmdb
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from harness.block_forgery import rewrite_payload

from kvstore import (
    AsyncKVStoreClient,
    ChunkHasher,
    DeadlineExceededError,
    KVStoreClient,
    Namespace,
    StoreUnavailableError,
)
from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore._proto.kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.block import HEADER_BYTES

if TYPE_CHECKING:
    from harness.serve import ServerProcess
    from harness.server_factory import ServerFactory

KiB = 1024
MiB = 1024**2
NS = Namespace(model="roundtrip", num_layers=4, num_kv_heads=2, head_size=64, dtype="bfloat16")
CLI_TIMEOUT_S = 60


def make_blocks(
    seed: int, count: int, size: int, namespace: Namespace = NS, chunk_size: int = 16
) -> tuple[list[bytes], list[bytes]]:
    """``count`` chained keys of a random prompt and as many random ``size``-byte blocks."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 32_000, size=count * chunk_size)
    keys = ChunkHasher(chunk_size=chunk_size, namespace=namespace).keys(tokens)
    return list(keys), [rng.bytes(size) for _ in keys]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``kvstore ARGS`` through the installed console script (``python -m`` where there is none)."""
    script = Path(sys.executable).with_name("kvstore")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "kvstore.cli"]
    return subprocess.run(
        [*command, *args], capture_output=True, text=True, timeout=CLI_TIMEOUT_S, check=False
    )


@pytest.fixture(scope="module")
def shared(module_server_factory: ServerFactory) -> ServerProcess:
    """One server for the tests that only touch keys of their own."""
    return module_server_factory(dram_capacity="48MiB", nvme_capacity="64MiB")


# -- the clients ------------------------------------------------------------------------------


@pytest.mark.each_plane
def test_sync_client_put_lookup_get_delete_stats(shared: ServerProcess) -> None:
    keys, values = make_blocks(1, 6, 64 * KiB)
    with KVStoreClient(shared.target, namespace=NS) as client:
        before = client.stats()
        assert client.lookup(keys) == 0
        assert client.get(keys) == [None] * 6

        # Store chunks 0-2 and 4: lookup counts only the leading run.
        first = client.put(keys[:3] + keys[4:5], values[:3] + values[4:5])
        assert (first.stored, first.already_present, first.dropped) == (4, 0, 0)
        assert client.lookup(keys) == 3
        tiers = client.lookup_tiers(keys)
        assert tiers.hits == 3
        assert [bool(tier) for tier in tiers.tiers] == [True, True, True, False, True, False]
        assert set(tiers.tiers) - {""} <= {"dram", "nvme"}

        again = client.put(keys, values)
        assert (again.stored, again.already_present) == (2, 4)
        assert client.lookup(keys) == 6
        assert client.get(keys) == values
        assert client.get([keys[5], keys[0]]) == [values[5], values[0]]

        stats = client.stats()
        assert {"dram", "nvme"} <= set(stats["tiers"])
        assert stats["blocks"] >= before["blocks"] + 6
        counters, previous = stats["counters"], before["counters"]
        assert counters["blocks_put"] - previous.get("blocks_put", 0) == 6
        assert counters["misses"] - previous.get("misses", 0) == 6  # the first get
        assert counters["hits"] - previous.get("hits", 0) == 8
        dram = stats["tiers"]["dram"]
        assert 0 < dram["used"] <= dram["capacity"]
        # What holds the node's memory (kvstore.server.memory; the soak samples these).
        assert counters["background_tasks"] >= 0 and counters["shared_write_pending_keys"] == 0
        assert counters["asyncio_tasks"] > 0
        if sys.platform == "linux":  # glibc's heap account
            assert counters["malloc_in_use_bytes"] > 0 and "malloc_free_bytes" in counters

        assert client.delete(keys[:2]) == 2
        assert client.delete(keys[:2]) == 0
        assert client.lookup(keys) == 0
        assert client.get(keys) == [None, None, *values[2:]]
        assert client.stats()["blocks"] == stats["blocks"] - 2


@pytest.mark.each_plane
async def test_async_client_put_lookup_get_delete_stats(shared: ServerProcess) -> None:
    keys, values = make_blocks(2, 5, 100 * KiB + 3)
    async with AsyncKVStoreClient(shared.target, namespace=NS) as client:
        assert await client.lookup(keys) == 0
        result = await client.put(keys, values)
        assert (result.stored, result.already_present, result.dropped) == (5, 0, 0)
        assert await client.lookup(keys) == 5
        assert (await client.lookup_tiers(keys)).hits == 5

        # Several calls in flight on one channel at once.
        reads = await asyncio.gather(*(client.get([key]) for key in keys), client.get(keys))
        assert [read[0] for read in reads[:-1]] == values
        assert reads[-1] == values

        buffers = [np.zeros(len(value), dtype=np.uint8) for value in values]
        assert await client.get_into(keys, buffers) == [True] * 5
        assert [buffer.tobytes() for buffer in buffers] == values

        stats = await client.stats()
        assert stats["blocks"] >= 5
        assert stats["counters"]["puts"] >= 1

        assert await client.delete(keys[3:]) == 2
        assert await client.lookup(keys) == 3
        assert await client.get(keys) == [*values[:3], None, None]


# -- one process puts, another reads --------------------------------------------------------

CROSS_PROCESS = textwrap.dedent(
    """
    import hashlib
    import sys

    import numpy as np

    from kvstore import ChunkHasher, KVStoreClient, Namespace


    def derive(seed):
        rng = np.random.default_rng(seed)
        namespace = Namespace(model="cross-process", dtype="bfloat16", tenant=f"tenant-{seed}")
        tokens = rng.integers(0, 50_000, size=16 * 7)
        keys = ChunkHasher(chunk_size=16, namespace=namespace).keys(tokens)
        sizes = [1, 4096, 65_537, 300_000, 1_048_576, 7, 123_457]
        return namespace, keys, [rng.bytes(size) for size in sizes]


    if __name__ == "__main__":
        role, target, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
        namespace, keys, values = derive(seed)
        with KVStoreClient(target, namespace=namespace, timeout=20) as client:
            if role == "put":
                result = client.put(keys, values)
                print(f"stored {result.stored}")
            else:
                got = client.get(keys)
                assert got == values, "read back differs from what was put"
                print("identical " + hashlib.sha256(b"".join(got)).hexdigest())
    """
)


def _cross_process(role: str, target: str, seed: int) -> str:
    done = subprocess.run(
        [sys.executable, "-c", CROSS_PROCESS, role, target, str(seed)],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, f"{role} process failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout.strip()


@pytest.mark.each_plane
def test_block_put_by_one_process_reads_back_identical_in_others(shared: ServerProcess) -> None:
    seed = 20240607
    assert _cross_process("put", shared.target, seed) == "stored 7"
    # This process derives keys and blocks on its own and reads what the writer stored.
    scope: dict[str, Any] = {"__name__": "cross_process"}
    exec(CROSS_PROCESS, scope)
    namespace, keys, values = scope["derive"](seed)
    with KVStoreClient(shared.target, namespace=namespace) as client:
        assert client.lookup(keys) == 7
        got = client.get(keys)
    assert got == values
    digest = hashlib.sha256(b"".join(values)).hexdigest()
    assert _cross_process("get", shared.target, seed) == f"identical {digest}"


# -- values of every buffer kind ------------------------------------------------------------


@pytest.mark.each_plane
def test_values_as_bytes_numpy_and_torch_roundtrip(shared: ServerProcess) -> None:
    import torch

    rng = np.random.default_rng(3)
    generator = torch.Generator().manual_seed(3)
    array16 = rng.standard_normal((8, 2, 16, 64)).astype(np.float16)
    array32 = rng.standard_normal((3, 1000)).astype(np.float32)
    tensor32 = torch.randn(2, 16, 128, generator=generator)
    tensor_bf16 = torch.randn(4, 2, 16, 64, generator=generator).to(torch.bfloat16)
    raw = rng.bytes(10_001)
    values: list[Any] = [
        raw,
        bytearray(raw[:999]),
        memoryview(raw)[5:4005],
        array16,
        array32,
        tensor32,
        tensor_bf16,
    ]
    expected = [
        raw,
        raw[:999],
        raw[5:4005],
        array16.tobytes(),
        array32.tobytes(),
        tensor32.numpy().tobytes(),
        tensor_bf16.view(torch.uint8).numpy().tobytes(),
    ]
    keys, _ = make_blocks(3, len(values), 1)
    with KVStoreClient(shared.target, namespace=NS) as client:
        assert client.put(keys, values).stored == len(values)
        assert client.get(keys) == expected

        # Typed destinations come back equal to the originals.
        out16 = np.empty_like(array16)
        out32 = torch.empty_like(tensor32)
        out_bf16 = torch.empty_like(tensor_bf16)
        assert client.get_into([keys[3], keys[5], keys[6]], [out16, out32, out_bf16]) == [True] * 3
    np.testing.assert_array_equal(out16, array16)
    assert torch.equal(out32, tensor32)
    assert torch.equal(out_bf16, tensor_bf16)


@pytest.mark.each_plane
def test_get_into_fills_numpy_buffers(shared: ServerProcess) -> None:
    keys, values = make_blocks(4, 4, 96 * KiB)
    with KVStoreClient(shared.target, namespace=NS) as client:
        client.put(keys[:3], values[:3])
        buffers = [np.full(96 * KiB, 0xAB, dtype=np.uint8) for _ in range(3)]
        wrong_size = np.full(96 * KiB - 1, 0xCD, dtype=np.uint8)
        missing = np.full(96 * KiB, 0xEF, dtype=np.uint8)
        filled = client.get_into(keys, [buffers[0], buffers[1], wrong_size, missing])
    assert filled == [True, True, False, False]
    assert buffers[0].tobytes() == values[0]
    assert buffers[1].tobytes() == values[1]
    # A miss or a size mismatch leaves the destination untouched.
    assert (wrong_size == 0xCD).all()
    assert (missing == 0xEF).all()


@pytest.mark.each_plane
def test_large_batch_spans_several_streamed_messages(shared: ServerProcess) -> None:
    keys, values = make_blocks(5, 40, 512 * KiB)
    with KVStoreClient(shared.target, namespace=NS, timeout=60) as client:
        assert client.put(keys, values).stored == 40
        assert client.lookup(keys) == 40
        assert client.get(keys) == values

    # The same Get over a raw stub: the reply is really split across messages, in order.
    options = [("grpc.max_receive_message_length", -1)]
    with grpc.insecure_channel(shared.target, options=options) as channel:
        stub = pb_grpc.KVStoreStub(channel)
        request = pb.GetRequest(namespace=NS.fingerprint(), keys=keys)
        responses = list(stub.Get(request, timeout=60))
    assert len(responses) >= 4
    results = [result for response in responses for result in response.results]
    assert [result.index for result in results] == list(range(40))
    assert all(result.found for result in results)
    assert [result.value for result in results] == values


@pytest.mark.each_plane
async def test_large_batch_async_reads_back_intact(shared: ServerProcess) -> None:
    keys, values = make_blocks(6, 24, 512 * KiB + 17)
    async with AsyncKVStoreClient(shared.target, namespace=NS, timeout=60) as client:
        assert (await client.put(keys, values)).stored == 24
        assert await client.get(keys) == values


# -- restarts and corruption ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("dram", "stop"),
    [("1MiB", "sigterm"), ("0", "sigterm"), ("0", "sigkill"), ("1MiB", "sigkill")],
    ids=["small-dram", "no-dram", "no-dram-killed", "small-dram-killed"],
)
def test_restart_on_same_nvme_dir_keeps_nvme_blocks(
    server_factory: ServerFactory, dram: str, stop: str
) -> None:
    server = server_factory(dram_capacity=dram, nvme_capacity="32MiB")
    keys, values = make_blocks(7, 12, 256 * KiB)
    with server.client(NS) as client:
        assert client.put(keys, values).stored == 12
        tiers = client.lookup_tiers(keys).tiers
    on_nvme = [tier == "nvme" for tier in tiers]
    # 1 MiB of dram holds four 256 KiB blocks; the eight older ones were demoted to nvme.
    assert sum(on_nvme) == (8 if dram == "1MiB" else 12)

    if stop == "sigkill":
        server.kill()
    else:
        server.stop(signal.SIGTERM)
    server.start()

    # A graceful stop also saves what was only in dram; a killed server keeps what was on nvme.
    kept = on_nvme if stop == "sigkill" else [True] * len(keys)
    with server.client(NS) as client:
        stats = client.stats()
        assert stats["tiers"]["nvme"]["blocks"] == sum(kept)
        assert stats["blocks"] == sum(kept)
        assert client.lookup(keys) == sum(kept)  # the nvme blocks are the leading ones
        got = client.get(keys)
        assert [value is not None for value in got] == kept
        assert all(g == v for g, v, k in zip(got, values, kept, strict=True) if k)
        # The restarted store takes new blocks beside the old ones.
        more_keys, more_values = make_blocks(8, 3, 64 * KiB)
        assert client.put(more_keys, more_values).stored == 3
        assert client.get(more_keys) == more_values
        assert client.stats()["tiers"]["nvme"]["corrupt_blocks"] == 0


def _damage_payload(value: bytearray) -> bytearray:
    value[HEADER_BYTES + 1234] ^= 0x10  # one bit of the payload
    return value


def _damage_mac(value: bytearray) -> bytearray:
    value[63] ^= 0x01  # one bit of the header's MAC
    return value


def _forge_v1(value: bytearray) -> bytearray:
    # Another user rewrites the file: new payload, old format with a correct plain checksum.
    return bytearray(rewrite_payload(bytes(value), "v1"))


def _forge_mac(value: bytearray) -> bytearray:
    # ... or a well-formed version-2 header signed with a secret that is not the server's.
    return bytearray(rewrite_payload(bytes(value), "mac"))


def _truncate(value: bytearray) -> bytearray:
    return value[:-1]


@pytest.mark.parametrize(
    "damage",
    [_damage_payload, _damage_mac, _truncate, _forge_v1, _forge_mac],
    ids=["payload-bit", "mac-bit", "truncated", "forged-v1-checksum", "forged-mac"],
)
def test_corrupted_lmdb_value_becomes_a_miss_after_restart(
    server_factory: ServerFactory, damage: Any
) -> None:
    server = server_factory(dram_capacity="0", nvme_capacity="32MiB")
    keys, values = make_blocks(9, 6, 64 * KiB)
    with server.client(NS) as client:
        assert client.put(keys, values).stored == 6
    server.stop()

    env = lmdb.open(str(server.nvme_path), map_size=32 * MiB, subdir=True)
    try:
        with env.begin(write=True) as txn:
            stored = txn.get(keys[2])
            assert stored is not None and len(stored) == HEADER_BYTES + len(values[2])
            assert stored[HEADER_BYTES:] == values[2]
            txn.put(keys[2], bytes(damage(bytearray(stored))))
    finally:
        env.close()

    server.start()
    with server.client(NS) as client:
        got = client.get(keys)
        assert got[2] is None, "a corrupted block was returned"
        assert got[:2] == values[:2]
        assert got[3:] == values[3:]
        stats = client.stats()
        assert stats["tiers"]["nvme"]["corrupt_blocks"] == 1
        assert stats["blocks"] == 5
        assert client.lookup(keys) == 2
        assert client.lookup_tiers(keys).tiers[2] == ""
        # The key is usable again: a fresh put of it stores and reads back.
        assert client.put([keys[2]], [values[2]]).stored == 1
        assert client.get(keys) == values
        assert client.stats()["tiers"]["nvme"]["corrupt_blocks"] == 1


# -- lifecycle ------------------------------------------------------------------------------


@pytest.mark.each_plane
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_signal_shuts_down_gracefully_after_serving_health(
    server_factory: ServerFactory, sig: signal.Signals
) -> None:
    server = server_factory()
    with grpc.insecure_channel(server.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "kvstore.v1.KVStore"):
            request = health_pb2.HealthCheckRequest(service=service)
            response = health.Check(request, timeout=5)
            assert response.status == health_pb2.HealthCheckResponse.SERVING
    keys, values = make_blocks(10, 2, 4 * KiB)
    with server.client(NS) as client:
        client.put(keys, values)
        started = time.monotonic()
        assert server.stop(sig) == 0  # with a client connection still open
        assert time.monotonic() - started < 10
        with pytest.raises(StoreUnavailableError):
            client.lookup(keys, timeout=5)
    assert "kvstore stopped" in server.stderr()
    assert "Traceback" not in server.stderr()


def test_stats_cli_json_and_table(shared: ServerProcess) -> None:
    keys, values = make_blocks(11, 2, 8 * KiB)
    with KVStoreClient(shared.target, namespace=NS) as client:
        client.put(keys, values)
        blocks = client.stats()["blocks"]

    done = run_cli("stats", "--target", shared.target, "--json")
    assert done.returncode == 0, done.stderr
    stats = json.loads(done.stdout)
    assert set(stats) == {"tiers", "counters", "blocks"}
    assert stats["blocks"] == blocks
    for tier in ("dram", "nvme"):
        for field in ("capacity", "used", "blocks", "hits", "evictions"):
            assert isinstance(stats["tiers"][tier][field], int), (tier, field)
    assert "corrupt_blocks" in stats["tiers"]["nvme"]
    assert "wasted_bytes" in stats["tiers"]["dram"]
    assert stats["counters"]["puts"] >= 1

    done = run_cli("stats", "--target", shared.target)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    header = ["tier", "used", "capacity", "blocks", "hits", "hit", "rate", "evictions"]
    assert lines[0].split() == header
    assert lines[1].startswith("dram") and lines[2].startswith("nvme")
    assert f"blocks {blocks}" in done.stdout


def test_stats_cli_without_server_fails_cleanly(unused_target: str) -> None:
    done = run_cli("stats", "--target", unused_target, "--timeout", "3")
    assert done.returncode == 2
    assert "UNAVAILABLE" in done.stderr
    assert "Traceback" not in done.stderr


def test_demo_cli_against_the_server(shared: ServerProcess) -> None:
    done = run_cli("demo", "--target", shared.target, "--wait", "10")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "demo OK" in done.stdout
    assert "identical=False" not in done.stdout


# -- failures of the transport --------------------------------------------------------------


@pytest.mark.each_plane
def test_no_server_raises_unavailable_within_deadline(unused_target: str) -> None:
    keys, values = make_blocks(12, 1, 16)
    with KVStoreClient(unused_target, namespace=NS, timeout=3.0) as client:
        calls = {
            "lookup": lambda: client.lookup(keys),
            "get": lambda: client.get(keys),
            "put": lambda: client.put(keys, values),
            "delete": lambda: client.delete(keys),
            "stats": client.stats,
        }
        for name, call in calls.items():
            started = time.monotonic()
            with pytest.raises(StoreUnavailableError):
                call()
            assert time.monotonic() - started < 3.5, name


@pytest.mark.each_plane
async def test_no_server_raises_unavailable_within_deadline_async(unused_target: str) -> None:
    keys, _ = make_blocks(12, 1, 16)
    async with AsyncKVStoreClient(unused_target, namespace=NS, timeout=3.0) as client:
        started = time.monotonic()
        with pytest.raises(StoreUnavailableError):
            await client.get(keys)
        with pytest.raises(StoreUnavailableError):
            await client.lookup(keys)
        assert time.monotonic() - started < 7


@pytest.mark.each_plane
def test_killed_server_raises_unavailable(server: ServerProcess, client: KVStoreClient) -> None:
    keys, values = make_blocks(13, 2, 4 * KiB)
    client.put(keys, values)
    assert client.get(keys) == values
    server.kill()
    started = time.monotonic()
    with pytest.raises(StoreUnavailableError):
        client.get(keys, timeout=3.0)
    assert time.monotonic() - started < 3.5


@pytest.mark.each_plane
def test_tiny_deadline_raises_deadline_exceeded(shared: ServerProcess) -> None:
    # gRPC enforces deadlines at about millisecond resolution, so a sub-millisecond unary call
    # may still beat timeout=1e-6; moving 8 MiB cannot.
    keys, values = make_blocks(14, 16, 512 * KiB)
    with KVStoreClient(shared.target, namespace=NS, timeout=30) as client:
        client.stats()  # connected, so the deadline and not the connection is what fails
        with pytest.raises(DeadlineExceededError, match="deadline exceeded"):
            client.put(keys, values, timeout=1e-6)
        client.put(keys, values)
        with pytest.raises(DeadlineExceededError):
            client.get(keys, timeout=1e-6)
        # The client and the server are fine afterwards.
        assert client.get(keys) == values


@pytest.mark.each_plane
async def test_tiny_deadline_raises_deadline_exceeded_async(shared: ServerProcess) -> None:
    keys, values = make_blocks(15, 16, 512 * KiB)
    async with AsyncKVStoreClient(shared.target, namespace=NS, timeout=30) as client:
        await client.stats()
        with pytest.raises(DeadlineExceededError):
            await client.put(keys, values, timeout=1e-6)
        await client.put(keys, values)
        with pytest.raises(DeadlineExceededError):
            await client.get(keys, timeout=1e-6)
        assert await client.get(keys) == values


@pytest.mark.each_plane
def test_every_call_of_a_stalled_server_raises_deadline_exceeded_but_dram_reads_over_shm(
    server_factory: ServerFactory, data_plane: str
) -> None:
    server = server_factory()
    assert server.proc is not None
    keys, values = make_blocks(18, 2, 4 * KiB)
    with server.client(NS, timeout=0.3) as client:
        client.put(keys, values)
        assert client.data_plane == ("shm" if data_plane == "auto" else "grpc")
        calls = {
            "lookup": lambda: client.lookup(keys),
            "get": lambda: client.get(keys),
            "put": lambda: client.put(keys, values),
            "delete": lambda: client.delete(keys),
            "stats": client.stats,
        }
        server.proc.send_signal(signal.SIGSTOP)  # connected, but the server answers nothing
        try:
            for name, call in calls.items():
                started = time.monotonic()
                if name in ("lookup", "get") and client.data_plane == "shm":
                    # Blocks in dram are found and read through the published index, which a
                    # stopped server cannot change: they are still served, and correctly.
                    assert call() == (2 if name == "lookup" else values)
                else:
                    with pytest.raises(DeadlineExceededError):
                        call()
                assert time.monotonic() - started < 1.5, name
        finally:
            server.proc.send_signal(signal.SIGCONT)
        client.put(keys, values, timeout=10)  # the stalled delete may or may not have run
        assert client.get(keys, timeout=10) == values


# -- a small --max-block-bytes --------------------------------------------------------------


@pytest.mark.each_plane
def test_batched_put_of_valid_blocks_under_small_block_limit(
    server_factory: ServerFactory,
) -> None:
    server = server_factory("--max-block-bytes", "1MiB")
    keys, values = make_blocks(16, 8, 512 * KiB)  # 4 MiB in all, every block under the limit
    with server.client(NS) as client:
        assert client.put(keys, values).stored == 8


@pytest.mark.each_plane
def test_batched_get_of_valid_blocks_under_small_block_limit(
    server_factory: ServerFactory,
) -> None:
    server = server_factory("--max-block-bytes", "1MiB")
    keys, values = make_blocks(17, 8, 512 * KiB)
    # Store one block per message, which stays under the server's limit...
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.KVStoreStub(channel)
        requests = [
            pb.PutRequest(namespace=NS.fingerprint(), blocks=[pb.Block(key=key, value=value)])
            for key, value in zip(keys, values, strict=True)
        ]
        assert stub.Put(iter(requests), timeout=30).stored == 8
    # ...then read the batch back: the server packs 4 MiB into one reply message.
    with server.client(NS) as client:
        assert client.get(keys) == values


def test_delete_only_removes_blocks_of_the_callers_namespace(server_factory: ServerFactory) -> None:
    server = server_factory()
    keys, values = make_blocks(23, 3, 4 * KiB)
    other = Namespace(model="another-model")
    with server.client(NS) as owner, server.client(other) as stranger:
        assert owner.put(keys, values).stored == 3
        assert stranger.delete(keys) == 0
        assert owner.get(keys) == values
        assert owner.delete(keys[:1]) == 1
        assert owner.get(keys) == [None, *values[1:]]
