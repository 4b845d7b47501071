"""End to end through a real vLLM engine: retention asked per request in ``kv_transfer_params``.

Engine A serves three prompts: one asking ``kvstore_retention_s``, one plain, one asking
``kvstore_retention_tiers: "none"``. Then a flood of one-off blocks, far more than the store's
tiers hold, goes into the store. Engine B, a separate process with an empty prefix cache, serves
the same three prefixes: the retained one is loaded from kvstore, the plain one was evicted by
the flood and is recomputed, the one that asked not to be stored never was (issue 31's
done-when, on the real engine).

Needs vLLM's CPU build; skipped without it unless ``KVSTORE_REQUIRE_VLLM=1``. Runtime: about a
minute on two cores (two engine start-ups).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from harness.serve import ServerProcess
from harness.vllm_engine_runs import CHUNK, Engine
from harness.vllm_fleet import build_model

from kvstore import KVStoreClient, Namespace

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

PREFIX = 1024  # four whole chunks
PARAMS = [{"kvstore_retention_s": 3600}, None, {"kvstore_retention_tiers": "none"}]
FLOOD_BLOCKS = 96  # 1 MiB each: three times what the store's tiers hold together


def _prompts() -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(20261126)
    prefixes = [[rng.randrange(3, 1000) for _ in range(PREFIX)] for _ in PARAMS]
    a = [p + [rng.randrange(3, 1000) for _ in range(37)] for p in prefixes]
    b = [p + [rng.randrange(3, 1000) for _ in range(53)] for p in prefixes]
    return a, b


def test_a_retained_prompt_outlives_a_flood_and_a_none_prompt_is_never_stored(
    tmp_path: Path,
) -> None:
    model = build_model(tmp_path)
    store = ServerProcess(
        tmp_path / "store", settings={"dram.capacity": "16MiB", "nvme.capacity": "16MiB"}
    ).start()
    try:
        a_prompts, b_prompts = _prompts()
        params = tmp_path / "params.json"
        params.write_text(json.dumps(PARAMS))
        connector = ["--connector", "kvstore", "--target", store.target]
        asked = ["--kv-transfer-params", str(params), "--sequential"]
        Engine("engine_a", tmp_path, model, a_prompts, *connector, *asked).result()
        stats = store.stats()
        chunks = (PREFIX + 37) // CHUNK
        # The retained and the plain prompt are stored; the "none" one is not.
        assert stats["blocks"] == 2 * chunks
        assert stats["tiers"]["dram"]["retained_blocks"] == chunks

        rng = np.random.default_rng(0)
        flood = Namespace(model="one-off prompts")
        with KVStoreClient(store.target, namespace=flood, timeout=30) as client:
            for _ in range(FLOOD_BLOCKS):
                client.put([rng.bytes(16)], [rng.bytes(1 << 20)])
        stats = store.stats()
        assert stats["tiers"]["dram"]["retained_blocks"] == chunks
        assert stats["tiers"]["dram"]["retained_evicted_early"] == 0

        engine_b = Engine("engine_b", tmp_path, model, b_prompts, *connector, "--sequential")
        kept, plain, never = engine_b.result()["results"]
        assert kept["num_cached_tokens"] == PREFIX  # loaded from kvstore
        assert plain["num_cached_tokens"] == 0  # evicted by the flood: recomputed
        assert never["num_cached_tokens"] == 0  # asked not to be stored: never was
    finally:
        store.close()
