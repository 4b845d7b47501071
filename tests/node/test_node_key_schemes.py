"""A node publishing its key schemes (issue 29 item 2), in-process on a real redis-server: its
description carries its configured scheme, an engine's declaration is re-signed into it at once
(not at the next renewal), and engine events that had no namespace start with the declared one."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness.redis_server import RedisServer
from harness.store_blocks import make_store

from kvstore.cluster import ClusterIndex, Layout, connect
from kvstore.config import load_config
from kvstore.key_scheme import KeyScheme
from kvstore.keys import Namespace
from kvstore.node.agent import start_cluster
from kvstore.node.key_schemes import NodeKeySchemes

PREFIX = "test:schemes:"
NS = Namespace(model="declared", num_layers=2)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path / "redis") as server:
        yield server


async def published(url: str) -> list[KeyScheme]:
    client = connect(url, 2.0)
    try:
        info = (await ClusterIndex(client, Layout(PREFIX)).nodes())["n1"]
        return [KeyScheme.from_json(text, "test") for text in info.keys or ()]
    finally:
        await client.aclose()


async def test_a_declaration_is_published_at_once_and_starts_engine_events(
    redis_server: RedisServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "kvstore.node.agent")
    config = load_config(
        env={
            "KVSTORE_CLUSTER_ENABLED": "1",
            "KVSTORE_CLUSTER_URL": redis_server.url,
            "KVSTORE_CLUSTER_NODE_ID": "n1",
            "KVSTORE_CLUSTER_KEY_PREFIX": PREFIX,
            # Renewals every 10 s, re-signing only once half of 180 s is gone: a change seen
            # within 20 s was written because it changed.
            "KVSTORE_CLUSTER_LEASE_TTL_S": "30",
            "KVSTORE_CLUSTER_ENGINE_EVENTS": "ipc://" + str(tmp_path / "events"),
            "KVSTORE_KEYS_CHUNK_SIZE": "64",
            "KVSTORE_NVME_PATH": str(tmp_path / "nvme"),
        }
    )
    schemes = NodeKeySchemes(config.keys.scheme({}))
    node = await start_cluster(config, {"": make_store(None)}, "127.0.0.1:1", "", schemes)
    assert node is not None
    try:
        first = await published(redis_server.url)
        assert [(s.chunk_size, s.namespace) for s in first] == [(64, None)]
        assert node.engine is None
        assert "waiting for an engine's connector to declare its key namespace" in caplog.text

        # A connector declares from a gRPC thread.
        thread = threading.Thread(target=schemes.declare, args=(NS, ""))
        thread.start()
        thread.join()
        deadline = time.monotonic() + 20
        while (now := await published(redis_server.url)) == first:
            assert time.monotonic() < deadline, "the declaration was not published"
            await asyncio.sleep(0.05)
        assert [(s.chunk_size, s.namespace) for s in now] == [(64, NS)]
        assert node.engine is not None
        assert node.engine.chunks.chunk_size == 64 and node.engine.chunks.base == NS
        assert caplog.text.count("waiting for an engine's connector") == 1
    finally:
        await node.stop()


def test_each_tenant_keeps_its_own_secret_where_the_node_has_none() -> None:
    """Tenants may key their chunks with secrets of their own: only an engine of the same tenant
    with another secret is refused; a node with a secret of its own holds every engine to it."""
    from kvstore.key_scheme import KeyScheme
    from kvstore.keys import Namespace
    from kvstore.node.key_schemes import NodeKeySchemes, SecretMismatch

    schemes = NodeKeySchemes(KeyScheme(chunk_size=64))
    schemes.declare(Namespace(model="m", tenant="a"), "a" * 16)
    assert schemes.declare(Namespace(model="m", tenant="b"), "b" * 16).secret_check == "b" * 16
    with pytest.raises(SecretMismatch, match="differs from this node's"):
        schemes.declare(Namespace(model="m2", tenant="a"), "c" * 16)
    held = NodeKeySchemes(KeyScheme(chunk_size=64, secret_check="d" * 16))
    with pytest.raises(SecretMismatch):
        held.declare(Namespace(model="m", tenant="b"), "b" * 16)
