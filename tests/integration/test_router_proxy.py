"""``kvstore router`` as a real subprocess, with two real ``kvstore serve`` nodes publishing to
the cluster index in a real redis-server, in front of two fake engines (real HTTP servers
standing in for vLLM replicas: see :mod:`fake_engine`; the vLLM suite runs real ones).

A prompt whose chunks node A holds goes to A's replica; a burst of one new prefix goes to one
replica (provisional entries); streaming responses pass through intact; with Redis stopped,
requests still succeed, routed by load, and the fallback metric counts them.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from harness.polling import poll
from harness.router_index import (
    index_leading,
    node_env,
    store,
    tokens,
)

if TYPE_CHECKING:
    from harness.server_factory import ServerFactory

from harness.fake_engine import FakeEngine, stream_events
from harness.redis_server import RedisServer
from harness.router import RouterProcess


@pytest.fixture
def setup(
    tmp_path: Path, server_factory: ServerFactory
) -> Iterator[tuple[RedisServer, Any, Any, FakeEngine, FakeEngine, RouterProcess]]:
    with RedisServer(tmp_path / "redis") as redis_server:
        a = server_factory(env=node_env(redis_server.url, "node-a"))
        b = server_factory(env=node_env(redis_server.url, "node-b"))
        engine_a, engine_b = FakeEngine("a", delay_s=0.3), FakeEngine("b", delay_s=0.3)
        router = RouterProcess(
            tmp_path,
            [f"{engine_a.url}=node-a", f"{engine_b.url}=node-b"],
            index_url=redis_server.url,
            # The burst stays on one replica while its hit outweighs the load (see scoring).
            env={
                "KVSTORE_ROUTER_REQUEST_COST_TOKENS": "16",
                "KVSTORE_ROUTER_INDEX_TIMEOUT_S": "1.0",
            },
        )
        try:
            yield redis_server, a, b, engine_a, engine_b, router
        finally:
            router.stop()
            engine_a.close()
            engine_b.close()


def test_router_follows_the_index_keeps_bursts_streams_and_survives_redis(
    setup: tuple[RedisServer, Any, Any, FakeEngine, FakeEngine, RouterProcess],
) -> None:
    redis_server, a, b, engine_a, engine_b, router = setup
    assert router.call("GET", "/health")[0] == 200
    status, models = router.call("GET", "/v1/models")
    assert status == 200 and json.loads(models)["data"][0]["id"] == "fake"

    # Prompts whose chunks a node holds go to that node's replica, whatever the order.
    on_a, on_b = tokens(0, 8), tokens(50_000, 8)
    keys_a, keys_b = store(a, on_a), store(b, on_b)
    poll(lambda: index_leading(redis_server.url, keys_a).get("node-a") == 8, 10, "a's blocks")
    poll(lambda: index_leading(redis_server.url, keys_b).get("node-b") == 8, 10, "b's blocks")
    for prompt in (on_b, on_a, on_a, on_b, on_a):
        router.complete(prompt, max_tokens=1)
    assert engine_a.prompts() == [on_a] * 3
    assert engine_b.prompts() == [on_b] * 2
    assert (
        router.metric("kvstore_router_decisions_total", f'reason="prefix",replica="{engine_a.url}"')
        == 3
    )

    # A burst of one new prefix (in no index yet) stays on one replica.
    burst = tokens(100_000, 16)
    threads = [threading.Thread(target=router.complete, args=(burst,)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    got = [engine.prompts().count(burst) for engine in (engine_a, engine_b)]
    assert sorted(got) == [0, 4], got

    # A streamed response passes through intact, event by event.
    status, streamed = router.call("POST", "/v1/completions", {"prompt": on_b, "stream": True})
    assert status == 200
    assert streamed == stream_events("b", 5)

    # Redis gone: every request still succeeds, by load, and the fallbacks are counted.
    redis_server.kill()
    before = len(engine_a.requests) + len(engine_b.requests)
    for _ in range(4):
        router.complete(on_a)
    assert len(engine_a.requests) + len(engine_b.requests) == before + 4
    fallbacks = sum(
        router.metric("kvstore_router_fallbacks_total", f'reason="{reason}"')
        for reason in ("index_timeout", "index_error", "index_down")
    )
    assert fallbacks == 4
    assert router.metric("kvstore_router_index_errors_total", "") >= 1
