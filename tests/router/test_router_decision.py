"""Why the router chose: each decision's reason and credited tokens, the index deadline sized
from measured latency, and the index query against a real redis-server that stalls.
(The router process end to end: tests/integration/test_router_explains.py.)"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import pytest
from harness.redis_server import RedisServer

from kvstore.cluster.index import Holding
from kvstore.cluster.layout import Layout, connect
from kvstore.config import load_config
from kvstore.errors import ConfigError
from kvstore.router import Provisional, Replica, Scorer
from kvstore.router.decision import FALLBACK_REASONS, REASONS, DecisionRecord, reason_for
from kvstore.router.index_query import (
    HEADROOM,
    AdaptiveDeadline,
    IndexQuery,
)
from kvstore.router.lookup import ScriptIndex

A, B, C = Replica("http://a", "na"), Replica("http://b", "nb"), Replica("http://c", "nc")
KEYS = [bytes([i]) * 16 for i in range(8)]


def scorer(replicas: tuple[Replica, ...] = (A, B, C), policy: str = "kv") -> Scorer:
    return Scorer(replicas, 16, 2.0, 16, Provisional(5.0), policy)


def held(*tiers: str) -> Holding:
    leading = next((i for i, t in enumerate(tiers) if not t), len(tiers))
    return Holding(leading, list(tiers))


def test_a_prefix_only_one_replica_holds_is_prefix_routing() -> None:
    decision = scorer().choose(KEYS[:4], 64, {"nb": held("dram", "dram", "dram")})
    assert (decision.replica, decision.reason) == (B, "prefix")
    assert decision.credited == {"http://a": 0, "http://b": 48, "http://c": 0}
    assert decision.shared_tokens == 0


def test_a_system_prompt_every_replica_holds_is_not_prefix_routing() -> None:
    # Every replica holds the first chunk (a shared system prompt): it decides nothing.
    shared = {node: held("local") for node in ("na", "nb", "nc")}
    decision = scorer().choose(KEYS[:4], 64, shared)
    assert decision.reason == "shared_prefix"
    assert decision.shared_tokens == 16 and set(decision.credited.values()) == {16}
    # One replica holding more than the shared chunk is prefix routing again.
    decision = scorer().choose(KEYS[:4], 64, {**shared, "nc": held("local", "dram", "dram")})
    assert (decision.replica, decision.reason, decision.shared_tokens) == (C, "prefix", 16)
    assert decision.predicted_hit_tokens - decision.shared_tokens == 32


def test_nothing_held_or_load_outweighing_a_prefix_is_load() -> None:
    assert scorer().choose(KEYS[:4], 64, {}).reason == "load"
    s = scorer((A, B))
    for _ in range(4):  # A is busy: its 16-token hit is worth less than its load
        s.dispatched(A, [], 64)
    decision = s.choose(KEYS[:4], 64, {"na": held("redis")})
    assert (decision.replica, decision.reason) == (B, "load")
    assert decision.credited == {"http://a": 16, "http://b": 0}


def test_credited_tokens_stop_at_the_prompt() -> None:
    decision = scorer().choose(KEYS[:2], 20, {"na": held("dram", "dram")})
    assert decision.credited["http://a"] == decision.predicted_hit_tokens == 20


def test_baselines_and_fallbacks_name_their_reason() -> None:
    assert scorer(policy="round_robin").choose(KEYS[:2], 32, {}).reason == "round_robin"
    assert scorer(policy="least_loaded").choose(KEYS[:2], 32, {}).reason == "load"
    prefix = scorer().choose(KEYS[:2], 32, {"na": held("dram", "dram")})
    assert reason_for(prefix, "") == "prefix"
    assert reason_for(prefix, "index_timeout") == "index_timeout"
    for fallback in ("index_error", "index_down", "no_index"):
        assert reason_for(prefix, fallback) == "index_unavailable"
    assert reason_for(prefix, "no_namespace") == "no_tokens"
    assert set(FALLBACK_REASONS.values()) <= set(REASONS)


def test_the_debug_line_says_why() -> None:
    decision = scorer().choose(KEYS[:4], 70, {"na": held("local", "dram"), "nb": held("local")})
    record = DecisionRecord(7, decision, "", True, 70, 0.0013, 0.1)
    assert record.line() == (
        "route #7 -> http://a prefix: credited {http://a:32 http://b:16 http://c:0} shared 0 "
        "prompt 70; index ok 1.3 ms (deadline 100 ms)"
    )
    blind = dataclasses.replace(decision, reason="index_timeout")
    timed_out = DecisionRecord(8, blind, "index_timeout", True, 70, 0.1, 0.1)
    assert " index_timeout: credited" in timed_out.line()
    assert timed_out.line().endswith("index timeout 100.0 ms (deadline 100 ms)")
    down = DecisionRecord(9, decision, "index_down", True, 70, 0.0, 0.1)
    assert down.line().endswith("; index down")
    short = DecisionRecord(10, decision, "", False, 3, 0.0, 0.1)
    assert short.line().endswith("; index not asked")


def test_the_deadline_follows_measured_latency_within_floor_and_cap() -> None:
    deadline = AdaptiveDeadline(floor_s=0.1, cap_s=1.0)
    assert deadline.seconds == 0.1
    for _ in range(512):  # a fast index: the floor
        deadline.observe(0.001)
    assert deadline.seconds == 0.1
    for _ in range(512):  # a loaded one: HEADROOM x p99
        deadline.observe(0.2)
    assert deadline.seconds == pytest.approx(HEADROOM * 0.2)
    for _ in range(512):  # slower than the cap allows: the cap
        deadline.observe(0.9)
    assert deadline.seconds == 1.0
    for _ in range(512):  # fast again: back to the floor once the window has moved on
        deadline.observe(0.002)
    assert deadline.seconds == 0.1
    assert AdaptiveDeadline(floor_s=0.5, cap_s=0.1).cap_s == 0.5  # the cap is never below it


def test_a_cap_at_or_below_the_floor_fixes_the_deadline() -> None:
    """A config that set only index_timeout_s (above the 1 s cap) keeps its fixed deadline."""
    config = load_config(None, env={"KVSTORE_ROUTER_INDEX_TIMEOUT_S": "5"}).router
    deadline = AdaptiveDeadline(config.index_timeout_s, config.index_timeout_max_s)
    for _ in range(64):
        deadline.observe(0.001)
    deadline.missed()
    assert (deadline.floor_s, deadline.cap_s, deadline.seconds) == (5.0, 5.0, 5.0)
    assert load_config(None, env={}).router.index_timeout_max_s == 1.0
    with pytest.raises(ConfigError, match=r"router\.index_timeout_max_s must be > 0"):
        load_config(None, env={"KVSTORE_ROUTER_INDEX_TIMEOUT_MAX_S": "0"})


def test_a_stalled_index_times_out_at_its_deadline_then_is_skipped(tmp_path: Path) -> None:
    """A real redis-server, SIGSTOPped: each query ends at its deadline (not the socket's 5 s),
    each timeout doubles the deadline up to the cap, once nothing has answered for longer than
    the cap the index is skipped for index_retry_s, and it is asked again after."""
    with RedisServer(tmp_path / "redis") as server:

        async def run() -> None:
            client = connect(server.url, 5.0)
            try:
                query = IndexQuery(
                    ScriptIndex(client, Layout("kvstore:cluster:v1:")),
                    AdaptiveDeadline(0.2, 1.0),
                    retry_s=0.5,
                )
                found, fallback, _ = await query.holders(KEYS)
                assert (found, fallback) == ({}, "")  # answered: nothing held
                server.pause()
                try:
                    deadlines = []
                    while True:
                        deadline = query.deadline.seconds
                        started = time.monotonic()
                        _, fallback, spent = await query.holders(KEYS)
                        if fallback == "index_down":
                            break
                        assert fallback == "index_timeout"
                        took = time.monotonic() - started
                        assert deadline <= took < deadline + 1.5  # generous at load 10
                        assert spent >= deadline
                        deadlines.append(deadline)
                        assert len(deadlines) <= 4, deadlines
                    assert deadlines == [0.2, 0.4, 0.8]
                    assert query.deadline.seconds == 1.0  # the cap
                finally:
                    server.resume()
                deadline = time.monotonic() + 10
                while (await query.holders(KEYS))[1] != "":
                    assert time.monotonic() < deadline, "the index was not asked again"
                    await asyncio.sleep(0.05)
            finally:
                await client.aclose()

        asyncio.run(run())
