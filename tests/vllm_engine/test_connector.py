"""The connector's two halves driven directly, without an engine: planning, loads, saves, failures.

The engine's configuration and scheduler objects are small stand-ins carrying only the fields the
connector reads (the scheduler's are :mod:`harness.vllm_scheduler`'s); the store is a real
``kvstore serve`` and the KV caches are real CPU tensors in vLLM's CPU layout. What the engine
itself does with the plans is covered by test_vllm_e2e.py.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from harness.connector_sides import (
    answer_when_known,
    random_caches,
    stand_in_kv_cache_config,
    stand_in_vllm_config,
)
from harness.ports import free_port
from harness.serve import ServerProcess
from harness.vllm_scheduler import StandInBlocks, StandInManager, stand_in_output, stand_in_request

from kvstore.errors import ConfigError
from kvstore.integrations.vllm.common import (
    ConnectorSettings,
    LoadSpec,
    StepPlan,
    base_namespace,
    engine_shape,
    rank_keys,
)
from kvstore.integrations.vllm.scheduler import SchedulerSide
from kvstore.integrations.vllm.worker import WorkerSide

pytestmark = pytest.mark.vllm

BLOCK = 32
CHUNK = 64  # two blocks per chunk
LAYERS = 3
NUM_BLOCKS = 40


def _vllm_config(model: str = "test-model") -> Any:
    return stand_in_vllm_config(model=model, max_model_len=4 * CHUNK)


def _kv_cache_config() -> Any:
    return stand_in_kv_cache_config(block=BLOCK, layers=LAYERS, num_blocks=NUM_BLOCKS, head_size=32)


def _settings(target: str, **extra: Any) -> ConnectorSettings:
    return ConnectorSettings.from_extra_config({"target": target, "chunk_size": CHUNK, **extra})


def _caches(seed: int) -> dict[str, torch.Tensor]:
    return random_caches(seed, layers=LAYERS, num_blocks=NUM_BLOCKS, block=BLOCK, width=64)


def _drain(worker: WorkerSide, req_ids: set[str]) -> set[str]:
    """Report ``req_ids`` finished until the worker says their saves have read their blocks."""
    done: set[str] = set()
    deadline = time.monotonic() + 10
    while done != req_ids and time.monotonic() < deadline:
        finished, _ = worker.get_finished(req_ids)
        done |= finished or set()
        time.sleep(0.01)
    return done


def _wait_stored(side: SchedulerSide, request: Any, chunks: int) -> None:
    """Wait for the put thread: a fresh lookup of the request must see ``chunks`` chunks."""
    deadline = time.monotonic() + 10
    keys = side._state(request).keys[:chunks]
    while side._client.lookup(keys) < chunks:
        assert time.monotonic() < deadline, "saved chunks never reached the store"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """This module's store (in place of the suite's): a node whose ``keys.chunk_size`` is the
    module's CHUNK, which the connectors take from it."""
    server = ServerProcess(
        tmp_path_factory.mktemp("store"),
        settings={"dram.capacity": "1GiB", "keys.chunk_size": CHUNK},
        name="store",
    )
    with server:
        yield server


@pytest.fixture()
def pair(store: ServerProcess) -> Iterator[tuple[SchedulerSide, WorkerSide, StandInManager]]:
    settings = _settings(store.target)
    scheduler = SchedulerSide(settings, _vllm_config(), _kv_cache_config())
    worker = WorkerSide(settings, _vllm_config(), _kv_cache_config())
    manager = StandInManager()
    scheduler.bind_kv_cache_manager(manager)
    yield scheduler, worker, manager
    worker.shutdown()
    scheduler.shutdown()


def test_settings_are_validated() -> None:
    with pytest.raises(ConfigError, match="target"):
        ConnectorSettings.from_extra_config({})
    with pytest.raises(ConfigError, match="unknown"):
        ConnectorSettings.from_extra_config({"target": "h:1", "chunk_sise": 256})
    with pytest.raises(ConfigError, match="chunk_size"):
        ConnectorSettings.from_extra_config({"target": "h:1", "chunk_size": 0})
    with pytest.raises(ConfigError, match="multiple of the engine's block size"):
        SchedulerSide(_settings("127.0.0.1:1", chunk_size=48), _vllm_config(), _kv_cache_config())


def test_save_then_load_round_trips_blocks(
    pair: tuple[SchedulerSide, WorkerSide, StandInManager],
) -> None:
    scheduler, worker, manager = pair
    tokens = list(range(100, 100 + 3 * CHUNK + 5))  # three whole chunks and a tail
    source = _caches(1)
    worker.register_kv_caches(source)

    # Replica A: a miss, then the prefill step saves the three whole chunks.
    req_a = stand_in_request("a", tokens)
    assert answer_when_known(scheduler, req_a, 0) == 0
    manager.blocks["a"] = list(range(7, 7 + 7))
    meta = scheduler.build_connector_meta(stand_in_output([("a", 0, len(tokens))]))
    assert [len(s.keys) for s in meta.saves] == [3]
    assert meta.saves[0].block_ids == list(range(7, 13))
    worker.wait_for_save(meta)
    assert scheduler.request_finished(req_a, manager.blocks["a"]) == (True, None)
    assert _drain(worker, {"a"}) == {"a"}
    _wait_stored(scheduler, req_a, 3)

    # Replica B (fresh caches): its local cache holds the first block, the store the rest.
    target = _caches(2)
    untouched = {name: t.clone() for name, t in target.items()}
    worker.register_kv_caches(target)
    req_b = stand_in_request("b", [*tokens[: 3 * CHUNK], 1, 2, 3])
    assert answer_when_known(scheduler, req_b, BLOCK) == 3 * CHUNK - BLOCK
    b_blocks = [30, 20, 21, 22, 23, 24, 25]
    scheduler.update_state_after_alloc(req_b, StandInBlocks(b_blocks), 3 * CHUNK - BLOCK)
    manager.blocks["b"] = b_blocks
    meta = scheduler.build_connector_meta(stand_in_output([("b", 3 * CHUNK, 3)]))
    assert meta.saves == []  # everything B could save is in the store already
    (load,) = meta.loads
    assert load.block_ids == [-1, 20, 21, 22, 23, 24]  # block 30 is B's own: never written
    worker.start_load_kv(meta)
    for name in target:
        worker.wait_for_layer_load(name)
    worker.wait_for_save(meta)
    assert worker.get_block_ids_with_load_errors() == set()
    for name in target:
        for a_block, b_block in zip(range(8, 13), range(20, 25), strict=True):
            assert torch.equal(target[name][b_block], source[name][a_block])
        assert torch.equal(target[name][30], untouched[name][30])
        assert torch.equal(target[name][25], untouched[name][25])
    assert scheduler.request_finished(req_b, b_blocks) == (False, None)


def test_failed_load_is_reported_and_leaves_blocks_alone(
    pair: tuple[SchedulerSide, WorkerSide, StandInManager],
) -> None:
    scheduler, worker, _ = pair
    target = _caches(3)
    untouched = {name: t.clone() for name, t in target.items()}
    worker.register_kv_caches(target)
    # Plan a load of chunks the store never held (as after an eviction since the lookup).
    missing = scheduler._state(stand_in_request("x", list(range(5000, 5000 + 2 * CHUNK + 1)))).keys
    meta = StepPlan(loads=[LoadSpec("x", missing, [1, 2, 3, 4])])
    worker.start_load_kv(meta)
    for name in target:
        worker.wait_for_layer_load(name)
    worker.wait_for_save(meta)
    assert worker.get_block_ids_with_load_errors() == {1, 2, 3, 4}
    assert worker.get_block_ids_with_load_errors() == set()  # reported once
    for name in target:
        assert torch.equal(target[name], untouched[name])


def test_salt_separates_keys(pair: tuple[SchedulerSide, WorkerSide, StandInManager]) -> None:
    scheduler, _, _ = pair
    tokens = list(range(2 * CHUNK + 1))
    plain = scheduler._state(stand_in_request("p", tokens)).keys
    salted = scheduler._state(stand_in_request("s", tokens, cache_salt="tenant-7")).keys
    assert len(plain) == len(salted) == 2
    assert not set(plain) & set(salted)


def test_dead_store_costs_nothing() -> None:
    settings = _settings(f"127.0.0.1:{free_port()}", lookup_timeout_s=0.5)
    scheduler = SchedulerSide(settings, _vllm_config(), _kv_cache_config())
    try:
        started = time.monotonic()
        for i in range(20):
            request = stand_in_request(f"r{i}", list(range(i, i + 4 * CHUNK)))
            assert answer_when_known(scheduler, request, 0) == 0
        assert time.monotonic() - started < 3
    finally:
        scheduler.shutdown()


def test_slow_lookup_answers_not_known_yet(
    pair: tuple[SchedulerSide, WorkerSide, StandInManager],
) -> None:
    scheduler, _, _ = pair
    release = time.monotonic() + 0.3
    real = scheduler._client.lookup_tiers

    def slow_lookup(keys: Any, timeout: float | None = None) -> Any:
        time.sleep(max(0.0, release - time.monotonic()))  # sleep: a store slow to answer
        return real(keys, timeout=timeout)

    # The scheduler asks for the tiers too (its load plan weighs where each hit is).
    scheduler._client.lookup_tiers = slow_lookup  # type: ignore[method-assign]
    request = stand_in_request("slow", list(range(7, 7 + 2 * CHUNK + 1)))
    started = time.monotonic()
    assert scheduler.get_num_new_matched_tokens(request, 0) == (None, False)
    assert time.monotonic() - started < 0.1  # the scheduler was not held up
    assert answer_when_known(scheduler, request, 0) == 0


def test_each_rank_stores_under_its_own_keys() -> None:
    config = _vllm_config()
    config.parallel_config.tensor_parallel_size = 2
    settings = _settings("127.0.0.1:1")
    shape = engine_shape(config, _kv_cache_config(), pp_rank=0)
    keys = [bytes([i]) * 16 for i in range(3)]
    rank0 = rank_keys(keys, base_namespace(config, shape, settings, tp_rank=0), 0, 0)
    rank1 = rank_keys(keys, base_namespace(config, shape, settings, tp_rank=1), 1, 0)
    assert rank0 == keys  # rank 0 keeps the names the scheduler looks up
    assert len(set(rank1)) == 3 and not set(rank1) & set(keys)
    assert all(len(k) == 16 for k in rank1)


def test_the_metadata_vllm_carries_keeps_every_field_of_the_plan() -> None:
    from kvstore.integrations.vllm import KVStoreConnectorMetadata

    plan = StepPlan(
        loads=[LoadSpec("r", [b"k" * 16], [0, 1])],
        preempted_req_ids={"p"},
        chunk_size=CHUNK,  # what a worker checks its own against
    )
    meta = KVStoreConnectorMetadata.of(plan)
    for field in dataclasses.fields(StepPlan):
        assert getattr(meta, field.name) == getattr(plan, field.name), field.name
