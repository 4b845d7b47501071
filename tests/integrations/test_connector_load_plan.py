"""The connector's load-or-recompute decision (kvstore.integrations.vllm.cost) and the scheduler
half consulting it, without vLLM: the stand-ins of :mod:`harness.connector_sides`, whose
:class:`FakeStore` reports each chunk's tier and answers ``stats`` with the rates a test sets.
The decision itself on rates alone is tested in tests/test_cost_model.py."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from harness.connector_sides import (
    CHUNK,
    FakeStore,
    answer_when_known,
    chunk_keys_of,
    connector_settings,
    stand_in_kv_cache_config,
    stand_in_vllm_config,
)
from harness.vllm_scheduler import stand_in_output, stand_in_request

from kvstore.errors import ConfigError
from kvstore.integrations.vllm.cost import LoadDecider, dtype_bytes
from kvstore.integrations.vllm.scheduler import SchedulerSide
from kvstore.protocol.rates import LATENCY_KEY, RATE_KEY, Rate

# One chunk of the stand-in engine: 2 layers x (K, V) x 2 heads x 8 x bf16 per token.
CHUNK_BYTES = CHUNK * 2 * 2 * 2 * 8 * 2
FAST = {RATE_KEY: 10_000_000_000, LATENCY_KEY: 0}
# So slow (1 kB/s: seconds per chunk) that recomputing wins on any machine at any load.
CRAWL = {RATE_KEY: 1_000, LATENCY_KEY: 0}


def _decider(policy: str = "cost") -> LoadDecider:
    return LoadDecider(policy, chunk_tokens=CHUNK, chunk_bytes=CHUNK_BYTES, scale=0.0)


def test_dtype_bytes() -> None:
    assert [dtype_bytes(d) for d in ("bfloat16", "float32", "float8_e4m3fn", "int8")] == [
        2,
        4,
        1,
        1,
    ]
    assert dtype_bytes("odd") == 2


def test_policies_always_and_never_ignore_the_rates() -> None:
    tiers = ["redis"] * 4
    for policy, load in (("always", 4), ("never", 0)):
        decider = _decider(policy)
        decider.take_store_stats({"tiers": {"redis": CRAWL}})
        assert decider.rates_due(0.0) is False  # nothing to refresh: no rates are used
        plan = decider.decide("r", tiers, 0)
        assert (plan.load, plan.hits) == (load, 4) and policy in plan.reason


def test_inputs_from_stats_steps_and_loads() -> None:
    decider = _decider()
    assert decider.rates_due(100.0) and not decider.rates_due(100.5)
    decider.take_store_stats(
        {
            "tiers": {"dram": FAST, "redis": {RATE_KEY: 300_000_000, LATENCY_KEY: 500}},
            "counters": {"peer_read_bytes_per_s": 500_000_000, "peer_read_latency_us": 200},
        }
    )
    # Two steps of 1,000 units, the second planned while the first ran (asynchronous
    # scheduling): it is timed from the first one's end.
    decider.step_planned(1000.0, 10.0)
    decider.step_planned(1000.0, 10.05)
    decider.step_done(10.1)
    decider.step_done(10.2)
    decider.step_done(10.3)  # an output with no step planned: ignored
    decider.loads_done(CHUNK_BYTES, 0.001)
    inputs = decider.inputs()
    assert inputs["tiers"]["redis"] == Rate(3e8, 5e-4)
    assert inputs["tiers"]["peer"] == Rate(5e8, 2e-4)
    assert inputs["prefill"].per_s == pytest.approx(10_000)
    assert inputs["transfer"].per_s == pytest.approx(CHUNK_BYTES / 0.001)
    # A step's loads are not prefill: a step of 1,000 units that spent 0.1 s of its 0.2 s
    # loading computed at 10,000 units/s.
    fresh = _decider()
    fresh.step_planned(1000.0, 0.0)
    fresh.step_done(0.2, load_s=0.1)
    assert fresh.inputs()["prefill"].per_s == pytest.approx(10_000)


def test_a_decision_that_declines_logs_at_info_with_its_inputs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    decider = _decider()
    decider.take_store_stats({"tiers": {"dram": FAST, "redis": CRAWL}})
    decider.step_planned(CHUNK * 10.0, 0.0)
    decider.step_done(0.01)  # 10 chunks in 10 ms
    with caplog.at_level(logging.DEBUG, logger="kvstore.integrations.vllm.cost"):
        assert decider.decide("fast", ["dram"] * 3, 0).load == 3
        assert decider.decide("slow", ["dram"] * 3 + ["redis"] * 2, 0).load == 3
    levels = {r.getMessage().split(":")[0]: r.levelno for r in caplog.records}
    assert levels == {
        "kvstore load plan fast": logging.DEBUG,
        "kvstore load plan slow": logging.INFO,
    }
    line = caplog.records[-1].getMessage()
    assert "load 3 of 5 stored chunks" in line and "redis x2 at 0.0 MB/s" in line


def test_an_unknown_load_policy_is_refused_with_the_allowed_values() -> None:
    with pytest.raises(ConfigError, match=r"load_policy.*'sometimes'.*cost, always, never"):
        connector_settings(load_policy="sometimes")


@pytest.fixture()
def sides(store: FakeStore) -> Iterator[dict[str, SchedulerSide]]:
    made = {
        policy: SchedulerSide(
            connector_settings(load_policy=policy),
            stand_in_vllm_config(),
            stand_in_kv_cache_config(),
            client=store,
        )
        for policy in ("cost", "always", "never")
    }
    yield made
    for side in made.values():
        side.shutdown()


@pytest.fixture()
def store() -> FakeStore:
    return FakeStore()


def _measure_a_step(side: SchedulerSide) -> None:
    """One engine step through the scheduler half's hooks: 4 chunks' prefill, timed."""
    side.build_connector_meta(stand_in_output([("warm", 0, 4 * CHUNK)]))
    time.sleep(0.005)  # sleep: the step's forward pass (a stand-in's work)
    side.update_connector_output(0, [])


def _wait_for_rates(side: SchedulerSide, tier: str) -> None:
    side.get_num_new_matched_tokens(stand_in_request("rates", [7] * (2 * CHUNK + 1)), 0)
    deadline = time.monotonic() + 10
    while tier not in side.decider.inputs()["tiers"]:
        assert time.monotonic() < deadline, "the store's rates never arrived"
        time.sleep(0.01)


def test_the_scheduler_loads_up_to_the_slow_tier_and_counts_the_rest_declined(
    sides: dict[str, SchedulerSide], store: FakeStore, caplog: pytest.LogCaptureFixture
) -> None:
    tokens = list(range(5 * CHUNK + 3))
    keys = chunk_keys_of(sides["cost"], stand_in_request("probe", tokens))
    for index, key in enumerate(keys):
        store.chunks[key] = torch.zeros(1)
        store.tiers[key] = "dram" if index < 3 else "redis"
    store.stats_answer = {"tiers": {"dram": FAST, "redis": CRAWL}, "counters": {}}
    side = sides["cost"]
    _wait_for_rates(side, "redis")
    _measure_a_step(side)
    with caplog.at_level(logging.INFO, logger="kvstore.integrations.vllm.cost"):
        assert answer_when_known(side, stand_in_request("a", tokens), 0) == 3 * CHUNK
        # Asked again (vLLM does, e.g. after a preemption): the same decision, made once.
        assert side.get_num_new_matched_tokens(stand_in_request("a", tokens), 0) == (
            3 * CHUNK,
            False,
        )
    assert len([r for r in caplog.records if "load 3 of 5" in r.getMessage()]) == 1
    # The declined chunks are brought up into dram for the next request with this prefix.
    deadline = time.monotonic() + 10
    while store.prefetched != keys[3:]:
        assert time.monotonic() < deadline, store.prefetched
        time.sleep(0.01)
    stats: dict[str, Any] = side.take_stats() or {}
    assert stats["hit_tokens"] == 5 * CHUNK and stats["declined_tokens"] == 2 * CHUNK
    # Turned off: every hit loads, as before; forced: none does.
    assert answer_when_known(sides["always"], stand_in_request("b", tokens), 0) == 5 * CHUNK
    assert answer_when_known(sides["never"], stand_in_request("c", tokens), 0) == 0


def test_without_measured_rates_every_hit_loads(
    sides: dict[str, SchedulerSide], store: FakeStore
) -> None:
    tokens = list(range(4 * CHUNK + 1))
    for key in chunk_keys_of(sides["cost"], stand_in_request("probe", tokens)):
        store.chunks[key] = torch.zeros(1)
        store.tiers[key] = "redis"
    store.stats_answer = {"tiers": {"redis": CRAWL}, "counters": {}}
    side = sides["cost"]
    _wait_for_rates(side, "redis")
    # No step measured yet: no prefill rate, so the slow tier is loaded all the same.
    assert answer_when_known(side, stand_in_request("a", tokens), 0) == 4 * CHUNK
    _measure_a_step(side)
    assert answer_when_known(side, stand_in_request("b", tokens), 0) == 0
