"""The load-or-recompute decision on fakes: rates in, plan out (kvstore.client.cost_model), and
the meters that measure those rates (kvstore.protocol.rates)."""

from __future__ import annotations

import random

import pytest

from kvstore.client.cost_model import context_scale, plan_loads, prefill_work
from kvstore.protocol.rates import LATENCY_KEY, RATE_KEY, UNKNOWN, Rate, RateMeter, rate_from_stats

CHUNK = 256
# 1B-model shape on an H100: 32 KiB of KV per token; an 8K prefill in 51.7 ms.
CHUNK_BYTES = CHUNK * 32768
SCALE = context_scale(2048)
PREFILL = Rate(prefill_work(0, 8192, SCALE) / 0.0517)
FAST = {
    "dram": Rate(53.7e9, 20e-6),
    "nvme": Rate(12e9, 100e-6),  # LMDB from the page cache
}
SLOW = {**FAST, "redis": Rate(0.3e9, 500e-6), "peer": Rate(0.5e9, 300e-6)}


def plan(tiers: list[str], rates: dict[str, Rate], prefill: Rate = PREFILL, **kw: object):
    args = {"chunk_tokens": CHUNK, "chunk_bytes": CHUNK_BYTES, "scale": SCALE, **kw}
    return plan_loads(tiers, rates, prefill, **args)  # type: ignore[arg-type]


def test_fast_tiers_load_everything() -> None:
    result = plan(["dram"] * 20 + ["nvme"] * 12, FAST)
    assert (result.load, result.hits, result.declined) == (32, 32, 0)
    assert result.reason == "loads win"
    assert 0 < result.load_s < result.all_recompute_s
    assert result.recompute_s == 0


def test_a_slow_tier_stops_the_loads_there() -> None:
    result = plan(["dram"] * 10 + ["redis"] * 22, SLOW)
    assert result.load == 10
    assert "redis" in result.reason and "chunk 10" in result.reason
    assert result.load_s + result.recompute_s < result.all_load_s
    # Every chunk in the slow tier: nothing is loaded.
    assert plan(["redis"] * 32, SLOW).load == 0


def test_a_slow_stretch_is_loaded_through_when_fast_chunks_follow_it() -> None:
    """The plan minimises the whole prefix's cost, not chunk by chunk: a short slow stretch
    followed by many fast chunks costs less loaded than recomputing all of them."""
    rates = {"dram": Rate(53.7e9), "slow": Rate(1.5e9)}
    result = plan(["dram"] * 2 + ["slow"] * 2 + ["dram"] * 28, rates)
    assert result.load == 32


def test_unknown_rates_and_ties_load_as_before() -> None:
    tiers = ["dram"] * 4 + ["redis"] * 4
    assert plan(tiers, SLOW, prefill=UNKNOWN).load == 8  # no prefill rate measured
    assert plan(tiers, SLOW, prefill=UNKNOWN).reason == "no prefill rate"
    assert plan(tiers, FAST).load == 8  # no rate for redis: loaded
    # A tier exactly as fast as recomputing (no context term, no latencies): a tie, loaded.
    per_chunk = CHUNK_BYTES / 1e9
    tie = {"t": Rate(1e9)}
    assert plan(["t"] * 4, tie, prefill=Rate(CHUNK / per_chunk), scale=0).load == 4
    assert plan(["t"] * 4, tie, prefill=Rate(CHUNK / per_chunk * 1.01), scale=0).load == 0


def test_latency_counts_once_per_tier_and_the_transfer_path_adds_per_byte() -> None:
    # One redis chunk: a large fixed latency makes it lose; more chunks share it.
    rates = {"r": Rate(100e9, 0.004)}
    assert plan(["r"], rates).load == 0
    assert plan(["r"] * 32, rates).load == 32
    # A slow client path turns a fast tier into a losing one.
    assert plan(["dram"] * 32, FAST, transfer=Rate(0.2e9)).load == 0
    assert plan(["dram"] * 32, FAST, transfer=Rate(20e9)).load == 32


def test_chunks_the_engine_holds_cost_nothing() -> None:
    result = plan(["redis"] * 8, SLOW, held_tokens=8 * CHUNK)
    assert result.load == 8 and result.load_s == 0
    result = plan(["redis"] * 8, SLOW, held_tokens=4 * CHUNK)
    assert result.load == 4  # the held ones are free; the others lose


def test_no_hits_no_plan() -> None:
    assert plan([], SLOW).load == 0


def test_prefill_work_grows_with_context() -> None:
    assert prefill_work(0, 100, 0) == 100
    assert prefill_work(5, 5, SCALE) == 0
    early, late = prefill_work(0, 256, SCALE), prefill_work(8192, 8448, SCALE)
    assert late > early > 256
    # At a context of context_scale tokens, a token costs twice as much.
    s = int(SCALE)
    assert prefill_work(s, s + 1, SCALE) == pytest.approx(2.0, rel=1e-3)


def test_meter_fits_latency_and_rate() -> None:
    meter = RateMeter()
    assert meter.rate() is UNKNOWN and not meter.rate().known
    noise = random.Random(1)
    for _ in range(400):
        size = noise.choice([1 << 20, 4 << 20, 16 << 20])
        meter.add(size, 0.002 + size / 1e9 * noise.uniform(0.98, 1.02))
    fit = meter.rate()
    assert fit.per_s == pytest.approx(1e9, rel=0.05)
    assert fit.latency_s == pytest.approx(0.002, rel=0.2)
    assert fit.seconds(1e9) == pytest.approx(1.002, rel=0.05)
    # The mean rate counts the fixed cost in: slower than the fitted one at these sizes.
    assert meter.mean_rate().latency_s == 0
    assert meter.mean_rate().per_s < fit.per_s
    assert RateMeter().mean_rate() is UNKNOWN


def test_meter_of_one_size_reports_the_mean_rate_and_follows_a_change() -> None:
    meter = RateMeter()
    meter.add(0, 1.0)  # says nothing: ignored
    meter.add(1 << 20, 0)
    assert meter.samples == 0
    for _ in range(50):
        meter.add(1e6, 1e-3)
    assert meter.rate() == Rate(pytest.approx(1e9), 0.0)
    for _ in range(100):  # the tier slows down tenfold
        meter.add(1e6, 1e-2)
    assert meter.rate().per_s == pytest.approx(1e8, rel=0.05)


def test_rate_from_stats() -> None:
    assert rate_from_stats({}) is UNKNOWN
    assert rate_from_stats({RATE_KEY: 0, LATENCY_KEY: 5}) is UNKNOWN
    assert rate_from_stats({RATE_KEY: 300_000_000, LATENCY_KEY: 500}) == Rate(3e8, 5e-4)
