"""What the store counts for ``/metrics`` (misses by reason, bytes and moves per tier) and how the
collector and the duration buckets present it, on real tiers in-process."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness.store_blocks import PAGE, key, make_store, payload
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from kvstore.config import load_config
from kvstore.errors import ConfigError
from kvstore.keys import Namespace
from kvstore.protocol.rates import LATENCY_KEY, RATE_KEY, rate_from_stats
from kvstore.server.budget import InflightBudget
from kvstore.server.durations import BUCKETS, Durations
from kvstore.server.metrics import StoreCollector, build_registry
from kvstore.server.tenancy import Tenant, Tenants
from kvstore.store.prefetch import Prefetcher

NS = Namespace(model="metrics-model").fingerprint()
OTHER_NS = Namespace(model="metrics-model", tenant="someone-else").fingerprint()


async def test_misses_by_reason_bytes_and_moves_per_tier() -> None:
    store = make_store(None, dram_pages=4)  # dram only: an evicted block leaves the store
    try:
        for n in range(6):
            assert (await store.put([key(n)], [payload(n)], NS)).stored == 1
        got = await store.get([key(0), key(5), key(99)], NS)  # evicted, hit, never stored
        assert [r.found for r in got] == [False, True, False]
        assert not (await store.get([key(5)], OTHER_NS))[0].found  # another namespace
        store.record_misses("deadline", 2)
        counters = store.stats()["counters"]
        misses = {k: v for k, v in counters.items() if k.startswith("miss_")}
        assert misses == {
            "miss_absent": 1,
            "miss_evicted": 1,
            "miss_corrupt": 0,
            "miss_tier_down": 0,
            "miss_deadline": 2,
            "miss_denied": 0,
            "miss_namespace": 1,
            "miss_peer_timeout": 0,
            "miss_peer_down": 0,
            "miss_newer_format": 0,
        }
        dram = store.stats()["tiers"]["dram"]
        assert dram["evictions"] == 2 and dram["hits"] == 1
        assert dram["written_bytes"] == 6 * PAGE and dram["read_bytes"] == PAGE
    finally:
        await store.close()


async def test_demotions_promotions_and_a_corrupt_block(tmp_path: Path) -> None:
    store = make_store(tmp_path / "nvme", dram_pages=2)
    try:
        for n in range(3):
            await store.put([key(n)], [payload(n)], NS)
        stats = store.stats()["tiers"]
        assert stats["dram"]["demotions"] == 1 and stats["nvme"]["written_bytes"] == PAGE
        assert (await store.get([key(0)], NS))[0].tier == "nvme"
        await store.drain()  # the promotion back into dram runs in the background
        assert store.stats()["tiers"]["dram"]["promotions"] == 1
        assert store.stats()["tiers"]["nvme"]["read_bytes"] == PAGE
    finally:
        await store.close()


async def test_read_rates_are_measured_per_tier_and_exported(tmp_path: Path) -> None:
    """Every batched tier read is timed; ``Stats`` and ``/metrics`` report the fitted rate (the
    vLLM connector's load-or-recompute decision weighs loads by it)."""
    store = make_store(tmp_path / "nvme", dram_pages=2)
    try:
        stats = store.stats()["tiers"]
        assert stats["nvme"][RATE_KEY] == 0 and stats["nvme"][LATENCY_KEY] == 0  # not yet
        for n in range(4):
            await store.put([key(n)], [payload(n)], NS)
        assert (await store.get([key(0), key(1)], NS))[0].tier == "nvme"
        await store.drain()
        assert (await store.get([key(1)], NS))[0].tier == "dram"  # promoted
        stats = store.stats()["tiers"]
        for tier in ("dram", "nvme"):
            assert stats[tier][RATE_KEY] > 0 and stats[tier][LATENCY_KEY] >= 0
        assert rate_from_stats(stats["nvme"]).known
        tenants = Tenants.single(Tenant("", store, Prefetcher(store), InflightBudget(1 << 20)))
        registry = CollectorRegistry(auto_describe=False)
        registry.register(StoreCollector(tenants, "9.9", Durations()))
        families = {
            f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())
        }
        rates = {
            s.labels["tier"]: s.value
            for s in families["kvstore_tier_read_rate_bytes_per_second"].samples
        }
        assert set(rates) == {"dram", "nvme"} and min(rates.values()) > 0
        assert "kvstore_tier_read_latency_seconds" in families
    finally:
        await store.close()


def test_duration_buckets_are_cumulative_in_the_exposition() -> None:
    durations = Durations()
    for seconds in (1e-6, 5e-5, 3e-4, 20.0):
        durations.observe("get", "shm", "", seconds)
    assert durations.count("get", "shm", "") == 4
    assert durations.count("get", "grpc", "") == 0
    assert BUCKETS[0] == 5e-5 and BUCKETS[-1] == 10.0


async def test_collector_exports_the_contract_names_with_a_tenant_label() -> None:
    store = make_store(None, dram_pages=4)
    try:
        tenants = Tenants.single(Tenant("", store, Prefetcher(store), InflightBudget(1 << 20)))
        durations = Durations()
        durations.observe("lookup", "grpc", "", 2e-4)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(StoreCollector(tenants, "9.9", durations))
        assert "kvstore_build_info" in generate_latest(build_registry(tenants)).decode()
        text = generate_latest(registry).decode()
        names = {family.name for family in text_string_to_metric_families(text)}
        assert {
            "kvstore_tier_hits",
            "kvstore_misses",
            "kvstore_tier_resident_bytes",
            "kvstore_request_duration_seconds",
            "kvstore_lookups",
            "kvstore_build_info",
        } <= names
        assert 'kvstore_request_duration_seconds_bucket{le="0.00025",op="lookup"' in text
        assert 'kvstore_lookups_total{plane="grpc",tenant=""} 1.0' in text
        # No redis tier: its series are absent, not 0.
        assert "kvstore_shared_tier_up{" not in text
    finally:
        await store.close()


def test_metrics_listen_setting_from_the_environment() -> None:
    assert load_config(env={}).server.metrics_listen == "127.0.0.1:9464"
    assert load_config(env={"KVSTORE_SERVER_METRICS_LISTEN": ""}).server.metrics_listen == ""
    with pytest.raises(ConfigError, match=r"server\.metrics_listen.*'nope'"):
        load_config(env={"KVSTORE_SERVER_METRICS_LISTEN": "nope"})
