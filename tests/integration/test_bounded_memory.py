"""Requests that used to grow a real ``kvstore serve`` without bound now get refused or bounded.

Each attack runs against a server with a small in-flight budget (16 MiB) and a small prefetch
queue, and checks the answer (status and message), the growth of the server's memory (VmRSS and
the peak VmHWM, reset through /proc/PID/clear_refs before the attack) and that afterwards the
server still serves every block stored before, bit-identical.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore import CapacityError, ChunkHasher, KVStoreClient, Namespace
from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore._proto.kvstore.v1 import kvstore_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from harness.serve import ServerProcess
    from harness.server_factory import ServerFactory

MiB = 1024**2
BUDGET = 16 * MiB
QUEUE_KEYS = 8192
SEEDS = 64  # 1 MiB blocks: 16 in dram, the rest on nvme
NS = Namespace(model="bounded-memory", num_layers=2, num_kv_heads=2, head_size=64)
FP = NS.fingerprint()
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
INVALID = grpc.StatusCode.INVALID_ARGUMENT


def chain(count: int, seed: int) -> list[bytes]:
    """``count`` valid chained keys in ``NS``."""
    tokens = np.random.default_rng(seed).integers(0, 32_000, size=count * 16)
    return list(ChunkHasher(chunk_size=16, namespace=NS).keys(tokens))


@dataclass
class Seeded:
    """The shared server and the blocks stored in it before any test ran."""

    server: ServerProcess
    keys: list[bytes]
    values: list[bytes]
    stub: pb_grpc.KVStoreStub

    def client(self) -> KVStoreClient:
        return KVStoreClient(self.server.target, namespace=NS, timeout=30, data_plane="grpc")


@pytest.fixture(scope="module")
def seeded(module_server_factory: ServerFactory) -> Iterator[Seeded]:
    """16 MiB dram + 128 MiB nvme, a 16 MiB in-flight budget; 64 MiB of seed blocks."""
    server = module_server_factory(
        "--max-block-bytes",
        "4MiB",
        dram_capacity="16MiB",
        nvme_capacity="128MiB",
        env={
            "KVSTORE_SERVER_INFLIGHT_BYTES": str(BUDGET),
            "KVSTORE_SERVER_PREFETCH_QUEUE_KEYS": str(QUEUE_KEYS),
        },
    )
    rng = np.random.default_rng(3)
    keys, values = chain(SEEDS, seed=1), [rng.bytes(MiB) for _ in range(SEEDS)]
    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    with grpc.insecure_channel(server.target, options=options) as channel:
        seeded = Seeded(server, keys, values, pb_grpc.KVStoreStub(channel))
        with seeded.client() as client:
            for start in range(0, SEEDS, 8):  # each put within the budget
                assert client.put(keys[start : start + 8], values[start : start + 8]).stored == 8
            assert client.lookup(keys) == SEEDS
        yield seeded


def assert_intact(seeded: Seeded) -> None:
    """The server answers health checks and every seed block reads back unchanged."""
    with grpc.insecure_channel(seeded.server.target) as channel:
        response = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=10
        )
    assert response.status == health_pb2.HealthCheckResponse.SERVING
    with seeded.client() as client:
        for start in range(0, SEEDS, 8):
            got = client.get(seeded.keys[start : start + 8])
            assert got == seeded.values[start : start + 8]
        assert client.stats()["counters"].get("evicted_from_store", 0) == 0


class Memory:
    """The server's resident memory around an attack, in bytes."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        # Writing 5 resets the peak (VmHWM) to the current RSS: the peak is then this attack's.
        with open(f"/proc/{pid}/clear_refs", "w") as handle:
            handle.write("5")
        self.before = self.field("VmRSS")

    def field(self, name: str) -> int:
        with open(f"/proc/{self.pid}/status") as handle:
            for line in handle:
                if line.startswith(name + ":"):
                    return int(line.split()[1]) * 1024
        raise AssertionError(f"no {name} in /proc/{self.pid}/status")

    def assert_growth_below(self, limit: int) -> None:
        peak, after = self.field("VmHWM") - self.before, self.field("VmRSS") - self.before
        assert peak < limit, f"peak grew by {peak / MiB:.1f} MiB (limit {limit / MiB:.0f} MiB)"
        assert after < limit, f"RSS grew by {after / MiB:.1f} MiB (limit {limit / MiB:.0f} MiB)"


def memory(seeded: Seeded) -> Memory:
    assert seeded.server.proc is not None
    return Memory(seeded.server.proc.pid)


def expect_status(code: grpc.StatusCode, fragment: str, call: Callable[[], Any]) -> str:
    """``call`` fails with exactly ``code`` and a message containing ``fragment``."""
    with pytest.raises(grpc.RpcError) as info:
        call()
    error: Any = info.value
    assert error.code() == code, error.details()
    assert fragment in error.details(), error.details()
    return str(error.details())


class Stream:
    """A Put stream of one-block messages, counting what the client handed to gRPC."""

    def __init__(self, keys: list[bytes], gate: threading.Event | None = None) -> None:
        self.keys = keys
        self.sent = 0
        self.gate = gate
        self.block = np.random.default_rng(5).bytes(MiB)

    def __iter__(self) -> Iterator[pb.PutRequest]:
        for key in self.keys:
            yield pb.PutRequest(namespace=FP, blocks=[pb.Block(key=key, value=self.block)])
            self.sent += 1
        if self.gate is not None:  # hold the stream open (and its blocks charged)
            self.gate.wait(30)


def test_put_stream_over_the_budget_is_refused_as_it_arrives(seeded: Seeded) -> None:
    keys = chain(200, seed=10)  # 200 MiB, twelve times the budget
    stream = Stream(keys)
    watch = memory(seeded)
    started = time.monotonic()
    expect_status(
        EXHAUSTED,
        f"the request passed {BUDGET} bytes (server.inflight_bytes) at value 16",
        lambda: seeded.stub.Put(iter(stream), timeout=30),
    )
    assert time.monotonic() - started < 5
    assert stream.sent < 100, "the server read the stream to its end before refusing"
    # The budget's 16 MiB, one message, and what the allocator keeps of the freed blocks (the
    # whole stream used to be held: 200 MiB and more).
    watch.assert_growth_below(BUDGET + 32 * MiB)
    with seeded.client() as client:
        assert client.lookup_tiers(keys[:20]).tiers == [""] * 20  # nothing of it was stored
        # The refused stream gave its charge back: a put of the whole budget goes through.
        assert client.put(keys[:16], [stream.block] * 16).stored == 16
        assert client.delete(keys[:16]) == 16
    assert_intact(seeded)


def test_concurrent_put_streams_share_one_budget(seeded: Seeded) -> None:
    gate = threading.Event()
    holder = Stream(chain(10, seed=11), gate)
    future = seeded.stub.Put.future(iter(holder), timeout=30)
    try:
        for _ in range(500):  # the holder's 10 MiB reach the server and stay charged
            if holder.sent == 10:
                break
            time.sleep(0.01)
        # Handed to gRPC is not yet received: on a loaded machine the server may not hold all
        # 10 MiB yet, and a second stream that fits beside what it holds goes through. Retry
        # (undoing what went through) until the shared budget refuses it.
        deadline = time.monotonic() + 20
        while True:
            second = Stream(chain(8, seed=12))
            try:
                seeded.stub.Put(iter(second), timeout=30)
            except grpc.RpcError as exc:
                error: Any = exc
                assert error.code() == EXHAUSTED, error.details()
                assert "server.inflight_bytes" in error.details(), error.details()
                break
            with seeded.client() as client:
                client.delete(second.keys)
            assert time.monotonic() < deadline, "the holder's bytes never counted in the budget"
            time.sleep(0.05)
    finally:
        gate.set()
    assert future.result(timeout=30).stored == 10
    with seeded.client() as client:
        assert client.lookup_tiers(second.keys).tiers == [""] * 8
        # Both charges are back: the refused stream goes through now.
        assert client.put(second.keys, [second.block] * 8).stored == 8
        assert client.delete([*holder.keys, *second.keys]) == 18
    assert_intact(seeded)


def test_get_naming_a_key_many_times_reads_it_once_a_window(seeded: Seeded) -> None:
    key = seeded.keys[0]  # on nvme: each naming used to be read (and copied) before any reply
    watch = memory(seeded)
    request = pb.GetRequest(namespace=FP, keys=[seeded.keys[1], *[key] * 127])
    count = 0
    for response in seeded.stub.Get(request, timeout=30):
        for result in response.results:
            assert result.index == count
            assert result.value == (seeded.values[1] if count == 0 else seeded.values[0])
            count += 1
    assert count == 128
    # 128 MiB answered; a window (16 MiB) is read and sent at a time.
    watch.assert_growth_below(56 * MiB)
    assert_intact(seeded)


def test_get_of_many_blocks_is_read_in_a_bounded_window(seeded: Seeded) -> None:
    watch = memory(seeded)
    request = pb.GetRequest(namespace=FP, keys=seeded.keys)
    results = [r for response in seeded.stub.Get(request, timeout=30) for r in response.results]
    assert [r.index for r in results] == list(range(SEEDS))
    assert [r.value for r in results] == seeded.values
    del results
    # 64 MiB answered (48 of it read from nvme; all of it used to be read at once, 80 MiB and
    # more): a window is 16 MiB, plus the messages in flight and the allocator's slack.
    watch.assert_growth_below(56 * MiB)
    assert_intact(seeded)


def wait_done(stub: pb_grpc.KVStoreStub, prefetch_id: int) -> pb.PrefetchStatusResponse:
    request = pb.PrefetchStatusRequest(prefetch_id=prefetch_id)
    for _ in range(3000):
        status = stub.PrefetchStatus(request, timeout=10)
        if status.state in (pb.PREFETCH_STATE_DONE, pb.PREFETCH_STATE_CANCELLED):
            return status
        time.sleep(0.01)
    raise AssertionError(f"prefetch {prefetch_id} not finished")


def test_prefetch_flood_is_refused_beyond_the_queue(seeded: Seeded) -> None:
    # Each asks for every seed (64 MiB to move through a 16 MiB dram) and 4,032 absent keys:
    # two fill the queue, and forty arrive at once.
    request = pb.PrefetchRequest(namespace=FP, keys=[*seeded.keys, *chain(4032, seed=21)])
    futures = [seeded.stub.Prefetch.future(request, timeout=30) for _ in range(40)]
    accepted, refused = [], []
    for future in futures:
        with contextlib.suppress(grpc.RpcError):
            accepted.append(future.result().prefetch_id)
            continue
        error: Any = future.exception()
        assert error.code() == EXHAUSTED, error.details()
        assert "server.prefetch_queue_keys" in error.details()
        refused.append(error)
    assert accepted, "no prefetch was accepted"
    assert refused, "forty prefetches of 4,096 keys fitted a queue of 8,192 keys"
    for prefetch_id in accepted:
        assert wait_done(seeded.stub, prefetch_id).total == len(request.keys)
    assert_intact(seeded)


def test_finished_prefetches_keep_no_keys(seeded: Seeded) -> None:
    watch = memory(seeded)
    first = 0
    for n in range(60):  # 60 x 8,192 keys: about 30 MiB if each finished job kept its list
        request = pb.PrefetchRequest(namespace=FP, keys=chain(8192, seed=100 + n))
        prefetch_id = seeded.stub.Prefetch(request, timeout=30).prefetch_id
        first = first or prefetch_id
        wait_done(seeded.stub, prefetch_id)
    status = seeded.stub.PrefetchStatus(pb.PrefetchStatusRequest(prefetch_id=first), timeout=10)
    assert (status.state, status.total, status.missing) == (pb.PREFETCH_STATE_DONE, 8192, 8192)
    watch.assert_growth_below(12 * MiB)
    assert_intact(seeded)


def test_a_put_larger_than_the_budget_goes_as_several_streams(
    server_factory: ServerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client splits a gRPC put into streams of at most PUT_STREAM_BYTES (32 MiB), so one put
    of more than ``server.inflight_bytes`` is stored whole instead of refused."""
    import kvstore.client.core as core

    server = server_factory(
        "--max-block-bytes",
        "4MiB",
        dram_capacity="128MiB",
        nvme_capacity="128MiB",
        env={"KVSTORE_SERVER_INFLIGHT_BYTES": str(40 * MiB)},
    )
    keys = chain(48, seed=7)
    rng = np.random.default_rng(7)
    values = [rng.bytes(MiB) for _ in keys]  # 48 MiB: streams of 32 and 16 MiB
    with KVStoreClient(server.target, namespace=NS, timeout=30, data_plane="grpc") as client:
        with monkeypatch.context() as patch:
            patch.setattr(core, "PUT_STREAM_BYTES", 1024 * MiB)  # one stream: refused whole
            with pytest.raises(CapacityError, match="inflight_bytes"):
                client.put(keys, values)
        assert client.lookup(keys) == 0
        assert client.put(keys, values).stored == 48
        assert client.get(keys) == values


def test_a_stalled_put_stream_gives_its_budget_back(server_factory: ServerFactory) -> None:
    """A client that sends part of a Put and then stalls holds its charge only until
    ``server.put_stream_timeout_s``; then the call ends and others get the budget."""
    server = server_factory(
        env={
            "KVSTORE_SERVER_INFLIGHT_BYTES": str(BUDGET),
            "KVSTORE_SERVER_PUT_STREAM_TIMEOUT_S": "1",
        }
    )
    gate = threading.Event()
    holder = Stream(chain(12, seed=31), gate)
    with grpc.insecure_channel(server.target) as channel:
        future = pb_grpc.KVStoreStub(channel).Put.future(iter(holder), timeout=30)
        try:
            with pytest.raises(grpc.RpcError) as info:
                future.result(timeout=20)
        finally:
            gate.set()
    error: Any = info.value
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED, error.details()
    assert "server.put_stream_timeout_s" in error.details()
    with KVStoreClient(server.target, namespace=NS, timeout=30, data_plane="grpc") as client:
        assert client.lookup(holder.keys) == 0  # nothing of the stalled stream was stored
        # Its 12 MiB charge came back: a put of the whole budget goes through at once.
        keys = chain(16, seed=32)
        assert client.put(keys, [holder.block] * 16).stored == 16
