"""The event-level simulation of N engines, each beside a kvstore node, behind one router.

Per request (in arrival order): the router picks a node, with kvstore's own
:class:`~kvstore.router.scoring.Scorer` over the simulated cluster index (``kv``) or in turn
(``round-robin``); that node's store answers a get of the request's chunk keys (its tiers, then
peers or Redis, see :class:`~.node.SimNode`); the engine's prefix hit is the *leading* run found.
The engine loads the hits it decides to load (``load_policy``: every one, none, or those
:func:`kvstore.client.cost_model.plan_loads` finds faster to load than to compute, at
``read_rates`` per source and ``transfer_bytes_per_s`` for the engine's own copy) and prefills
the rest at ``prefill_tokens_per_s`` (:func:`~kvstore.client.cost_model.prefill_work` units per
second where ``prefill_context_scale`` is set) after the requests queued before it (one FIFO queue
per engine; decoding overlaps); its time to first token is when that ends. Then it puts the chunks
it computed beyond the hits; the Scorer sees the request dispatched, prefilled and finished at
those times, as the router does. Without ``read_rates`` loads take no time (the default).

``sequential`` runs each request to its end before the next one arrives (the validation driver
does exactly that against real nodes). Events, not bytes: a block is a key and a size.
"""

from __future__ import annotations

import heapq
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvstore.client.cost_model import plan_loads, prefill_work
from kvstore.policy import Policy
from kvstore.protocol.rates import UNKNOWN, Rate
from kvstore.router.scoring import Provisional, Replica, Scorer

from .index import SimIndex
from .node import SimNode, footprints, key_of
from .workloads import Workload

__all__ = ["LOAD_POLICIES", "SHARED_DATA", "SimConfig", "simulate"]

#: ``cluster.shared_data`` values, plus ``none``: each node reads only its own tiers.
SHARED_DATA = ("peers", "redis", "both", "none")
ROUTINGS = ("kv", "round-robin")
#: The connector's ``load_policy`` values (kvstore.integrations.vllm.common.LOAD_POLICIES).
LOAD_POLICIES = ("always", "never", "cost")
GIB = 1024**3


@dataclass(frozen=True)
class SimConfig:
    """A fleet: its size, per-node tiers, sharing, routing, and the engines' speed."""

    nodes: int
    dram_bytes: int
    nvme_bytes: int
    shared_data: str = "peers"
    routing: str = "kv"
    eviction: str = "lru"
    kv_bytes_per_token: int = 131072
    #: Bytes of one block; 0: chunk tokens x ``kv_bytes_per_token``.
    block_bytes: int = 0
    #: ``dram.page_size``; 0: kvstore's default.
    dram_page_size: int = 0
    prefill_tokens_per_s: float = 20000.0
    decode_s_per_token: float = 0.02
    hit_weight: float = 2.0
    request_cost_tokens: int = 256
    provisional_ttl_s: float = 5.0
    node_id_bytes: int = 9
    sequential: bool = False
    #: Which leading hits the engine loads (:data:`LOAD_POLICIES`).
    load_policy: str = "always"
    #: ``(source, bytes per s, fixed s per read)`` of each source (``dram``, ``nvme``, ``peer``,
    #: ``redis``); a source not named loads in no time.
    read_rates: tuple[tuple[str, float, float], ...] = ()
    #: The engine's own copy of a loaded chunk (shared memory, device DMA), bytes per s; 0: free.
    transfer_bytes_per_s: float = 0.0
    #: :func:`~kvstore.client.cost_model.prefill_work`'s context scale; 0: a flat rate.
    prefill_context_scale: float = 0.0

    def __post_init__(self) -> None:
        if self.load_policy not in LOAD_POLICIES:
            raise ValueError(
                f"load_policy must be one of {LOAD_POLICIES}, got {self.load_policy!r}"
            )
        if self.shared_data not in SHARED_DATA:
            raise ValueError(f"shared_data must be one of {SHARED_DATA}, got {self.shared_data!r}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {self.routing!r}")
        if self.nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {self.nodes}")


def simulate(
    workload: Workload,
    config: SimConfig,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Run ``workload`` on the fleet ``config``; returns the figures (see :func:`_report`)."""
    return _Run(workload, config).run(progress)


class _Run:
    def __init__(self, workload: Workload, config: SimConfig) -> None:
        self.workload, self.config = workload, config
        self.chunk_tokens = workload.chunk_tokens
        self.block_bytes = config.block_bytes or self.chunk_tokens * config.kv_bytes_per_token
        self.index = SimIndex(config.node_id_bytes)
        policy = Policy(eviction=config.eviction)
        sizes = footprints(self.block_bytes, config.dram_page_size or None)
        names = [f"node-{i:04d}" for i in range(config.nodes)]
        capacities = (config.dram_bytes, config.nvme_bytes)
        self.nodes = [SimNode(n, capacities, sizes, policy, self.index.changed) for n in names]
        self.position = {name: i for i, name in enumerate(names)}
        self.replicas = [Replica(url=name, node=name) for name in names]
        self.now = 0.0
        provisional = Provisional(config.provisional_ttl_s, clock=lambda: self.now)
        self.scorer = Scorer(
            self.replicas,
            self.chunk_tokens,
            config.hit_weight,
            config.request_cost_tokens,
            provisional,
        )
        self.redis: set[bytes] = set()
        self.free_at = [0.0] * config.nodes
        self.events: list[tuple[float, int, str, Any]] = []
        self.seq = 0
        self.turn = 0
        self.stats: Counter[str] = Counter()
        self.per_node_requests = [0] * config.nodes
        self.per_node_in = [0] * config.nodes
        self.end = 0.0
        self.rates = {name: Rate(per_s, latency) for name, per_s, latency in config.read_rates}
        transfer = config.transfer_bytes_per_s
        self.transfer = Rate(transfer) if transfer > 0 else UNKNOWN
        self.ttft: list[float] = []

    def _load_plan(self, sources: list[str], input_tokens: int) -> tuple[int, float, float]:
        """Chunks loaded, seconds loading them, seconds prefilling the rest of the prompt."""
        config = self.config
        plan = plan_loads(
            sources,
            self.rates,
            Rate(config.prefill_tokens_per_s),
            chunk_tokens=self.chunk_tokens,
            chunk_bytes=self.block_bytes,
            scale=config.prefill_context_scale,
            transfer=self.transfer,
        )
        load, load_s = {
            "always": (plan.hits, plan.all_load_s),
            "never": (0, 0.0),
            "cost": (plan.load, plan.load_s),
        }[config.load_policy]
        start = min(load * self.chunk_tokens, input_tokens)
        work = prefill_work(start, input_tokens, config.prefill_context_scale)
        return load, load_s, work / config.prefill_tokens_per_s

    def run(self, progress: Callable[[int, int], None] | None) -> dict[str, Any]:
        requests = self.workload.requests
        started = time.perf_counter()
        step = max(len(requests) // 20, 1)
        for number, request in enumerate(requests):
            while self.events and self.events[0][0] <= request.arrival_s:
                self._handle(heapq.heappop(self.events))
            self.now = request.arrival_s
            self._arrive(request)
            if progress is not None and number % step == 0:
                progress(number, len(requests))
        while self.events:
            self._handle(heapq.heappop(self.events))
        return self._report(time.perf_counter() - started)

    def _push(self, at: float, kind: str, data: Any) -> None:
        self.seq += 1
        heapq.heappush(self.events, (at, self.seq, kind, data))

    def _handle(self, event: tuple[float, int, str, Any]) -> None:
        self.now, _, kind, data = event
        self.index.now = self.now
        self.end = max(self.end, self.now)
        if kind == "prefilled":
            self._prefilled(*data)
        else:
            self.scorer.finished(data)

    def _route(self, keys: list[bytes], prompt: int) -> tuple[Replica, int]:
        if self.config.routing == "kv":
            decision = self.scorer.choose(keys, prompt, self.index.query(keys))
            return decision.replica, decision.predicted_hit_tokens
        self.turn += 1
        return self.replicas[self.turn % len(self.replicas)], 0

    def _arrive(self, request: Any) -> None:
        config, stats = self.config, self.stats
        self.index.now = self.now
        keys = [key_of(chunk) for chunk in request.chunks]
        replica, predicted = self._route(keys, request.input_tokens)
        where = self.position[replica.url]
        node = self.nodes[where]
        asked = [False]

        def remote(key: bytes) -> str | None:
            if config.shared_data in ("peers", "both"):
                asked[0] = True
                if self.index.peer_for(key, node.name) is not None:
                    return "peer"
            if config.shared_data in ("redis", "both") and key in self.redis:
                return "redis"
            return None

        sources = node.get(keys, remote)
        if asked[0]:
            self.index.count_leases(node.name)
        leading = next((i for i, s in enumerate(sources) if s is None), len(sources))
        hit_tokens = min(leading * self.chunk_tokens, request.input_tokens)
        stats["requests"] += 1
        stats["chunks"] += len(keys)
        stats["hit_chunks"] += leading
        stats["input_tokens"] += request.input_tokens
        stats["saved_tokens"] += hit_tokens
        for source in sources[:leading]:
            stats[f"hits_{source}"] += 1
        moved = Counter(s for s in sources if s in ("peer", "redis"))
        stats["peer_bytes"] += moved["peer"] * self.block_bytes
        stats["redis_read_bytes"] += moved["redis"] * self.block_bytes
        self.per_node_in[where] += moved["peer"] * self.block_bytes
        self.per_node_requests[where] += 1
        loaded, load_s, prefill_s = self._load_plan(
            [s for s in sources[:leading] if s is not None], request.input_tokens
        )
        stats["loaded_chunks"] += loaded
        stats["declined_chunks"] += leading - loaded
        stats["load_s"] += load_s
        self.scorer.dispatched(replica, keys, max(request.input_tokens - predicted, 0))
        missing = keys[leading:]
        routed = (where, replica, missing, max(request.input_tokens - predicted, 0))
        if config.sequential:
            self.ttft.append(load_s + prefill_s)
            self._prefilled(*routed)
            self.scorer.finished(replica)
            return
        start = max(self.now, self.free_at[where])
        done = start + load_s + prefill_s
        self.ttft.append(done - self.now)
        self.free_at[where] = done
        stats["queue_s"] += start - self.now
        self._push(done, "prefilled", routed)
        self._push(done + request.output_tokens * config.decode_s_per_token, "finished", replica)

    def _prefilled(self, where: int, replica: Replica, missing: list[bytes], queued: int) -> None:
        stored = self.nodes[where].put(missing)
        if self.config.shared_data in ("redis", "both"):
            self.redis.update(stored)
            self.stats["redis_write_bytes"] += len(stored) * self.block_bytes
        self.scorer.prefilled(replica, queued)

    def _report(self, wall_s: float) -> dict[str, Any]:
        config, stats, index = self.config, self.stats, self.index
        requests = self.workload.requests
        first = requests[0].arrival_s if requests else 0.0
        span = max(self.end, requests[-1].arrival_s if requests else 0.0) - first
        span = max(span, 1e-9)
        ops = sum(index.ops.values())
        loads = self.per_node_requests
        return {
            "workload": self.workload.name,
            "nodes": config.nodes,
            "dram_gib": config.dram_bytes / GIB,
            "nvme_gib": config.nvme_bytes / GIB,
            "routing": config.routing,
            "shared_data": config.shared_data,
            "requests": stats["requests"],
            "chunks": stats["chunks"],
            "block_bytes": self.block_bytes,
            "hit_rate": stats["hit_chunks"] / max(stats["chunks"], 1),
            "token_hit_rate": stats["saved_tokens"] / max(stats["input_tokens"], 1),
            "prefill_tokens_saved": stats["saved_tokens"],
            "hits_by_source": {k[5:]: v for k, v in stats.items() if k.startswith("hits_")},
            "peer_bytes": stats["peer_bytes"],
            "redis_read_bytes": stats["redis_read_bytes"],
            "redis_write_bytes": stats["redis_write_bytes"],
            "span_s": span,
            "peer_bytes_per_request": stats["peer_bytes"] / max(stats["requests"], 1),
            "peer_bytes_per_node_s": stats["peer_bytes"] / span / config.nodes,
            "peer_bytes_busiest_node_s": max(self.per_node_in) / span,
            "index_fields_peak": index.peak_fields,
            "index_hashes_peak": index.peak_hashes,
            "index_bytes_peak": index.bytes_for(index.peak_hashes, index.peak_fields),
            "index_ops": dict(index.ops),
            "index_ops_per_s": ops / span,
            "index_ops_per_s_peak": max(index.ops_by_second.values(), default=0),
            "index_ops_per_s_no_leases": (ops - index.ops["lease_get"]) / span,
            "index_ops_per_s_named_leases": (ops - index.ops["lease_get"] + index.named_lease_gets)
            / span,
            "index_ops_per_s_peak_no_leases": max(
                index.ops_by_second_no_leases.values(), default=0
            ),
            "mean_queue_s": stats["queue_s"] / max(stats["requests"], 1),
            "load_policy": config.load_policy,
            "loaded_chunks": stats["loaded_chunks"],
            "declined_chunks": stats["declined_chunks"],
            "load_s": stats["load_s"],
            **_ttft(self.ttft),
            "load_max_over_mean": max(loads) / (sum(loads) / len(loads)) if sum(loads) else 0.0,
            "evicted": sum(node.evicted for node in self.nodes),
            "wall_s": wall_s,
        }


def _ttft(values: list[float]) -> dict[str, float]:
    """Mean and percentiles of the requests' times to first token (prefill end), seconds."""
    if not values:
        return {"ttft_mean_s": 0.0, "ttft_p50_s": 0.0, "ttft_p90_s": 0.0, "ttft_p99_s": 0.0}
    cuts = (
        statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values * 99
    )
    return {
        "ttft_mean_s": statistics.fmean(values),
        "ttft_p50_s": cuts[49],
        "ttft_p90_s": cuts[89],
        "ttft_p99_s": cuts[98],
    }
