"""The vLLM connector's figures without vLLM: the counters, their sums, and what each half counts.

The halves run as in test_connector_logic.py (its stand-ins for vLLM's objects and its in-memory
:class:`FakeStore`); the same figures from a real engine into vLLM's ``/metrics`` are tested in
tests/vllm_engine/test_engine_metrics.py.
"""

from __future__ import annotations

import threading

import pytest
import torch
from harness.connector_sides import (
    BLOCK,
    CHUNK,
    LAYERS,
    FakeStore,
    answer_when_known,
    connector_settings,
    random_caches,
    stand_in_kv_cache_config,
    stand_in_vllm_config,
)
from harness.connector_sides import scheduler as scheduler  # fixtures, shared
from harness.connector_sides import store as store
from harness.connector_sides import worker as worker
from harness.polling import poll
from harness.vllm_scheduler import stand_in_request

from kvstore.integrations.vllm import stats as vllm_stats
from kvstore.integrations.vllm import worker as vllm_worker
from kvstore.integrations.vllm.common import LoadSpec, SaveSpec, StepPlan
from kvstore.integrations.vllm.scheduler import SchedulerSide
from kvstore.integrations.vllm.stats import ConnectorCounters
from kvstore.integrations.vllm.worker import WorkerSide

# -- the counters ------------------------------------------------------------------------------


def test_take_returns_what_was_recorded_once_then_nothing() -> None:
    counters = ConnectorCounters()
    assert counters.take() is None
    counters.record_lookup(512, 256, None)
    counters.record_lookup_latency(0.002)
    counters.record_load(256, {"missing": 256, "deadline": 0}, 0.01, "shm-dma")
    counters.record_save(768)
    counters.record_save_failed("backlog_full", 256)
    counters.record_declined(0)
    counters.record_declined(128)
    counters.record_group_bytes("sliding/1", 4096)
    counters.record_group_bytes("sliding/1", 0)
    counters.record_unsupported(["state"])
    data = counters.take()
    assert data == {
        "lookup_tokens": 512,
        "hit_tokens": 256,
        "declined_tokens": 128,
        "loaded_tokens": 256,
        "saved_tokens": 768,
        "load_failed_tokens": {"missing": 256},
        "save_failed_tokens": {"backlog_full": 256},
        "loaded_tokens_by_path": {"shm-dma": 256},
        "loaded_bytes_by_group": {"sliding/1": 4096},
        "unsupported_group_requests": {"state": 1},
        "lookup_seconds": [0.002],
        "load_seconds": [0.01],
    }
    assert counters.take() is None


def test_merge_sums_ranks_and_steps_and_summary_reports_the_sum() -> None:
    worker = {"loaded_tokens": 256, "load_failed_tokens": {"missing": 256}, "load_seconds": [0.5]}
    sched = {"lookup_tokens": 768, "hit_tokens": 512, "lookup_seconds": [0.001, 0.003]}
    total = vllm_stats.merge(vllm_stats.empty(), worker)
    vllm_stats.merge(total, sched)
    vllm_stats.merge(total, {"load_failed_tokens": {"missing": 256, "deadline": 256}})
    assert total["load_failed_tokens"] == {"missing": 512, "deadline": 256}
    assert total["lookup_seconds"] == [0.001, 0.003]
    assert not vllm_stats.is_empty(total)
    assert vllm_stats.is_empty(vllm_stats.empty())
    summary = vllm_stats.summary(total)
    assert summary["kvstore hit rate"] == round(512 / 768, 4)
    assert summary["kvstore loaded tokens"] == 256
    assert summary["kvstore load failed tokens (missing)"] == 512
    assert summary["kvstore load failed tokens (deadline)"] == 256
    assert summary["kvstore avg lookup ms"] == 2.0
    assert summary["kvstore avg load ms"] == 500.0
    assert vllm_stats.summary(vllm_stats.empty())["kvstore hit rate"] == 0.0


def test_counters_lose_nothing_to_concurrent_recorders() -> None:
    counters = ConnectorCounters()

    def record() -> None:
        for _ in range(1000):
            counters.record_save(1)

    threads = [threading.Thread(target=record) for _ in range(4)]
    for thread in threads:
        thread.start()
    taken = 0
    while any(t.is_alive() for t in threads):
        taken += (counters.take() or {}).get("saved_tokens", 0)
    for thread in threads:
        thread.join()
    taken += (counters.take() or {}).get("saved_tokens", 0)
    assert taken == 4000


# -- what the halves count ---------------------------------------------------------------------


def test_the_scheduler_counts_loadable_tokens_looked_up_and_hit(
    scheduler: tuple[SchedulerSide, object],
    store: FakeStore,
) -> None:
    side, _ = scheduler
    request = stand_in_request("r", list(range(3 * CHUNK + 5)))
    keys = side._state(request).keys
    store.chunks[keys[0]] = torch.zeros(1)
    assert answer_when_known(side, request, 0) == CHUNK
    data = side.take_stats()
    assert data is not None
    assert (data["lookup_tokens"], data["hit_tokens"]) == (3 * CHUNK, CHUNK)
    assert len(data["lookup_seconds"]) == 1
    answer_when_known(side, request, 0)  # answered before: not counted again
    assert side.take_stats() is None


def test_the_worker_counts_loaded_failed_and_saved_tokens(
    worker: WorkerSide,
    store: FakeStore,
) -> None:
    worker.register_kv_caches(random_caches(1))
    keys = [bytes([i]) * 16 for i in range(3)]
    worker.wait_for_save(StepPlan(saves=[SaveSpec("a", keys[:2], list(range(4)))]))
    poll(lambda: len(store.chunks) == 2, 10, "saved chunks never reached the store")
    poll(
        lambda: worker.counters._data["saved_tokens"] == 2 * CHUNK, 10, "the put was never counted"
    )
    assert worker.take_stats() == {**vllm_stats.empty(), "saved_tokens": 2 * CHUNK}

    # Chunk 0 is half in vLLM's prefix cache already (-1): only its new block counts as loaded.
    plan = StepPlan(loads=[LoadSpec("b", keys, [-1, 10, 11, 12, 13, 14])])
    worker.start_load_kv(plan)
    for layer in range(LAYERS):
        worker.wait_for_layer_load(f"layers.{layer}.attn")
    worker.wait_for_save(plan)
    data = worker.take_stats()
    assert data is not None
    assert data["loaded_tokens"] == BLOCK + CHUNK
    assert data["loaded_tokens_by_path"] == {store.data_plane: BLOCK + CHUNK}  # a get
    assert data["load_failed_tokens"] == {"missing": CHUNK}
    assert len(data["load_seconds"]) == 1


def test_a_dead_store_counts_its_failures_by_reason(
    worker: WorkerSide,
    store: FakeStore,
) -> None:
    worker.register_kv_caches(random_caches(2))
    store.down = True
    plan = StepPlan(loads=[LoadSpec("x", [bytes(16)], [5, 6])])
    worker.start_load_kv(plan)
    for layer in range(LAYERS):
        worker.wait_for_layer_load(f"layers.{layer}.attn")
    worker.wait_for_save(plan)
    assert (worker.take_stats() or {})["load_failed_tokens"] == {"unavailable": CHUNK}
    # The breaker is open now: the next load is not even tried.
    worker.start_load_kv(plan)
    for layer in range(LAYERS):
        worker.wait_for_layer_load(f"layers.{layer}.attn")
    worker.wait_for_save(plan)
    data = worker.take_stats() or {}
    assert data["load_failed_tokens"] == {"store_down": CHUNK}
    assert data["load_seconds"] == []


def test_only_the_first_rank_reports(
    store: FakeStore,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every rank loads and saves the same chunks; the engine's figures count them once.
    monkeypatch.setattr(vllm_worker, "_ranks", lambda config: (1, 0))
    side = WorkerSide(
        connector_settings(),
        stand_in_vllm_config(tp_size=2),
        stand_in_kv_cache_config(),
        client=store,
    )
    try:
        side.counters.record_save(CHUNK)
        assert side.take_stats() is None
    finally:
        side.shutdown()
