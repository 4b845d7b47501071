"""End to end: two real vLLM engines share prompt KV through a real ``kvstore serve``.

Engine A serves prompts with long prefixes and saves their chunks; engine B, a separate process
with an empty local prefix cache, serves the same prefixes with other suffixes and must load the
stored chunks (vLLM's cached-token count says so) and still produce, token for token, the greedy
output of an engine without any connector. Then, with the store stopped, B must still produce the
same output (it recomputes) without hanging.

Needs vLLM's CPU build (``pip install -e '.[vllm]'``-style environment); skipped without it unless
``KVSTORE_REQUIRE_VLLM=1``, which turns the skip into a failure (for CI). Runtime: about two and
a half minutes on two cores, mostly the start-up of four engine processes.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from harness.serve import ServerProcess
from harness.vllm_engine_runs import CHUNK, Engine
from harness.vllm_fleet import build_model

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

# Prefix lengths: chunk-aligned, unaligned (the last stored chunk of A then holds some of A's
# suffix, so B can load one chunk fewer), and short.
PREFIX_LENGTHS = (1024, 1000, 700)


def _prompts() -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(20261123)
    prefixes = [[rng.randrange(3, 1000) for _ in range(n)] for n in PREFIX_LENGTHS]
    a = [p + [rng.randrange(3, 1000) for _ in range(37)] for p in prefixes]
    b = [p + [rng.randrange(3, 1000) for _ in range(53)] for p in prefixes]
    return a, b


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-e2e")


@pytest.fixture(scope="module")
def model(workdir: Path) -> Path:
    return build_model(workdir)


@pytest.fixture(scope="module")
def reference(workdir: Path, model: Path) -> Engine:
    """Engine B's prompts on an engine without any connector, started early to overlap."""
    _, b_prompts = _prompts()
    return Engine("reference", workdir, model, b_prompts)


def test_replica_loads_shared_prefixes_from_kvstore(
    workdir: Path, model: Path, store: ServerProcess, reference: Engine
) -> None:
    a_prompts, b_prompts = _prompts()
    engine_a = Engine(
        "engine_a", workdir, model, a_prompts, "--connector", "kvstore", "--target", store.target
    )
    engine_a.result()
    # A saved every whole chunk of its prompts (1024 + 1037 + 737 tokens -> 4 + 4 + 2 chunks).
    assert store.stats()["blocks"] == sum((n + 37) // CHUNK for n in PREFIX_LENGTHS)

    engine_b = Engine(
        "engine_b", workdir, model, b_prompts, "--connector", "kvstore", "--target", store.target
    )
    got = engine_b.result()["results"]
    want = reference.result()["results"]

    for i, (prefix_len, g, w) in enumerate(zip(PREFIX_LENGTHS, got, want, strict=True)):
        # B's own prefix cache is empty and its prompts share nothing with each other, so every
        # cached token came from kvstore: all whole chunks of the shared prefix.
        assert g["num_cached_tokens"] == prefix_len // CHUNK * CHUNK, f"prompt {i}"
        assert w["num_cached_tokens"] == 0, f"prompt {i}"
        assert g["tokens"] == w["tokens"], f"prompt {i}: output differs from recompute"


def test_replica_recomputes_when_store_is_down(
    workdir: Path, model: Path, store: ServerProcess, reference: Engine
) -> None:
    _, b_prompts = _prompts()
    store.stop()
    engine = Engine(
        "engine_b_store_down",
        workdir,
        model,
        b_prompts,
        "--connector",
        "kvstore",
        "--target",
        store.target,
        "--timeout-s",
        "2",
    )
    got = engine.result()
    want = reference.result()["results"]
    for i, (g, w) in enumerate(zip(got["results"], want, strict=True)):
        assert g["num_cached_tokens"] == 0, f"prompt {i}"
        assert g["tokens"] == w["tokens"], f"prompt {i}: output differs from recompute"
    # Generation itself (start-up excluded) must not wait on the dead store.
    assert max(r["latency_s"] for r in got["results"]) < 30
