"""The event-level simulation of N engines, each beside a kvstore node, behind one router.

Per request (in arrival order): the router picks a node, with kvstore's own
:class:`~kvstore.router.scoring.Scorer` over the simulated cluster index (``kv``) or in turn
(``round-robin``); that node's store answers a get of the request's chunk keys (its tiers, then
peers or Redis, see :class:`~.node.SimNode`); the engine's prefix hit is the *leading* run found.
The engine prefills the rest at ``prefill_tokens_per_s`` after the requests queued before it
(one FIFO prefill queue per engine; decoding overlaps) and then puts the chunks it computed; the
Scorer sees the request dispatched, prefilled and finished at those times, as the router does.

``sequential`` runs each request to its end before the next one arrives (the validation driver
does exactly that against real nodes). Events, not bytes: a block is a key and a size.
"""

from __future__ import annotations

import heapq
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvstore.policy import Policy
from kvstore.router.scoring import Provisional, Replica, Scorer

from .index import SimIndex
from .node import SimNode, footprints, key_of
from .workloads import Workload

__all__ = ["SHARED_DATA", "SimConfig", "simulate"]

#: ``cluster.shared_data`` values, plus ``none``: each node reads only its own tiers.
SHARED_DATA = ("peers", "redis", "both", "none")
ROUTINGS = ("kv", "round-robin")
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

    def __post_init__(self) -> None:
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
        prefill = request.input_tokens - hit_tokens
        self.scorer.dispatched(replica, keys, max(request.input_tokens - predicted, 0))
        missing = keys[leading:]
        routed = (where, replica, missing, max(request.input_tokens - predicted, 0))
        if config.sequential:
            self._prefilled(*routed)
            self.scorer.finished(replica)
            return
        start = max(self.now, self.free_at[where])
        done = start + prefill / config.prefill_tokens_per_s
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
            "load_max_over_mean": max(loads) / (sum(loads) / len(loads)) if sum(loads) else 0.0,
            "evicted": sum(node.evicted for node in self.nodes),
            "wall_s": wall_s,
        }
