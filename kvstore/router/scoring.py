"""Choosing a replica: the cached prefix each one would reuse, weighed against its load.

Per replica, the *reusable prefix* is the leading run of the request's chunks that some source
says that replica can reach without computing: the engine's own prefix cache (tier ``local`` in
the cluster index: the node beside the engine publishes the chunks its engine's KV events show,
``cluster.engine_events``), a provisional entry the router recorded when it sent an earlier
request there, or the tiers of the kvstore node beside it in the cluster index. Each chunk counts
``chunk_size`` tokens times the weight of the fastest source that has it (:data:`TIER_WEIGHTS`:
engine-local > hbm > dram > nvme > shared redis).

    score = hit_weight * weighted_hit_tokens
            - (queued_prefill_tokens + request_cost_tokens * in_flight)

``queued_prefill_tokens`` and ``in_flight`` are the router's own count of what it sent to the
replica: a request adds its prompt tokens less its predicted hit until the first response byte
(its prefill is done), and one in-flight request until its response ends. Ties go to the replica
with fewer requests in flight, then round robin.

A *provisional entry* (the chosen replica, for each of the request's chunks, for
``provisional_ttl_s``) lets a burst of one new prefix follow the first request before the
engine's blocks reach the index.

**Why** (:attr:`Decision.reason`): the tokens *credited* to each replica are its reusable prefix
(capped at the prompt); the *shared* tokens are the fewest credited to any replica (the prefix
every replica would reuse: a system prompt they all cache). ``prefix``: the chosen replica is
credited more than the shared tokens: it was chosen for a prefix the others lack.
``shared_prefix``: every replica is credited the same, more than nothing: a prefix all of them
hold decided nothing, load did. ``load``: nothing is credited anywhere, or a replica credited
more lost to load. (``round_robin`` for that baseline; the router replaces the reason when it
had no index answer, :mod:`kvstore.router.decision`.)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from kvstore.cluster.index import Holding
from kvstore.cluster.layout import LOCAL

__all__ = ["POLICIES", "TIER_WEIGHTS", "Decision", "Load", "Provisional", "Replica", "Scorer"]

#: ``router.policy`` values: ``kv`` scores cached prefixes against load (above); the other two
#: are the baselines the KV-aware choice is measured against (benchmarks/bench_route_replay.py):
#: ``round_robin`` takes replicas in turn, ``least_loaded`` the lowest load term alone.
POLICIES = ("kv", "round_robin", "least_loaded")

#: Weight of a cached chunk per source. "local" is the engine's own cache (as its node publishes
#: it to the index, :data:`~kvstore.cluster.layout.LOCAL`, and provisional entries, which
#: predict it); the rest are kvstore tier names as the index publishes them.
TIER_WEIGHTS: dict[str, float] = {
    LOCAL: 1.0,
    "hbm": 0.9,
    "dram": 0.8,
    "nvme": 0.5,
    "redis": 0.2,
}


@dataclass(frozen=True)
class Replica:
    """One engine the router sends work to, and the kvstore node beside it."""

    url: str
    node: str


@dataclass
class Load:
    """What the router has sent to one replica and not seen finish."""

    in_flight: int = 0
    queued_prefill_tokens: int = 0


@dataclass(frozen=True)
class Decision:
    """The chosen replica and why."""

    replica: Replica
    #: ``prefix``, ``shared_prefix``, ``load`` or ``round_robin`` (see the module docstring); the
    #: router's decision replaces it when the index gave no answer (:mod:`.decision`).
    reason: str
    score: float
    #: Tokens of the prompt the chosen replica is predicted not to compute.
    predicted_hit_tokens: int
    #: Every replica in order of preference (the first is ``replica``), for retries.
    ranked: tuple[Replica, ...]
    #: Per replica url, the prompt tokens its reusable prefix covers.
    credited: Mapping[str, int] = field(default_factory=dict)
    #: The fewest tokens credited to any replica: the prefix all of them would reuse.
    shared_tokens: int = 0


class Provisional:
    """Chunk key -> replica url -> expiry: where the router recently sent which chunks."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: dict[bytes, dict[str, float]] = {}
        self._next_sweep = clock() + ttl_s

    def record(self, keys: Sequence[bytes], url: str) -> None:
        """``url`` will hold ``keys`` soon."""
        now = self._clock()
        expiry = now + self.ttl_s
        for key in keys:
            self._entries.setdefault(key, {})[url] = expiry
        if now >= self._next_sweep:  # drop expired entries once per TTL: memory stays bounded
            self._next_sweep = now + self.ttl_s
            for key in [k for k, urls in self._entries.items() if max(urls.values()) <= now]:
                del self._entries[key]

    def holders(self, keys: Sequence[bytes]) -> dict[str, int]:
        """Per replica url: how many leading ``keys`` it has an unexpired entry for."""
        now = self._clock()
        leading: dict[str, int] = {}
        alive: set[str] | None = None
        for index, key in enumerate(keys):
            urls = {url for url, expiry in self._entries.get(key, {}).items() if expiry > now}
            alive = urls if alive is None else alive & urls
            if not alive:
                break
            for url in alive:
                leading[url] = index + 1
        return leading


class Scorer:
    """Scores replicas for one request and keeps their load."""

    def __init__(
        self,
        replicas: Sequence[Replica],
        chunk_size: int,
        hit_weight: float,
        request_cost_tokens: int,
        provisional: Provisional,
        policy: str = "kv",
    ) -> None:
        self.replicas = tuple(replicas)
        self.policy = policy
        self.chunk_size = chunk_size
        self.hit_weight = hit_weight
        self.request_cost_tokens = request_cost_tokens
        self.provisional = provisional
        self.load: dict[str, Load] = {r.url: Load() for r in replicas}
        self._turn = 0

    def hit_chunks(
        self,
        replica: Replica,
        count: int,
        holdings: Mapping[str, Holding],
        provisional: Mapping[str, int],
    ) -> tuple[int, float]:
        """The replica's reusable leading chunks and their weighted token count: a chunk counts
        at the weight of the fastest source that has it (a provisional entry counts as local;
        the index's entries as their tier, ``local`` for the engine's own cache)."""
        engine = provisional.get(replica.url, 0)
        holding = holdings.get(replica.node)
        tiers = holding.tiers if holding is not None else []
        chunks, weighted = 0, 0.0
        for index in range(count):
            if index < engine:
                weight = TIER_WEIGHTS[LOCAL]
            elif index < len(tiers) and tiers[index]:
                weight = TIER_WEIGHTS.get(tiers[index], TIER_WEIGHTS["redis"])
            else:
                break
            chunks += 1
            weighted += weight * self.chunk_size
        return chunks, weighted

    def choose(
        self,
        keys: Sequence[bytes],
        prompt_tokens: int,
        holdings: Mapping[str, Holding],
    ) -> Decision:
        """The best replica for a request of ``prompt_tokens`` tokens whose chunks are ``keys``.

        ``holdings`` is the index's answer (node -> holding; empty when the index is out); the
        engines' own caches are in it, as tier ``local`` of the node beside each engine.
        """
        kv = self.policy == "kv"
        provisional = self.provisional.holders(keys) if keys and kv else {}
        holdings = holdings if kv else {}
        turn, self._turn = self._turn, self._turn + 1
        count = len(keys)
        rows = []
        credited: dict[str, int] = {}
        for position, replica in enumerate(self.replicas):
            chunks, weighted = self.hit_chunks(replica, count, holdings, provisional)
            credited[replica.url] = min(chunks * self.chunk_size, prompt_tokens)
            load = self.load[replica.url]
            cost = load.queued_prefill_tokens + self.request_cost_tokens * load.in_flight
            score = self.hit_weight * weighted - cost
            order = (position - turn) % len(self.replicas)
            if self.policy == "round_robin":  # the turn alone decides
                score, in_flight = 0.0, 0
            else:
                in_flight = load.in_flight
            rows.append((-score, in_flight, order, replica))
        rows.sort(key=lambda row: row[:3])
        best = rows[0][3]
        hit_tokens, shared = credited[best.url], min(credited.values())
        if self.policy == "round_robin":
            reason = "round_robin"
        elif hit_tokens > shared:
            reason = "prefix"
        elif shared and max(credited.values()) == shared:
            reason = "shared_prefix"
        else:
            reason = "load"
        return Decision(
            replica=best,
            reason=reason,
            score=-rows[0][0],
            predicted_hit_tokens=hit_tokens,
            ranked=tuple(row[3] for row in rows),
            credited=credited,
            shared_tokens=shared,
        )

    def dispatched(self, replica: Replica, keys: Sequence[bytes], prefill: int) -> None:
        """A request went to ``replica`` with ``prefill`` tokens to compute; remember its chunks."""
        load = self.load[replica.url]
        load.in_flight += 1
        load.queued_prefill_tokens += prefill
        if keys:
            self.provisional.record(keys, replica.url)

    def prefilled(self, replica: Replica, prefill: int) -> None:
        """The replica's first response byte arrived: its prefill is no longer queued."""
        load = self.load[replica.url]
        load.queued_prefill_tokens = max(load.queued_prefill_tokens - prefill, 0)

    def finished(self, replica: Replica) -> None:
        """The replica's response ended."""
        load = self.load[replica.url]
        load.in_flight = max(load.in_flight - 1, 0)
