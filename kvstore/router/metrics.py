"""The router's Prometheus metrics (its own registry, served on the router's ``/metrics``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["RouterMetrics"]

_TOKENS = (0, 256, 1024, 4096, 8192, 16384, 32768, 65536, 131072)


class RouterMetrics:
    """Every series ``kvstore router`` exports."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._decision_series(self.registry)
        self._index_series(self.registry)
        self._proxy_series(self.registry)

    def _decision_series(self, r: CollectorRegistry) -> None:
        """What each routing decision chose, why, and what it weighed."""
        self.decisions = Counter(
            "kvstore_router_decisions",
            "Routing decisions by chosen replica and reason (prefix: it reuses more of the prompt "
            "than every replica would; shared_prefix: all would reuse the same, load decided; "
            "load: none reuses any, or load outweighed it; index_timeout, index_unavailable, "
            "no_tokens: routed without the index; round_robin)",
            ["replica", "reason"],
            registry=r,
        )
        self.fallbacks = Counter(
            "kvstore_router_fallbacks",
            "Requests routed without the index, by why (index_timeout, index_error, index_down, "
            "no_index, no_tokens, no_namespace)",
            ["reason"],
            registry=r,
        )
        self.beyond_shared = Histogram(
            "kvstore_router_credited_beyond_shared_tokens",
            "Prompt tokens the chosen replica reuses beyond the prefix every replica would reuse",
            buckets=_TOKENS,
            registry=r,
        )
        self.score = Histogram(
            "kvstore_router_score",
            "Score of the chosen replica (weighted hit tokens less load)",
            buckets=(-16384, -1024, -256, 0, 256, 1024, 4096, 16384, 65536),
            registry=r,
        )
        self.predicted_hit_tokens = Histogram(
            "kvstore_router_predicted_hit_tokens",
            "Prompt tokens the chosen replica is predicted not to compute",
            buckets=_TOKENS,
            registry=r,
        )
        self.prompt_tokens = Histogram(
            "kvstore_router_prompt_tokens",
            "Prompt tokens of routed requests",
            buckets=_TOKENS,
            registry=r,
        )
        self.decision_seconds = Histogram(
            "kvstore_router_decision_seconds",
            "Time to decide (chunk keys, index query, scoring; tokenizing excluded)",
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.25),
            registry=r,
        )

    def _index_series(self, r: CollectorRegistry) -> None:
        """How the cluster index answers, and the key schemes the nodes publish there."""
        self.index_errors = Counter(
            "kvstore_router_index_errors", "Index queries that failed or timed out", registry=r
        )
        self.index_seconds = Histogram(
            "kvstore_router_index_seconds",
            "Time the index took to answer (answered queries; they size the deadline)",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
            registry=r,
        )
        self.index_deadline = Gauge(
            "kvstore_router_index_deadline_seconds",
            "The index query's current deadline (2 x p99 of recent answers, within "
            "router.index_timeout_s and router.index_timeout_max_s)",
            registry=r,
        )
        self.scheme_reads = Counter(
            "kvstore_router_key_scheme_reads",
            "Reads of the key schemes the nodes publish (every 2 s while requests come)",
            registry=r,
        )
        self.scheme_refused = Gauge(
            "kvstore_router_replica_scheme_refused",
            "1 while the replica's node publishes a key scheme that differs from the fleet's "
            "(it is then not scored by cached prefix)",
            ["replica"],
            registry=r,
        )

    def _proxy_series(self, r: CollectorRegistry) -> None:
        """The requests proxied to the replicas."""
        self.responses = Counter(
            "kvstore_router_responses",
            "Proxied requests by replica and outcome (ok: the whole response relayed; "
            "client_gone: the client closed first; upstream_error)",
            ["replica", "outcome"],
            registry=r,
        )
        self.in_flight = Gauge(
            "kvstore_router_in_flight", "Requests in flight per replica", ["replica"], registry=r
        )
