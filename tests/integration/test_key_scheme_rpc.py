"""The ``KeyScheme`` call of a real server: an engine declares its namespace and secret check and
learns the node's chunk size and hash algorithm; another secret, another tenant's namespace,
one namespace too many and malformed requests are refused with their status and a message, and
the server keeps serving.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import pytest
from harness.node_schemes import cluster_settings, published_schemes, wait_published
from harness.redis_server import RedisServer
from harness.tenant_config import TOKENS, write_config

from kvstore import AsyncKVStoreClient, KVStoreClient, Namespace
from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore._proto.kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.errors import CapacityError, NamespaceMismatchError, PermissionDeniedError
from kvstore.key_scheme import HASH_SECRET_ENV, KeyScheme, secret_fingerprint
from kvstore.node.key_schemes import MAX_SCHEMES

if TYPE_CHECKING:
    from harness.serve import ServerProcess
    from harness.server_factory import ServerFactory

NS = Namespace(model="key-scheme", num_layers=2, num_kv_heads=2, head_size=64)
SECRET = secret_fingerprint("the deployment's secret")


def test_an_engine_learns_the_nodes_scheme_and_another_secret_is_refused(
    server: ServerProcess,
) -> None:
    with KVStoreClient(server.target) as first, KVStoreClient(server.target) as other:
        scheme = first.key_scheme(NS, SECRET)
        # A node without [keys] settings: the built-in chunk size and algorithm.
        assert (scheme.chunk_size, scheme.hash_algorithm) == (256, "xxh3_128")
        assert (scheme.secret_env, scheme.secret_check) == (HASH_SECRET_ENV, SECRET)
        assert scheme.namespace == NS
        # Per-rank and per-request fields are not part of a declaration.
        rank = dataclasses.replace(NS, tp_rank=1, tp_size=2)
        assert first.key_scheme(rank, SECRET).namespace == dataclasses.replace(rank, tp_rank=0)
        assert other.key_scheme(NS, "").secret_check == SECRET  # "": not compared
        with pytest.raises(NamespaceMismatchError, match=r"\$KVSTORE_HASH_SECRET differs"):
            other.key_scheme(NS, secret_fingerprint("another secret"))
        assert first.stats()["blocks"] == 0  # still serving


def test_the_async_client_declares_too(server: ServerProcess) -> None:
    async def declare() -> KeyScheme:
        async with AsyncKVStoreClient(server.target) as client:
            return await client.key_scheme(NS, SECRET)

    assert asyncio.run(declare()).chunk_size == 256


@pytest.mark.parametrize(
    ("namespace", "secret_check", "message"),
    [
        ("", "", "names no namespace"),
        ("x" * 5000, "", "5000 characters; the limit is 4096"),
        ("{not json", "", "not JSON"),
        ('["a list"]', "", "not a JSON object"),
        ('{"model": "m", "lora_id": "adapter"}', "", "unknown fields ['lora_id']"),
        ('{"model": "m", "num_layers": "two"}', "", "num_layers"),
        ('{"model": ["m"]}', "", "model must be a JSON string"),
        ('{"model": "m"}', "not-hex", "secret_check must be empty or 16 lowercase hex digits"),
    ],
)
def test_a_malformed_declaration_is_refused_with_a_message(
    server: ServerProcess, namespace: str, secret_check: str, message: str
) -> None:
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.KVStoreStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.KeyScheme(pb.KeySchemeRequest(namespace=namespace, secret_check=secret_check))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in (refused.value.details() or "")
        good = json.dumps({"model": "m"})
        assert stub.KeyScheme(pb.KeySchemeRequest(namespace=good)).chunk_size == 256


def test_a_tenant_declares_only_its_own_namespace(
    server_factory: ServerFactory, tmp_path: Path
) -> None:
    server = server_factory("--config", str(write_config(tmp_path)))
    own, others = dataclasses.replace(NS, tenant="a"), dataclasses.replace(NS, tenant="b")
    with KVStoreClient(server.target, token=TOKENS["alice"]) as alice:
        assert alice.key_scheme(own, SECRET).namespace == own
        with pytest.raises(PermissionDeniedError, match="tenant 'b' is not yours \\('a'\\)"):
            alice.key_scheme(others, SECRET)
    carol = KVStoreClient(server.target, token=TOKENS["carol"])  # in no tenant
    with carol, pytest.raises(PermissionDeniedError, match="belong to no tenant"):
        carol.key_scheme(own, SECRET)


def test_a_configured_node_answers_its_chunk_size_and_refuses_one_namespace_too_many(
    server_factory: ServerFactory, redis_server: RedisServer
) -> None:
    # What the node holds declared is read where a router reads it: its description in the index.
    settings = {"keys.chunk_size": 128, "keys.hash_algorithm": "sha256"}
    server = server_factory(settings={**settings, **cluster_settings(redis_server.url, "n")})
    with KVStoreClient(server.target) as client:
        scheme = client.key_scheme(NS, SECRET)
        assert (scheme.chunk_size, scheme.hash_algorithm) == (128, "sha256")
        for index in range(1, MAX_SCHEMES):
            client.key_scheme(dataclasses.replace(NS, model=f"model-{index}"), SECRET)
        declared = wait_published(redis_server.url, "n", lambda seen: len(seen) == MAX_SCHEMES)
        assert {(s.chunk_size, s.hash_algorithm) for s in declared} == {(128, "sha256")}
        assert {s.namespace.model for s in declared if s.namespace} == {NS.model} | {
            f"model-{index}" for index in range(1, MAX_SCHEMES)
        }
        with pytest.raises(CapacityError, match=f"already serves {MAX_SCHEMES}"):
            client.key_scheme(dataclasses.replace(NS, model="one-too-many"), SECRET)
        assert client.key_scheme(NS, SECRET).chunk_size == 128  # a known one still answers
        assert len(published_schemes(redis_server.url, "n") or ()) == MAX_SCHEMES
