"""One key scheme, end to end without vLLM (issue 29 item 2's "done when"): the chunk size is set
in one place, the nodes' ``keys.chunk_size``, and the connector, the node and the router follow.

Two real ``kvstore serve`` nodes with the cluster index on (a real redis-server) and
``keys.chunk_size = 64``; a real connector (both halves, vLLM's objects stood in for as in
:mod:`harness.connector_sides`) with no chunk size in its config, on node A; a real ``kvstore
router`` with no key settings in front of two fake engines. The connector names chunks of 64
tokens and saves a prompt's; the router names that prompt's chunks as the nodes publish and routes
it by prefix to A's engine. Then only the nodes' ``keys.chunk_size`` changes (to 32, a restart):
a restarted engine's connector names chunks of 32, the node publishes 32, and the same router,
untouched, names chunks of 32 and routes by prefix again.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "integrations"))
from harness.connector_sides import (
    BLOCK,
    random_caches,
    stand_in_kv_cache_config,
    stand_in_vllm_config,
)
from harness.fake_engine import FakeEngine
from harness.node_schemes import cluster_settings, published_schemes
from harness.polling import poll
from harness.redis_server import RedisServer
from harness.router import RouterProcess
from harness.router_index import index_leading
from harness.vllm_scheduler import StandInManager, stand_in_output, stand_in_request

from kvstore import ChunkHasher
from kvstore.integrations.vllm.common import ConnectorSettings
from kvstore.integrations.vllm.scheduler import SchedulerSide
from kvstore.integrations.vllm.worker import WorkerSide

if TYPE_CHECKING:
    from harness.serve import ServerProcess
    from harness.server_factory import ServerFactory

SECRET = "one-chain-secret"
#: The engines' blocks: enough for a prompt of 3 chunks of 64 tokens (4 blocks each).
NUM_BLOCKS = 24


class Chain:
    """The fleet of one test: redis, nodes a and b, an engine beside each, the router."""

    def __init__(
        self,
        redis: RedisServer,
        nodes: dict[str, ServerProcess],
        engines: dict[str, FakeEngine],
        router: RouterProcess,
    ) -> None:
        self.redis = redis
        self.nodes = nodes
        self.engines = engines
        self.router = router

    def prefix_decisions(self, name: str) -> float:
        labels = f'reason="prefix",replica="{self.engines[name].url}"'
        return self.router.metric("kvstore_router_decisions_total", labels)


@pytest.fixture
def chain(tmp_path: Path, server_factory: ServerFactory) -> Iterator[Chain]:
    with RedisServer(tmp_path / "redis") as redis:
        nodes = {
            name: server_factory(
                env={"KVSTORE_HASH_SECRET": SECRET},
                # The one place the chunk size is set.
                settings={"keys.chunk_size": 64, **cluster_settings(redis.url, f"node-{name}")},
            )
            for name in ("a", "b")
        }
        engines = {name: FakeEngine(name) for name in nodes}
        router = RouterProcess(
            tmp_path,
            [f"{engines[name].url}=node-{name}" for name in nodes],
            index_url=redis.url,  # no --namespace, no --chunk-size
            env={
                "KVSTORE_HASH_SECRET": SECRET,
                "KVSTORE_ROUTER_INDEX_TIMEOUT_S": "2.0",
                # Routing follows the index alone, not the router's own recent choices.
                "KVSTORE_ROUTER_PROVISIONAL_TTL_S": "0.001",
            },
        )
        try:
            yield Chain(redis, nodes, engines, router)
        finally:
            router.stop()
            for engine in engines.values():
                engine.close()


def _engine_config() -> Any:
    config = stand_in_vllm_config()
    config.model_config.max_model_len = 1024
    return config


def _kv_config() -> Any:
    config = stand_in_kv_cache_config()
    return SimpleNamespace(num_blocks=NUM_BLOCKS, kv_cache_groups=config.kv_cache_groups)


def save_through_the_connector(target: str, tokens: list[int]) -> tuple[int, list[bytes]]:
    """An engine's connector on ``target`` with no chunk size of its own (a fresh engine: both
    halves ask the node at start) saves ``tokens``' whole chunks; its chunk size and keys."""
    settings = ConnectorSettings.from_extra_config(
        {"target": target}, env={"KVSTORE_HASH_SECRET": SECRET}
    )
    side = SchedulerSide(settings, _engine_config(), _kv_config())
    worker = WorkerSide(settings, _engine_config(), _kv_config())
    try:
        chunk = side._settings.chunk_size
        assert worker._settings.chunk_size == chunk
        manager = StandInManager()
        side.bind_kv_cache_manager(manager)  # type: ignore[arg-type]
        request = stand_in_request("r", tokens)
        side.get_num_new_matched_tokens(request, 0)
        manager.blocks["r"] = list(range(len(tokens) // BLOCK + 1))
        plan = side.build_connector_meta(stand_in_output([("r", 0, len(tokens))]))
        keys = [bytes(k) for k in side._state(request).keys]
        # Named as the node says: chunks of its size, with the declared namespace and secret.
        expected = ChunkHasher(chunk, side._base, secret=SECRET.encode()).keys(tokens)
        assert keys == [bytes(k) for k in expected]
        assert [key for spec in plan.saves for key in spec.keys] == keys
        worker.register_kv_caches(random_caches(1))
        worker.wait_for_save(plan)
    finally:
        worker.shutdown()  # waits for the queued puts to reach the store
        side.shutdown()
    return chunk, keys


def wait_router_names(chain: Chain, chunk: int) -> None:
    """Until the router logs that it names chunks of ``chunk`` tokens as the fleet does (it
    reads the nodes' schemes again when a request comes and the last read is old)."""
    line = f"naming chunks as the fleet does: chunk_size={chunk} hash=xxh3_128 model='test-model'"
    poll(
        lambda: (
            chain.router.complete(list(range(90_000, 90_010)), max_tokens=1) is not None
            and line in chain.router.stderr()
        ),
        30,
        f"the router naming chunks of {chunk}",
        every=0.25,
    )


def test_the_nodes_chunk_size_decides_connector_node_and_router(chain: Chain) -> None:
    tokens = list(range(1000, 1000 + 3 * 64 + 5))
    url = chain.redis.url
    node_a = chain.nodes["a"]

    chunk, keys = save_through_the_connector(node_a.target, tokens)
    assert (chunk, len(keys)) == (64, 3)
    poll(lambda: index_leading(url, keys).get("node-a") == 3, 20, "node-a's entries")
    (declared,) = published_schemes(url, "node-a") or [None]
    assert declared is not None and declared.chunk_size == 64 and declared.namespace is not None
    wait_router_names(chain, 64)

    router = chain.router
    router.complete(tokens, max_tokens=1)
    assert chain.engines["a"].prompts()[-1] == tokens
    assert chain.prefix_decisions("a") == 1 and chain.prefix_decisions("b") == 0

    # Change the chunk size in one place: the nodes' setting (a restart), nothing else.
    for node in chain.nodes.values():
        node.settings["keys.chunk_size"] = 32
        node.restart()
    chunk, keys = save_through_the_connector(node_a.target, tokens)  # the engine restarts too
    assert (chunk, len(keys)) == (32, 6)
    poll(lambda: index_leading(url, keys).get("node-a") == 6, 20, "node-a's new entries")
    (declared,) = published_schemes(url, "node-a") or [None]
    assert declared is not None and declared.chunk_size == 32
    wait_router_names(chain, 32)

    router.complete(tokens, max_tokens=1)
    assert chain.engines["a"].prompts()[-1] == tokens
    assert chain.prefix_decisions("a") == 2 and chain.prefix_decisions("b") == 0
    log = router.stderr()
    assert "refused for prefix routing" not in log and "deprecated" not in log, log
    assert router.metric("kvstore_router_key_scheme_reads_total", "") >= 2
