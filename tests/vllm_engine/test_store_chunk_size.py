"""Real vLLM engines whose connector config sets no chunk size name chunks as their store's node
says (``keys.chunk_size``), not by the connector's default.

The store is a real ``kvstore serve`` with ``keys.chunk_size = 128`` (half the default), publishing
to the cluster index in a real redis-server, where the test reads what the engines declared
(:mod:`harness.node_schemes`). Engine A saves its prompt's
whole chunks; engine B, a separate process with an empty prefix cache, loads them: its cached
tokens are the shared prefix in 128-token chunks (384 of a 400-token prefix, where the default
256 would give 256). Runtime: the start-up of two engine processes, about a minute on two cores.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from harness.node_schemes import cluster_settings, published_schemes
from harness.redis_server import RedisServer
from harness.serve import ServerProcess
from harness.vllm_engine_runs import Engine
from harness.vllm_fleet import build_model

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

NODE_CHUNK = 128
PREFIX = 400


def test_engines_without_a_chunk_size_use_the_nodes(tmp_path: Path) -> None:
    model = build_model(tmp_path)
    rng = random.Random(20261126)
    prefix = [rng.randrange(3, 1000) for _ in range(PREFIX)]
    a_prompt = prefix + [rng.randrange(3, 1000) for _ in range(37)]
    b_prompt = prefix + [rng.randrange(3, 1000) for _ in range(53)]
    redis = RedisServer(tmp_path / "redis")
    settings = {"keys.chunk_size": NODE_CHUNK, **cluster_settings(redis.url, "n")}
    with redis, ServerProcess(tmp_path / "node", settings=settings) as node:
        flags = ("--connector", "kvstore", "--target", node.target, "--chunk-size", "0")
        Engine("engine_a", tmp_path, model, [a_prompt], *flags).result()
        engine_b = Engine("engine_b", tmp_path, model, [b_prompt], *flags)
        (got,) = engine_b.result()["results"]
        assert got["num_cached_tokens"] == PREFIX // NODE_CHUNK * NODE_CHUNK
        assert f"chunk {NODE_CHUNK} tokens" in engine_b.log.read_text(errors="replace")
        # Both engines declared the same namespace: the node serves one scheme (published at
        # once on each declaration, long before engine B's result).
        published = published_schemes(redis.url, "n") or []
        assert [(s.chunk_size, s.namespace is not None) for s in published] == [(NODE_CHUNK, True)]
