"""One key scheme (issue 29 item 2): the router names chunks by the scheme its nodes publish in
the cluster index, with no key settings of its own. Real ``kvstore serve`` nodes, a real
redis-server, a real ``kvstore router`` process in front of fake engines.

Two nodes set ``keys.chunk_size = 128``: the router names chunks of 128 tokens and routes a
prompt to the node holding it. A third node with 256 is refused for prefix routing with exactly
one WARNING line (however often the router reads the schemes again) and a gauge at 1, and
routing stays correct: the prefix its index entries seem to hold is not credited. A router whose
key secret differs logs one ERROR and routes by load.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
from harness.cluster_nodes import cluster_env
from harness.fake_engine import FakeEngine
from harness.polling import poll
from harness.redis_server import RedisServer
from harness.router import RouterProcess
from harness.router_index import index_leading

from kvstore import ChunkHasher, Namespace
from kvstore.key_scheme import namespace_to_json

if TYPE_CHECKING:
    from harness.server_factory import ServerFactory

NS = Namespace(model="scheme-test", num_layers=2, num_kv_heads=2, head_size=64)
SECRET = "one-scheme-secret"
CHUNK = 128
HASHER = ChunkHasher(CHUNK, NS, secret=SECRET.encode())
REFUSED = (
    "replica node-c refused for prefix routing: its key scheme differs (chunk_size 128 vs 256)"
)

Setup = tuple[RedisServer, dict[str, Any], dict[str, FakeEngine], RouterProcess]


def node_env(url: str, node: str, chunk_size: int) -> dict[str, str]:
    return {
        **cluster_env(url, node, lease_ttl_s=None),
        "KVSTORE_KEYS_CHUNK_SIZE": str(chunk_size),
        "KVSTORE_KEYS_NAMESPACE": namespace_to_json(NS),
        "KVSTORE_HASH_SECRET": SECRET,
    }


def prompt(first: int, chunks: int) -> list[int]:
    return list(range(first, first + CHUNK * chunks))


def store(node: Any, tokens: list[int]) -> list[bytes]:
    keys = HASHER.keys(tokens)
    values = [np.full(4096, i, dtype=np.uint8).tobytes() for i in range(len(keys))]
    with node.client(NS) as client:
        assert client.put(keys, values).stored == len(keys)
    return [bytes(k) for k in keys]


def decisions(router: RouterProcess, reason: str, engine: FakeEngine) -> float:
    return router.metric(
        "kvstore_router_decisions_total", f'reason="{reason}",replica="{engine.url}"'
    )


@pytest.fixture
def setup(tmp_path: Path, server_factory: ServerFactory) -> Iterator[Setup]:
    with RedisServer(tmp_path / "redis") as redis_server:
        url = redis_server.url
        nodes = {
            "a": server_factory(env=node_env(url, "node-a", 128)),
            "b": server_factory(env=node_env(url, "node-b", 128)),
            "c": server_factory(env=node_env(url, "node-c", 256)),
        }
        engines = {name: FakeEngine(name) for name in nodes}
        router = RouterProcess(
            tmp_path,
            [f"{engines[n].url}=node-{n}" for n in nodes],
            index_url=url,
            env={"KVSTORE_HASH_SECRET": SECRET, "KVSTORE_ROUTER_INDEX_TIMEOUT_S": "1.0"},
        )
        try:
            yield redis_server, nodes, engines, router
        finally:
            router.stop()
            for engine in engines.values():
                engine.close()


def test_the_router_names_chunks_by_the_fleets_scheme_and_refuses_another(setup: Setup) -> None:
    redis_server, nodes, engines, router = setup
    on_a, on_c = prompt(0, 3), prompt(50_000, 3)
    keys_a, keys_c = store(nodes["a"], on_a), store(nodes["c"], on_c)
    poll(lambda: index_leading(redis_server.url, keys_a).get("node-a") == 3, 10, "a's")
    poll(lambda: index_leading(redis_server.url, keys_c).get("node-c") == 3, 10, "c's")
    poll(
        lambda: router.metric("kvstore_router_replica_scheme_refused", 'replica="node-c"') == 1,
        15,
        "node-c refused",
    )
    assert "naming chunks as the fleet does: chunk_size=128" in router.stderr()

    # Chunks of 128 tokens, as the nodes name them: the prompt goes where it is cached.
    router.complete(on_a, max_tokens=1)
    assert engines["a"].prompts()[-1] == on_a
    assert decisions(router, "prefix", engines["a"]) == 1

    # Node C's entries would match the router's keys, but its scheme differs: never credited.
    router.complete(on_c, max_tokens=1)
    assert decisions(router, "prefix", engines["c"]) == 0
    assert sum(decisions(router, "prefix", e) for e in engines.values()) == 1

    # One line, however often the schemes are read again.
    reads = router.metric("kvstore_router_key_scheme_reads_total", "")
    # (Each request starts a read once the last is REFRESH_S old.)
    poll(
        lambda: (
            router.complete(prompt(100_000, 1), max_tokens=1) is not None
            and router.metric("kvstore_router_key_scheme_reads_total", "") > reads + 2
        ),
        30,
        "the router reading the schemes again",
        every=0.25,
    )
    assert router.stderr().count(REFUSED) == 1
    assert router.stderr().count("refused for prefix routing") == 1


def test_a_router_with_another_secret_logs_once_and_routes_by_load(
    tmp_path: Path, server_factory: ServerFactory
) -> None:
    with RedisServer(tmp_path / "redis") as redis_server:
        node = server_factory(env=node_env(redis_server.url, "node-a", 128))
        engine = FakeEngine("a")
        router = RouterProcess(
            tmp_path,
            [f"{engine.url}=node-a"],
            index_url=redis_server.url,
            env={"KVSTORE_HASH_SECRET": "not the fleet's"},
        )
        try:
            keys = store(node, prompt(0, 2))
            poll(lambda: index_leading(redis_server.url, keys).get("node-a") == 2, 10, "a")
            router.complete(prompt(0, 2), max_tokens=1)
            router.complete(prompt(0, 2), max_tokens=1)
            assert decisions(router, "no_tokens", engine) == 2
            assert router.metric("kvstore_router_fallbacks_total", 'reason="no_namespace"') == 2
            log = router.stderr()
            assert log.count("ERROR") == 1
            assert "this router's $KVSTORE_HASH_SECRET differs from the key secret" in log
        finally:
            router.stop()
            engine.close()
