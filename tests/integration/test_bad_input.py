"""Bad input against a real ``kvstore serve``: the right status, a message that says what was
wrong, and afterwards a server that still serves with every stored block unchanged.

Each test sends its bad input both through a raw gRPC stub (which reaches the server even where
the client would refuse earlier) and through :class:`KVStoreClient` (which must raise the matching
exception class), then calls :func:`assert_intact`. The server is shared by the module; it holds
seed blocks in two namespaces, spread over ``dram`` and ``nvme``, that no test may disturb.

Input the client sends over gRPC whatever its plane (no keys, too many, keys or a namespace of the
wrong length) and raw messages are tested once; input the shared-memory plane carries itself
(values, key/value counts, namespace clashes) is tested on each plane (``each_plane``).
"""

from __future__ import annotations

import contextlib
import re
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore import (
    CapacityError,
    ChunkHasher,
    InvalidRequestError,
    KVStoreClient,
    Namespace,
    NamespaceMismatchError,
)
from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore._proto.kvstore.v1 import kvstore_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from harness.serve import ServerProcess
    from harness.server_factory import ServerFactory

KiB = 1024
MiB = 1024**2
MAX_KEYS = 16
MAX_BLOCK = 8 * MiB
NS_A = Namespace(model="bad-input-a", num_layers=2, num_kv_heads=2, head_size=64)
NS_B = Namespace(model="bad-input-b", num_layers=2, num_kv_heads=2, head_size=64)
FP_A = NS_A.fingerprint()
FP_B = NS_B.fingerprint()
INVALID = grpc.StatusCode.INVALID_ARGUMENT
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


def chain(namespace: Namespace, count: int, seed: int) -> list[bytes]:
    """``count`` valid chained keys in ``namespace``."""
    tokens = np.random.default_rng(seed).integers(0, 32_000, size=count * 16)
    return list(ChunkHasher(chunk_size=16, namespace=namespace).keys(tokens))


@dataclass
class Seeded:
    """The shared server and the blocks stored in it before any test ran."""

    server: ServerProcess
    keys_a: list[bytes]
    values_a: list[bytes]
    keys_b: list[bytes]
    values_b: list[bytes]

    @property
    def target(self) -> str:
        return self.server.target

    def client(self, namespace: Namespace | bytes = NS_A) -> KVStoreClient:
        return KVStoreClient(self.target, namespace=namespace, timeout=30)


@pytest.fixture(scope="module")
def seeded(module_server_factory: ServerFactory) -> Seeded:
    """2 MiB dram + 8 MiB nvme, blocks up to 8 MiB, 16 keys a request; 3.5 MiB of seed blocks."""
    server = module_server_factory(
        "--max-block-bytes",
        "8MiB",
        dram_capacity="2MiB",
        nvme_capacity="8MiB",
        env={"KVSTORE_SERVER_MAX_KEYS_PER_REQUEST": str(MAX_KEYS)},
    )
    rng = np.random.default_rng(7)
    seeded = Seeded(
        server,
        chain(NS_A, 12, seed=1),
        [rng.bytes(256 * KiB) for _ in range(12)],
        chain(NS_B, 3, seed=2),
        [rng.bytes(100 * KiB + i) for i in range(3)],
    )
    with seeded.client(NS_A) as client:
        assert client.put(seeded.keys_a, seeded.values_a).stored == 12
        tiers = client.lookup_tiers(seeded.keys_a).tiers
    with seeded.client(NS_B) as client:
        assert client.put(seeded.keys_b, seeded.values_b).stored == 3
    assert {"dram", "nvme"} <= set(tiers), tiers  # the seed spans both tiers
    return seeded


def assert_intact(seeded: Seeded) -> None:
    """The server answers health checks and every seed block reads back unchanged."""
    with grpc.insecure_channel(seeded.target) as channel:
        response = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=10
        )
    assert response.status == health_pb2.HealthCheckResponse.SERVING
    for namespace, keys, values in (
        (NS_A, seeded.keys_a, seeded.values_a),
        (NS_B, seeded.keys_b, seeded.values_b),
    ):
        with seeded.client(namespace) as client:
            assert client.lookup(keys) == len(keys)
            got = client.get(keys)
            assert [g == v for g, v in zip(got, values, strict=True)] == [True] * len(keys)
    with seeded.client() as client:
        stats = client.stats()
    assert stats["counters"].get("evicted_from_store", 0) == 0, "a block left the store"
    assert stats["counters"].get("put_dropped", 0) == 0
    assert stats["tiers"]["nvme"]["corrupt_blocks"] == 0


def assert_absent(seeded: Seeded, namespace: Namespace, keys: list[bytes]) -> None:
    """None of ``keys`` was stored (a refused request stores nothing, not even its good part)."""
    with seeded.client(namespace) as client:
        assert client.lookup_tiers(keys).tiers == [""] * len(keys)
        assert client.get(keys) == [None] * len(keys)


@pytest.fixture(scope="module")
def stub(seeded: Seeded) -> Iterator[pb_grpc.KVStoreStub]:
    """A raw stub that lets any message size out, so the server's own limits are what bite."""
    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    with grpc.insecure_channel(seeded.target, options=options) as channel:
        yield pb_grpc.KVStoreStub(channel)


def expect_status(code: grpc.StatusCode, fragment: str, call: Callable[[], Any]) -> str:
    """``call`` fails with exactly ``code`` and a message containing ``fragment``."""
    with pytest.raises(grpc.RpcError) as info:
        call()
    error: Any = info.value
    assert error.code() == code, error.details()
    assert fragment in error.details(), error.details()
    return str(error.details())


def raw_put(stub: pb_grpc.KVStoreStub, *messages: pb.PutRequest) -> pb.PutResponse:
    return stub.Put(iter(messages), timeout=30)


def put_message(namespace: bytes, keys: list[bytes], values: list[bytes]) -> pb.PutRequest:
    blocks = [pb.Block(key=k, value=v) for k, v in zip(keys, values, strict=True)]
    return pb.PutRequest(namespace=namespace, blocks=blocks)


def raw_get(stub: pb_grpc.KVStoreStub, namespace: bytes, keys: list[bytes]) -> list[pb.GetResult]:
    request = pb.GetRequest(namespace=namespace, keys=keys)
    return [result for response in stub.Get(request, timeout=30) for result in response.results]


def raw_lookup(stub: pb_grpc.KVStoreStub, namespace: bytes, keys: list[bytes]) -> Any:
    return stub.Lookup(pb.LookupRequest(namespace=namespace, keys=keys), timeout=30)


def raw_delete(stub: pb_grpc.KVStoreStub, keys: list[bytes]) -> Any:
    return stub.Delete(pb.DeleteRequest(keys=keys), timeout=30)


# -- keys ------------------------------------------------------------------------------------


def test_empty_key_list(seeded: Seeded, stub: pb_grpc.KVStoreStub) -> None:
    message = "the request names no keys"
    expect_status(INVALID, message, lambda: raw_lookup(stub, FP_A, []))
    expect_status(INVALID, message, lambda: raw_get(stub, FP_A, []))
    expect_status(INVALID, message, lambda: raw_delete(stub, []))
    expect_status(INVALID, message, lambda: raw_put(stub, pb.PutRequest(namespace=FP_A)))
    expect_status(INVALID, message, lambda: raw_put(stub))  # a stream of no messages at all
    with seeded.client() as client:
        for call in (
            lambda: client.lookup([]),
            lambda: client.get([]),
            lambda: client.put([], []),
            lambda: client.delete([]),
        ):
            with pytest.raises(InvalidRequestError, match=f"INVALID_ARGUMENT: {message}"):
                call()
    assert_intact(seeded)


def test_too_many_keys(seeded: Seeded, stub: pb_grpc.KVStoreStub) -> None:
    keys = chain(NS_A, MAX_KEYS + 1, seed=101)
    values = [bytes([i]) * 100 for i in range(len(keys))]
    message = f"{MAX_KEYS + 1} keys in one request; the limit is {MAX_KEYS}"
    expect_status(INVALID, message, lambda: raw_lookup(stub, FP_A, keys))
    expect_status(INVALID, message, lambda: raw_get(stub, FP_A, keys))
    # Delete would remove seed blocks if it ran: it must refuse the whole request.
    expect_status(INVALID, message, lambda: raw_delete(stub, seeded.keys_a[:1] + keys[:MAX_KEYS]))
    # A Put is refused while it streams, one block per message, once it passes the limit.
    streamed = [put_message(FP_A, [k], [v]) for k, v in zip(keys, values, strict=True)]
    expect_status(
        INVALID, f"more than {MAX_KEYS} keys in one request", lambda: raw_put(stub, *streamed)
    )
    with seeded.client() as client:
        with pytest.raises(InvalidRequestError, match=message):
            client.lookup(keys)
        with pytest.raises(InvalidRequestError, match=message):
            client.get(keys)
        with pytest.raises(InvalidRequestError, match=f"more than {MAX_KEYS} keys"):
            client.put(keys, values)
        with pytest.raises(InvalidRequestError, match=message):
            client.delete(seeded.keys_a[:1] + keys[:MAX_KEYS])
        # Exactly the limit is fine.
        assert client.lookup(keys[:MAX_KEYS]) == 0
    assert_absent(seeded, NS_A, keys[:MAX_KEYS])
    assert_intact(seeded)


@pytest.mark.parametrize("length", [0, 1, 15, 17, 32])
def test_key_of_wrong_length(seeded: Seeded, stub: pb_grpc.KVStoreStub, length: int) -> None:
    good = chain(NS_A, 1, seed=200 + length)[0]
    bad = bytes(range(length))
    keys = [good, bad]
    message = f"key 1 is {length} bytes; keys are 16 bytes"
    expect_status(INVALID, message, lambda: raw_lookup(stub, FP_A, keys))
    expect_status(INVALID, message, lambda: raw_get(stub, FP_A, keys))
    expect_status(INVALID, message, lambda: raw_delete(stub, [seeded.keys_a[0], bad]))
    put = put_message(FP_A, keys, [b"good block", b"bad block"])
    expect_status(INVALID, message, lambda: raw_put(stub, put))
    with seeded.client() as client:
        for call in (
            lambda: client.lookup(keys),
            lambda: client.get(keys),
            lambda: client.put(keys, [b"good block", b"bad block"]),
            lambda: client.delete([seeded.keys_a[0], bad]),
        ):
            with pytest.raises(InvalidRequestError, match=message):
                call()
    assert_absent(seeded, NS_A, [good])
    assert_intact(seeded)


@pytest.mark.parametrize("length", [0, 8, 15, 17, 32])
def test_namespace_fingerprint_of_wrong_length(
    seeded: Seeded, stub: pb_grpc.KVStoreStub, length: int
) -> None:
    namespace = FP_A[:length] if length <= 16 else FP_A + bytes(length - 16)
    new = chain(NS_A, 1, seed=300 + length)
    message = f"namespace fingerprint is {length} bytes; it must be 16"
    expect_status(INVALID, message, lambda: raw_lookup(stub, namespace, seeded.keys_a))
    expect_status(INVALID, message, lambda: raw_get(stub, namespace, seeded.keys_a))
    put = put_message(namespace, new, [b"a block"])
    expect_status(INVALID, message, lambda: raw_put(stub, put))
    with seeded.client(namespace) as client:
        for call in (
            lambda: client.lookup(seeded.keys_a),
            lambda: client.get(seeded.keys_a),
            lambda: client.put(new, [b"a block"]),
        ):
            with pytest.raises(InvalidRequestError, match=message):
                call()
    assert_absent(seeded, NS_A, new)
    assert_intact(seeded)


def test_put_stream_naming_two_namespaces(seeded: Seeded, stub: pb_grpc.KVStoreStub) -> None:
    keys = chain(NS_A, 2, seed=400)
    first = put_message(FP_A, keys[:1], [b"one"])
    second = put_message(FP_B, keys[1:], [b"two"])
    expect_status(
        INVALID, "one Put stream named two namespaces", lambda: raw_put(stub, first, second)
    )
    assert_absent(seeded, NS_A, keys)
    assert_intact(seeded)


# -- values ----------------------------------------------------------------------------------


@pytest.mark.each_plane
def test_value_over_the_block_limit(seeded: Seeded, stub: pb_grpc.KVStoreStub) -> None:
    keys = chain(NS_A, 2, seed=500)
    values = [b"fits", bytes(MAX_BLOCK + 1)]
    message = f"value 1 is {MAX_BLOCK + 1} bytes; the block limit is {MAX_BLOCK} bytes"
    expect_status(EXHAUSTED, message, lambda: raw_put(stub, put_message(FP_A, keys, values)))
    with seeded.client() as client, pytest.raises(CapacityError, match=message):
        client.put(keys, values)
    assert_absent(seeded, NS_A, keys)
    assert_intact(seeded)


@pytest.mark.each_plane
def test_value_far_over_the_grpc_message_limit(seeded: Seeded, stub: pb_grpc.KVStoreStub) -> None:
    # The server's gRPC limit is 2 * max_block_bytes + 1 MiB; gRPC itself refuses 40 MiB.
    keys = chain(NS_A, 1, seed=600)
    values = [bytes(40 * MiB)]
    expect_status(
        EXHAUSTED, "larger than max", lambda: raw_put(stub, put_message(FP_A, keys, values))
    )
    with seeded.client() as client, pytest.raises(CapacityError, match="RESOURCE_EXHAUSTED"):
        client.put(keys, values)
    assert_absent(seeded, NS_A, keys)
    assert_intact(seeded)


@pytest.mark.each_plane
def test_value_no_tier_can_hold(seeded: Seeded, stub: pb_grpc.KVStoreStub) -> None:
    # Under the 8 MiB block limit, but over the largest tier (nvme: 90% of 8 MiB).
    keys = chain(NS_A, 1, seed=700)
    values = [bytes(int(7.5 * MiB))]
    message = f"value 0 is {len(values[0])} bytes; no tier can hold it"
    expect_status(EXHAUSTED, message, lambda: raw_put(stub, put_message(FP_A, keys, values)))
    with seeded.client() as client, pytest.raises(CapacityError, match=message):
        client.put(keys, values)
    assert_absent(seeded, NS_A, keys)
    assert_intact(seeded)


@pytest.mark.each_plane
def test_put_larger_than_all_tiers_together(seeded: Seeded, stub: pb_grpc.KVStoreStub) -> None:
    # Five 2 MiB blocks: each fits a tier, together they exceed 2 MiB dram + 7.2 MiB nvme.
    keys = chain(NS_A, 5, seed=800)
    values = [bytes([i]) * (2 * MiB) for i in range(5)]
    message = "all tiers together hold"
    streamed = [put_message(FP_A, [k], [v]) for k, v in zip(keys, values, strict=True)]
    expect_status(EXHAUSTED, message, lambda: raw_put(stub, *streamed))
    with seeded.client() as client, pytest.raises(CapacityError, match=message):
        client.put(keys, values)
    assert_absent(seeded, NS_A, keys)
    assert_intact(seeded)


@pytest.mark.each_plane
def test_empty_value(seeded: Seeded, stub: pb_grpc.KVStoreStub) -> None:
    keys = chain(NS_A, 2, seed=900)
    message = "value 1 is empty"
    put = put_message(FP_A, keys, [b"fine", b""])
    expect_status(INVALID, message, lambda: raw_put(stub, put))
    with seeded.client() as client:
        for empty in (b"", bytearray(), np.empty(0, dtype=np.float16), memoryview(b"abc")[3:]):
            with pytest.raises(InvalidRequestError, match=message):
                client.put(keys, [b"fine", empty])
    assert_absent(seeded, NS_A, keys)
    assert_intact(seeded)


@pytest.mark.each_plane
def test_mismatched_key_and_value_counts(seeded: Seeded, stub: pb_grpc.KVStoreStub) -> None:
    keys = chain(NS_A, 3, seed=1000)
    with seeded.client() as client:
        puts_before = client.stats()["counters"].get("puts", 0)
        # The client refuses before sending anything.
        with pytest.raises(InvalidRequestError, match="3 keys but 2 values"):
            client.put(keys, [b"a", b"b"])
        with pytest.raises(InvalidRequestError, match="2 keys but 3 values"):
            client.put(keys[:2], [b"a", b"b", b"c"])
        with pytest.raises(InvalidRequestError, match="2 keys but 1 buffers"):
            client.get_into(seeded.keys_a[:2], [bytearray(256 * KiB)])
        assert client.stats()["counters"].get("puts", 0) == puts_before
    # On the wire a block always pairs one key with one value; a missing half is refused.
    no_value = pb.PutRequest(
        namespace=FP_A, blocks=[pb.Block(key=keys[0], value=b"x"), pb.Block(key=keys[1])]
    )
    expect_status(INVALID, "value 1 is empty", lambda: raw_put(stub, no_value))
    no_key = pb.PutRequest(
        namespace=FP_A, blocks=[pb.Block(key=keys[0], value=b"x"), pb.Block(value=b"y")]
    )
    expect_status(INVALID, "key 1 is 0 bytes", lambda: raw_put(stub, no_key))
    assert_absent(seeded, NS_A, keys)
    assert_intact(seeded)


# -- namespaces ------------------------------------------------------------------------------


@pytest.mark.each_plane
def test_put_of_a_key_held_under_another_namespace(
    seeded: Seeded, stub: pb_grpc.KVStoreStub
) -> None:
    new = chain(NS_B, 1, seed=1100)
    taken = seeded.keys_a[3]
    keys = [new[0], taken]
    values = [b"new block", b"would overwrite a seed block"]
    # The answer names neither namespace's fingerprint (a fingerprint is all it takes to read a
    # namespace's blocks).
    message = f"key 1 ({taken.hex()}) is stored under another namespace"
    code = grpc.StatusCode.FAILED_PRECONDITION
    details = expect_status(code, message, lambda: raw_put(stub, put_message(FP_B, keys, values)))
    assert FP_A.hex() not in details and FP_B.hex() not in details
    with (
        seeded.client(NS_B) as client,
        pytest.raises(NamespaceMismatchError, match=re.escape(message)),
    ):
        client.put(keys, values)
    assert_absent(seeded, NS_B, new)
    assert_intact(seeded)


@pytest.mark.each_plane
def test_get_under_another_namespace_is_a_miss(seeded: Seeded, stub: pb_grpc.KVStoreStub) -> None:
    keys = seeded.keys_a[:4]
    with seeded.client(NS_B) as client:
        before = client.stats()["counters"].get("namespace_mismatches", 0)
        assert client.lookup(keys) == 0
        assert client.lookup_tiers(keys).tiers == [""] * 4
        assert client.get(keys) == [None] * 4
        assert client.get_into(keys, [bytearray(256 * KiB) for _ in keys]) == [False] * 4
        assert client.stats()["counters"]["namespace_mismatches"] == before + 8
    results = raw_get(stub, FP_B, keys)
    assert [(r.index, r.found, r.value) for r in results] == [(i, False, b"") for i in range(4)]
    assert raw_lookup(stub, FP_B, keys).hits == 0
    assert_intact(seeded)


# -- the port itself -------------------------------------------------------------------------


def test_garbage_bytes_on_the_port(seeded: Seeded) -> None:
    host, port = seeded.target.rsplit(":", 1)
    rng = np.random.default_rng(1200)
    payloads = [
        rng.bytes(1),
        rng.bytes(100),
        rng.bytes(64 * KiB),
        rng.bytes(MiB),
        bytes(100 * KiB),
        b"GET / HTTP/1.1\r\nHost: localhost\r\nConnection: keep-alive\r\n\r\n",
        b"POST /kvstore.v1.KVStore/Put HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello",
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + rng.bytes(4 * KiB),  # preface, then junk frames
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x04\x00\x01\x00\x00\x00\x01abcd",  # DATA on 1
    ]
    sockets = [socket.create_connection((host, int(port)), timeout=5) for _ in payloads]
    idle = socket.create_connection((host, int(port)), timeout=5)  # a client that never speaks
    idle.sendall(b"PRI * HTTP/2.0\r\n")  # ...or stops half way through the preface
    socket.create_connection((host, int(port)), timeout=5).close()  # connect and hang up
    try:
        for sock, payload in zip(sockets, payloads, strict=True):
            with contextlib.suppress(OSError):  # the server may hang up before reading it all
                sock.sendall(payload)
        # The server hangs up on each of them (after its own SETTINGS frame) instead of waiting.
        deadline = time.monotonic() + 5
        for index, sock in enumerate(sockets):
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                while sock.recv(65536):
                    pass
            except (ConnectionResetError, BrokenPipeError):
                pass
            except TimeoutError:
                pytest.fail(f"the server kept garbage connection {index} open")
        # With the half-open connection still sitting there, real clients are served.
        assert_intact(seeded)
    finally:
        for sock in [*sockets, idle]:
            sock.close()
    assert_intact(seeded)
    assert seeded.server.running


def test_undecodable_request_body(seeded: Seeded) -> None:
    # Well-formed HTTP/2 and gRPC framing around bytes that are not a protobuf message.
    garbage = b"\xff\xff\xff\xff"
    with grpc.insecure_channel(seeded.target) as channel:
        calls: list[Callable[[], Any]] = [
            lambda: channel.unary_unary("/kvstore.v1.KVStore/Lookup")(garbage, timeout=10),
            lambda: channel.unary_unary("/kvstore.v1.KVStore/Delete")(garbage, timeout=10),
            lambda: list(channel.unary_stream("/kvstore.v1.KVStore/Get")(garbage, timeout=10)),
            lambda: channel.stream_unary("/kvstore.v1.KVStore/Put")(iter([garbage]), timeout=10),
        ]
        for call in calls:
            with pytest.raises(grpc.RpcError) as info:
                call()
            error: Any = info.value
            assert error.code() == INVALID, error.code()
            assert "undecodable request" in error.details(), error.details()
        unknown = channel.unary_unary("/kvstore.v1.KVStore/NoSuchMethod")
        expect_status(
            grpc.StatusCode.UNIMPLEMENTED, "Method not found", lambda: unknown(b"", timeout=10)
        )
    assert_intact(seeded)


def test_undecodable_health_check_is_invalid_argument_and_no_traceback(seeded: Seeded) -> None:
    """Garbage sent to the standard health service is answered INVALID_ARGUMENT, logged at most
    as one line (not an ERROR with a traceback per request), and the service keeps answering."""
    garbage = b"\xff\xff\xff\xff"
    before = seeded.server.stderr().count("Traceback")
    with grpc.insecure_channel(seeded.target) as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check")
        watch = channel.unary_stream("/grpc.health.v1.Health/Watch")
        for _ in range(3):
            expect_status(INVALID, "undecodable request", lambda: check(garbage, timeout=10))
            expect_status(INVALID, "undecodable request", lambda: next(watch(garbage, timeout=10)))
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=10
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert seeded.server.stderr().count("Traceback") == before
    assert_intact(seeded)


@pytest.mark.parametrize("method", ["Lookup", "Put"])
def test_undecodable_request_body_is_invalid_argument(seeded: Seeded, method: str) -> None:
    garbage = b"\xff\xff\xff\xff"
    with grpc.insecure_channel(seeded.target) as channel:
        if method == "Put":
            put = channel.stream_unary("/kvstore.v1.KVStore/Put")
            expect_status(INVALID, "", lambda: put(iter([garbage]), timeout=10))
        else:
            lookup = channel.unary_unary("/kvstore.v1.KVStore/Lookup")
            expect_status(INVALID, "", lambda: lookup(garbage, timeout=10))
