"""Prefetch over gRPC against real ``kvstore serve`` processes sharing a real redis-server.

A block stored at node A reaches Redis by write-through; node B, which never saw it, prefetches
it: the status goes DONE, B's lookup then places it in ``dram`` and a get returns the same bytes.
Unknown prefetch ids are NOT_FOUND (``UnknownPrefetchError`` at the client) and malformed
requests INVALID_ARGUMENT (``InvalidRequestError``), through both clients and a raw stub.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import grpc
import numpy as np
import pytest

from kvstore import AsyncKVStoreClient, ChunkHasher, InvalidRequestError, Namespace
from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore._proto.kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.errors import UnknownPrefetchError
from kvstore.types import PrefetchProgress, PrefetchState

if TYPE_CHECKING:
    from harness.serve import ServerProcess
    from harness.server_factory import ServerFactory

from harness.polling import poll
from harness.redis_server import RedisServer

# Every node sharing a Redis needs the same integrity secret (else it rejects the others' blocks).
CLUSTER_SECRET = {"KVSTORE_INTEGRITY_SECRETS": "two-node test secret"}
NS = Namespace(model="prefetch-rpc", num_layers=2, num_kv_heads=2, head_size=64)
HASHER = ChunkHasher(chunk_size=16, namespace=NS)
BLOCK_BYTES = 256 * 1024


def blocks_for(first_token: int, count: int) -> tuple[list[bytes], list[bytes]]:
    """``count`` chained keys of a prompt starting at ``first_token``, and random payloads."""
    keys = HASHER.keys(list(range(first_token, first_token + 16 * count)))
    rng = np.random.default_rng(first_token)
    return keys, [rng.integers(0, 256, BLOCK_BYTES, dtype=np.uint8).tobytes() for _ in keys]


@pytest.fixture
def two_nodes(
    server_factory: ServerFactory, redis_server: RedisServer
) -> tuple[ServerProcess, ServerProcess]:
    return (
        server_factory("--redis-url", redis_server.url, env=CLUSTER_SECRET),
        server_factory("--redis-url", redis_server.url, env=CLUSTER_SECRET),
    )


@pytest.mark.each_plane
def test_prefetch_brings_a_redis_only_block_into_dram(
    two_nodes: tuple[ServerProcess, ServerProcess],
) -> None:
    node_a, node_b = two_nodes
    keys, values = blocks_for(0, 6)
    absent, _ = blocks_for(9000, 1)
    with node_a.client(NS) as a, node_b.client(NS) as b:
        assert a.put(keys, values).stored == 6
        poll(lambda: b.lookup(keys) == 6, 5.0, "write-through to redis")
        assert b.lookup_tiers(keys).tiers == ["redis"] * 6  # only in Redis, as far as B knows

        prefetch_id = b.prefetch([*keys, *absent])
        progress = b.wait_prefetch(prefetch_id, timeout=10.0)
        assert progress == PrefetchProgress(PrefetchState.DONE, total=7, ready=6, missing=1)
        assert b.prefetch_status(prefetch_id) == progress
        assert b.lookup_tiers(keys).tiers == ["dram"] * 6
        assert b.get(keys) == values
        assert b.stats()["tiers"]["dram"]["hits"] == 6  # served from dram, not from Redis again
        assert b.cancel_prefetch(prefetch_id) is False  # already finished
        assert b.prefetch_status(prefetch_id).state is PrefetchState.DONE
    node_b.stop()
    node_a.stop()


async def test_async_client_prefetch_and_errors(
    two_nodes: tuple[ServerProcess, ServerProcess],
) -> None:
    node_a, node_b = two_nodes
    keys, values = blocks_for(500, 3)
    with node_a.client(NS) as a:
        assert a.put(keys, values).stored == 3
    async with AsyncKVStoreClient(node_b.target, namespace=NS, timeout=5.0) as b:
        deadline = time.monotonic() + 5.0
        while await b.lookup(keys) < 3:
            assert time.monotonic() < deadline, "write-through to redis"
            await asyncio.sleep(0.02)
        prefetch_id = await b.prefetch(keys)
        progress = await b.wait_prefetch(prefetch_id, timeout=10.0)
        assert progress == PrefetchProgress(PrefetchState.DONE, total=3, ready=3)
        assert (await b.lookup_tiers(keys)).tiers == ["dram"] * 3
        assert await b.get(keys) == values
        assert await b.cancel_prefetch(prefetch_id) is False
        with pytest.raises(UnknownPrefetchError, match="NOT_FOUND"):
            await b.prefetch_status(prefetch_id + 1000)
        with pytest.raises(InvalidRequestError, match="INVALID_ARGUMENT"):
            await b.prefetch([b"too short"])


def test_unknown_prefetch_id_is_not_found(server: ServerProcess) -> None:
    with server.client(NS) as client:
        with pytest.raises(UnknownPrefetchError, match="NOT_FOUND: no prefetch has id 424242"):
            client.prefetch_status(424242)
        with pytest.raises(UnknownPrefetchError, match="NOT_FOUND"):
            client.cancel_prefetch(424242)
        with pytest.raises(UnknownPrefetchError):
            client.wait_prefetch(424242, timeout=2.0)
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.KVStoreStub(channel)
        with pytest.raises(grpc.RpcError) as raised:
            stub.PrefetchStatus(pb.PrefetchStatusRequest(prefetch_id=424242), timeout=5)
        assert raised.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as raised:
            stub.CancelPrefetch(pb.CancelPrefetchRequest(prefetch_id=424242), timeout=5)
        assert raised.value.code() == grpc.StatusCode.NOT_FOUND


def test_malformed_prefetch_is_invalid_argument(server: ServerProcess) -> None:
    keys, values = blocks_for(700, 2)
    with server.client(NS) as client:
        assert client.put(keys, values).stored == 2
        with pytest.raises(InvalidRequestError, match="key 2 is 3 bytes"):
            client.prefetch([*keys, b"bad"])
        with pytest.raises(InvalidRequestError, match="no keys"):
            client.prefetch([])
        # Nothing was queued by the bad calls: the first good one gets the first id.
        prefetch_id = client.prefetch(keys)
        assert prefetch_id == 1
        assert client.wait_prefetch(prefetch_id, timeout=10.0).ready == 2
        assert client.get(keys) == values
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.KVStoreStub(channel)
        with pytest.raises(grpc.RpcError) as raised:
            stub.Prefetch(pb.PrefetchRequest(keys=keys), timeout=5)  # no namespace
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "namespace fingerprint is 0 bytes" in (raised.value.details() or "")
        for method in ("Prefetch", "PrefetchStatus", "CancelPrefetch"):
            call = channel.unary_unary(f"/kvstore.v1.KVStore/{method}")
            with pytest.raises(grpc.RpcError) as raised:
                call(b"\xff\xff\xff\xff", timeout=5)
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
            assert "undecodable request" in (raised.value.details() or ""), method
    server.stop()
