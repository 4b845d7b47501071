"""The fleet simulator (``benchmarks/sim``): deterministic, bounded by the trace's ideal reuse,
routing that matters, kvstore's own eviction rules, and its validation driver on real nodes.

The last test starts a real redis-server and three real ``kvstore serve`` nodes (cluster index,
peer fetch) and replays a small window of a generated conversation workload on them and on the
simulator (the benchmark replays the Mooncake trace).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_load_plan import MODELS, scenario_config  # noqa: E402
from benchmarks.sim.node import SimNode, footprints, key_of  # noqa: E402
from benchmarks.sim.run import fleet_config  # noqa: E402
from benchmarks.sim.simulator import GIB, SimConfig, simulate  # noqa: E402
from benchmarks.sim.validate import run_real, run_sim, scaled_workload  # noqa: E402
from benchmarks.sim.workloads import (  # noqa: E402
    CONFIG_PATH,
    Request,
    Workload,
    build,
    ideal_hit_rate,
    load_config,
)
from kvstore.policy import Policy  # noqa: E402

CONFIG = load_config()


def fleet(nodes: int, **overrides: Any) -> SimConfig:
    return fleet_config(CONFIG, nodes, **overrides)


def zipf(nodes: int, seed: int = 7) -> Workload:
    return build(CONFIG["workloads"]["zipf"], nodes, seed)


def figures(result: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in result.items() if k != "wall_s"}


def test_same_seed_same_figures_other_seed_others() -> None:
    config = fleet(8)
    first = simulate(zipf(8), config)
    assert figures(simulate(zipf(8), config)) == figures(first)
    assert figures(simulate(zipf(8, seed=8), config)) != figures(first)
    assert first["requests"] == 8 * CONFIG["workloads"]["zipf"]["requests_per_node"]


@pytest.mark.parametrize("routing", ["kv", "round-robin"])
@pytest.mark.parametrize("workload", ["zipf", "conversation"])
def test_infinite_capacity_reaches_the_ideal_prefix_reuse(routing: str, workload: str) -> None:
    requests = build(CONFIG["workloads"][workload], 5, 3)
    ideal = ideal_hit_rate(requests.requests)
    assert 0.3 < ideal < 1.0
    huge = {"dram_bytes": 1 << 50, "nvme_bytes": 0, "routing": routing}
    one_by_one = simulate(requests, fleet(5, sequential=True, **huge))
    assert one_by_one["hit_rate"] == pytest.approx(ideal)
    # Concurrent requests of one prefix miss what is still being prefilled: never above ideal.
    assert simulate(requests, fleet(5, **huge))["hit_rate"] <= ideal
    # Without sharing, round robin loses what another node holds; the ideal is an upper bound.
    alone = simulate(requests, fleet(5, shared_data="none", **huge))
    assert alone["hit_rate"] <= ideal


def test_zero_capacity_hits_nothing_and_publishes_nothing() -> None:
    result = simulate(zipf(4), fleet(4, dram_bytes=0, nvme_bytes=0))
    assert result["hit_rate"] == 0.0
    assert result["prefill_tokens_saved"] == 0
    assert result["index_fields_peak"] == 0
    assert result["peer_bytes"] == 0


def test_kv_aware_routing_beats_round_robin_on_shared_prefixes() -> None:
    for name in ("zipf", "conversation"):
        workload = build(CONFIG["workloads"][name], 6, 3)
        alone = {"shared_data": "none", "dram_bytes": 64 * GIB, "nvme_bytes": 0}
        kv = simulate(workload, fleet(6, routing="kv", **alone))
        spread = simulate(workload, fleet(6, routing="round-robin", **alone))
        assert kv["hit_rate"] >= spread["hit_rate"] + 0.1, (name, kv, spread)
        # With peers, round robin reads from the node holding the prefix instead: bytes move.
        shared = simulate(workload, fleet(6, routing="round-robin", shared_data="peers"))
        assert shared["hit_rate"] > spread["hit_rate"]
        assert shared["peer_bytes"] > 0


def test_small_tiers_evict_and_demote_like_the_store() -> None:
    block = 64 * 1024
    dram, nvme = footprints(block)
    node = SimNode("n", (2 * dram, 3 * nvme), (dram, nvme), Policy())
    chain = [key_of(i) for i in range(4)]
    assert node.put(chain) == chain
    # Placed in order, so a prompt longer than dram pushes its own prefix down to nvme (as the
    # store's put does); then the chain is aged suffix first, so its prefix is most recent.
    assert [node.level_of(k) for k in chain] == [1, 1, 0, 0]
    assert list(node.index.levels[1]) == [chain[1], chain[0]]
    # A hit in nvme is promoted into dram; dram's LRU block goes down to nvme's free slot.
    assert node.get([chain[0]], lambda key: None) == ["nvme"]
    assert node.level_of(chain[0]) == 0
    assert node.evicted == 0 and node.demoted == 3
    # nvme full: the next demotion drops nvme's least recently used block from the node.
    node.put([key_of(9)])
    assert node.evicted == 1
    held = sum(node.level_of(k) is not None for k in [*chain, key_of(9)])
    assert held == 5 - node.evicted
    assert node.used[0] <= 2 * dram and node.used[1] <= 3 * nvme


def test_a_sweep_row_has_every_figure_the_docs_use() -> None:
    result = simulate(zipf(3), fleet(3))
    for name in (
        "hit_rate",
        "prefill_tokens_saved",
        "peer_bytes",
        "peer_bytes_per_node_s",
        "index_fields_peak",
        "index_bytes_peak",
        "index_ops_per_s",
        "index_ops_per_s_peak",
    ):
        assert result[name] >= 0, name
    assert result["index_bytes_peak"] > 0 and result["index_ops_per_s"] > 0
    assert result["hit_rate"] <= 1.0


def test_validation_driver_matches_real_nodes_on_a_small_window() -> None:
    # A generated workload, not the Mooncake trace: the trace lives beside the checkout
    # (../shared/traces), which a clean clone elsewhere does not have; the benchmark
    # (`python -m benchmarks.sim.validate`) replays the trace.
    params = dict(
        CONFIG["validate"], config=str(CONFIG_PATH), workload="conversation", skip=0, requests=25
    )
    workload = scaled_workload(CONFIG, params)
    assert len(workload.requests) == 25
    assert all(isinstance(r, Request) for r in workload.requests)
    real = run_real(workload, "kv", params)
    sim = run_sim(workload, "kv", params)
    assert real["wrong_blocks"] == 0
    assert real["chunks"] == sim["chunks"]
    assert abs(real["hit_rate"] - sim["hit_rate"]) <= 0.10
    assert real["index_fields"] > 0


def test_an_unknown_setting_is_refused_with_its_allowed_values() -> None:
    with pytest.raises(ValueError, match="shared_data must be one of"):
        fleet(3, shared_data="nfs")
    with pytest.raises(ValueError, match="load_policy must be one of"):
        fleet(3, load_policy="sometimes")
    with pytest.raises(ValueError, match="workload kind must be one of"):
        build({"kind": "poisson", "chunk_tokens": 1}, 3, 1)
    assert replace(fleet(3), routing="round-robin").routing == "round-robin"


def _by_policy(scenario: str, model: str = "1b", **overrides: Any) -> dict[str, dict[str, Any]]:
    """The load-plan benchmark's scenario, on the generated conversation workload (the
    benchmark replays the Mooncake trace, which a clean clone elsewhere lacks)."""
    workload = build(CONFIG["workloads"]["conversation"], MODELS[model].nodes, 3)
    return {
        policy: simulate(
            workload, scenario_config(CONFIG, scenario, MODELS[model], policy, **overrides)
        )
        for policy in ("always", "never", "cost")
    }


def test_the_load_plan_beats_always_loading_from_a_slow_shared_tier() -> None:
    # dram for a few chunks only: most hits come back from Redis.
    results = _by_policy("redis", dram_bytes=16 * 8 << 20)
    ttft = {policy: r["ttft_mean_s"] for policy, r in results.items()}
    assert ttft["cost"] <= min(ttft["always"], ttft["never"])
    assert ttft["cost"] < ttft["always"]
    assert results["cost"]["declined_chunks"] > 0 and results["cost"]["loaded_chunks"] > 0
    assert results["always"]["declined_chunks"] == 0 and results["never"]["loaded_chunks"] == 0


def test_with_only_fast_tiers_the_load_plan_loads_every_hit() -> None:
    results = _by_policy("fast")
    assert results["cost"]["declined_chunks"] == 0
    assert results["cost"]["loaded_chunks"] == results["always"]["loaded_chunks"] > 0
    assert results["cost"]["ttft_mean_s"] == results["always"]["ttft_mean_s"]
    assert results["cost"]["ttft_mean_s"] < results["never"]["ttft_mean_s"]


def test_without_read_rates_loads_take_no_time_as_before() -> None:
    result = simulate(zipf(3), fleet(3))
    assert result["load_policy"] == "always" and result["load_s"] == 0
    assert result["declined_chunks"] == 0 and result["ttft_p50_s"] <= result["ttft_p99_s"]
