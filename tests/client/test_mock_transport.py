"""The real clients driven through :class:`kvstore.MockTransport`, with no server.

Round trips against the in-memory store (:class:`kvstore.testing.MemoryStore`), a put split into
several streams, prefetches polled to their end, statuses and deadlines mapped to the same
exceptions as over gRPC, the asyncio client alike, what a transport rules out (no channel, no fast
paths), and the example of docs/python-api.md run as written.
"""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

import kvstore.client.core as core
import kvstore.client.transport as transport_module
from kvstore import AsyncKVStoreClient, KVStoreClient, MockTransport, Namespace, Retention
from kvstore.client.mock_transport import pb
from kvstore.errors import (
    AuthenticationError,
    CapacityError,
    ConfigError,
    DeadlineExceededError,
    InternalStoreError,
    InvalidRequestError,
    KVStoreError,
    NamespaceMismatchError,
    PermissionDeniedError,
    StoreUnavailableError,
    UnknownPrefetchError,
)
from kvstore.testing import MemoryStore
from kvstore.types import PrefetchState

NS = Namespace(model="mock-transport")
OTHER_NS = Namespace(model="another")
KEYS = [bytes([i]) * 16 for i in range(4)]
VALUES = [bytes([i]) * (100 + i) for i in range(4)]
API_PAGE = Path(__file__).resolve().parents[2] / "docs" / "python-api.md"

#: The exception a call raises for each status, over gRPC and through a MockTransport alike.
RAISED = {
    grpc.StatusCode.UNAVAILABLE: StoreUnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
    grpc.StatusCode.FAILED_PRECONDITION: NamespaceMismatchError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: CapacityError,
    grpc.StatusCode.NOT_FOUND: UnknownPrefetchError,
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.INTERNAL: InternalStoreError,
}


def _client(store: MemoryStore, **kwargs: Any) -> KVStoreClient:
    return KVStoreClient("unused", namespace=NS, transport=MockTransport(store), **kwargs)


def test_put_lookup_get_delete_stats_round_trip_through_a_handler() -> None:
    store = MemoryStore()
    with _client(store) as client:
        assert client.data_plane == "grpc"
        assert client.lookup(KEYS) == 0
        assert client.put(KEYS[:3], VALUES[:3]).stored == 3
        assert client.put(KEYS, VALUES).already_present == 3
        result = client.lookup_tiers(KEYS)
        assert (result.hits, result.tiers) == (4, ["dram"] * 4)
        assert client.get([*KEYS, b"x" * 16]) == [*VALUES, None]
        buffers = [np.zeros(len(v), dtype=np.uint8) for v in VALUES]
        assert client.get_into(KEYS, buffers) == [True] * 4
        assert [b.tobytes() for b in buffers] == VALUES
        assert client.stats()["blocks"] == 4
        assert client.delete(KEYS[:2]) == 2
        assert client.lookup(KEYS) == 0
        assert client.get(KEYS[2:]) == VALUES[2:]
    # No DataPlane discovery: a client given a transport never looks for the fast paths.
    assert set(store.methods()) == {"Lookup", "Put", "Get", "Stats", "Delete"}


def test_requests_carry_the_namespace_and_blocks_of_other_namespaces_stay_apart() -> None:
    store = MemoryStore()
    with _client(store) as client:
        client.put(KEYS[:1], VALUES[:1])
        with KVStoreClient("unused", namespace=OTHER_NS, transport=MockTransport(store)) as other:
            assert other.lookup(KEYS[:1]) == 0
    (_, puts), (_, lookup) = store.calls
    assert puts[0].namespace == NS.fingerprint()
    assert lookup.namespace == OTHER_NS.fingerprint()


def test_a_put_past_the_stream_budget_goes_as_several_streams(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(core, "PUT_STREAM_BYTES", 250)  # about two values a stream
    store = MemoryStore()
    with _client(store) as client:
        result = client.put(KEYS, VALUES, retention=Retention(60))
        assert client.get(KEYS) == VALUES
    assert (result.stored, result.already_present) == (4, 0)
    streams = [request for method, request in store.calls if method == "Put"]
    assert len(streams) == 2
    assert all(stream[0].retention_s == 60 for stream in streams)


def test_a_put_that_stores_nothing_sends_nothing() -> None:
    store = MemoryStore()
    with _client(store) as client:
        assert client.put(KEYS, VALUES, retention=Retention(tiers="none")).stored == 0
    assert store.calls == []


def test_prefetch_is_polled_to_its_end_and_cancelled() -> None:
    store = MemoryStore(prefetch_polls=3)
    with _client(store) as client:
        job = client.prefetch(KEYS)
        assert client.prefetch_status(job).state is PrefetchState.RUNNING
        done = client.wait_prefetch(job, timeout=10)
        assert (done.state, done.total, done.ready) == (PrefetchState.DONE, 4, 4)
        assert not client.cancel_prefetch(job)
        other = client.prefetch(KEYS)
        assert client.cancel_prefetch(other)
        assert client.wait_prefetch(other, timeout=10).state is PrefetchState.CANCELLED
        with pytest.raises(UnknownPrefetchError, match="no prefetch 99"):
            client.prefetch_status(99)
    assert store.methods().count("PrefetchStatus") >= 4


@pytest.mark.parametrize("code", RAISED, ids=lambda code: code.name)
def test_a_status_from_the_handler_raises_what_grpc_would(code: grpc.StatusCode) -> None:
    store = MemoryStore(fail=(code, "handler says no"))
    with _client(store) as client, pytest.raises(RAISED[code], match="handler says no"):
        client.get(KEYS)


def test_a_handler_slower_than_the_deadline_raises_deadline_exceeded() -> None:
    def slow(method: str, request: Any) -> Any:
        time.sleep(0.05)  # sleep: the handler's work; the client's deadline is shorter
        return pb.DeleteResponse(deleted=1)

    with KVStoreClient(
        "unused", namespace=NS, timeout=0.01, transport=MockTransport(slow)
    ) as client:
        with pytest.raises(DeadlineExceededError, match="deadline exceeded"):
            client.delete(KEYS)
        assert client.delete(KEYS, timeout=5) == 1


def test_a_spent_deadline_fails_before_the_handler_runs() -> None:
    store = MemoryStore()
    with _client(store) as client, pytest.raises(DeadlineExceededError):
        client.lookup(KEYS, timeout=0)
    assert store.calls == []


def test_when_reconnected_and_close_go_to_the_transport() -> None:
    transport = MockTransport(MemoryStore())
    fired: list[str] = []
    with KVStoreClient("unused", namespace=NS, transport=transport) as client:
        client.when_reconnected(lambda: fired.append("back"))
        transport.reconnect()
        transport.reconnect()  # once only, as over gRPC
        assert fired == ["back"]
    assert transport.closed
    with pytest.raises(ValueError, match="closed"):
        client.lookup(KEYS)


async def test_the_async_clients_when_reconnected_goes_to_the_transport_too() -> None:
    transport = MockTransport(MemoryStore())
    fired: list[str] = []
    async with AsyncKVStoreClient("unused", namespace=NS, transport=transport) as client:
        client.when_reconnected(lambda: fired.append("back"))
        transport.reconnect()
        transport.reconnect()
        assert fired == ["back"]
    assert transport.closed


def test_a_client_given_a_transport_opens_no_channel(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a channel was opened")

    monkeypatch.setattr(transport_module, "blocking_channel", refuse)
    monkeypatch.setattr(transport_module, "aio_channel", refuse)
    monkeypatch.setenv("KVSTORE_DATA_PLANE", "shm")  # the environment's choice gives way
    with _client(MemoryStore()) as client:
        assert client.open_data_plane() == "grpc"
    aio = AsyncKVStoreClient("unused", namespace=NS, transport=MockTransport(MemoryStore()))
    assert aio.data_plane == "grpc"
    asyncio.run(aio.aclose())


@pytest.mark.parametrize(
    ("argument", "value", "named"),
    [
        ("data_plane", "shm", "data_plane='shm'"),
        ("data_plane", "ucx", "data_plane='ucx'"),
        ("token", "secret", "token"),
        ("tls_ca", b"pem", "tls_ca"),
    ],
)
def test_what_a_transport_rules_out_is_refused_by_name(
    argument: str, value: Any, named: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(named)):
        KVStoreClient("unused", transport=MockTransport(MemoryStore()), **{argument: value})
    with pytest.raises(ConfigError, match=re.escape(named)):
        AsyncKVStoreClient("unused", transport=MockTransport(MemoryStore()), **{argument: value})


def test_the_async_client_through_the_same_transport() -> None:
    store = MemoryStore()
    transport = MockTransport(store)

    async def run() -> None:
        async with AsyncKVStoreClient("unused", namespace=NS, transport=transport) as client:
            assert (await client.put(KEYS, VALUES)).stored == 4
            assert await client.lookup(KEYS) == 4
            assert await client.get(KEYS) == VALUES
            job = await client.prefetch(KEYS)
            assert (await client.wait_prefetch(job, timeout=10)).state is PrefetchState.DONE
            assert await client.delete(KEYS) == 4
            store.fail = (grpc.StatusCode.UNAVAILABLE, "down for now")
            with pytest.raises(StoreUnavailableError, match="down for now"):
                await client.stats()
            with pytest.raises(DeadlineExceededError):
                await client.lookup(KEYS, timeout=0)

    asyncio.run(run())
    assert transport.closed


@pytest.mark.parametrize(
    ("method", "answer", "wanted"),
    [("Get", pb.GetResponse(), "an iterable of messages"), ("Lookup", None, "a response message")],
)
def test_a_handler_answering_the_wrong_shape_is_told_so(
    method: str, answer: Any, wanted: str
) -> None:
    calls = {"Get": KVStoreClient.get, "Lookup": KVStoreClient.lookup}
    transport = MockTransport(lambda _method, _request: answer)
    client = KVStoreClient("unused", namespace=NS, transport=transport)
    with client, pytest.raises(TypeError, match=f"answer {method} with {wanted}"):
        calls[method](client, KEYS)


def test_every_failure_is_a_kvstore_error() -> None:
    store = MemoryStore(fail=(grpc.StatusCode.DATA_LOSS, "odd"))
    with _client(store) as client, pytest.raises(KVStoreError, match="odd"):
        client.lookup(KEYS)


def test_the_api_pages_example_runs_as_written() -> None:
    text = API_PAGE.read_text("utf-8")
    section = text.split("### Testing code that uses the client", 1)[1]
    example = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert "MockTransport(handler)" in example
    exec(compile(example, "docs/python-api.md", "exec"), {})
