"""Prometheus metrics of a running server, read at scrape time.

Nothing here sits on a request's path: the data planes time each request into
:data:`~kvstore.server.durations.DURATIONS`, and everything else (tier usage, hits, misses by
reason, the shared tier, prefetch and shared-memory state) is read from the stores' own counters
by :class:`StoreCollector` when Prometheus scrapes. The names are a contract with the dashboard
and alert rules (``deploy/grafana``).

Every series about a tenant carries its ``tenant`` label; :class:`TenantView` is what a tenant's
own scrape sees (:mod:`kvstore.server.metrics_http` picks it from the caller's credentials): its
series and the server-wide families of :data:`SERVER_WIDE`, nothing labelled with another tenant
or with none.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

from kvstore.server.durations import BUCKETS, DURATIONS, Durations
from kvstore.store.counters import MISS_REASONS

if TYPE_CHECKING:  # tenancy imports the shared-memory server, which records durations
    from kvstore.server.tenancy import Tenant, Tenants
    from kvstore.store import TieredStore

__all__ = ["SERVER_WIDE", "StoreCollector", "TenantView", "build_registry"]

_PREFETCH_OUTCOMES = {
    "ready": "prefetch_keys_ready",
    "missing": "prefetch_keys_missing",
    "failed": "prefetch_keys_failed",
    # Prefetches cancelled (each may have held many keys; the prefetcher counts calls).
    "cancelled": "prefetch_cancelled",
}


#: Families that describe the server, not a tenant: every scrape sees them. Any other series
#: reaches a tenant's scrape only with that tenant's label (deny by default: a family added later
#: without a ``tenant`` label stays out of tenants' scrapes until it is listed here).
SERVER_WIDE = frozenset({"kvstore_build_info"})


class _Spec(NamedTuple):
    """One metric family a scrape reads from the stores."""

    kind: type[CounterMetricFamily] | type[GaugeMetricFamily]
    name: str
    help: str
    labels: tuple[str, ...]


_COUNTER, _GAUGE = CounterMetricFamily, GaugeMetricFamily
_TIER = ("tier", "tenant")
_TENANT = ("tenant",)

#: The families read from the stores, by the key :meth:`StoreCollector._collect_tenant` fills
#: them under, in the order a scrape shows them.
_FAMILIES: dict[str, _Spec] = {
    "hits": _Spec(_COUNTER, "kvstore_tier_hits", "Blocks served from the tier", _TIER),
    "misses": _Spec(_COUNTER, "kvstore_misses", "Keys not served, by reason", ("reason", "tenant")),
    "read": _Spec(_COUNTER, "kvstore_tier_read_bytes", "Payload bytes served from the tier", _TIER),
    "written": _Spec(
        _COUNTER, "kvstore_tier_written_bytes", "Payload bytes written into the tier", _TIER
    ),
    "evictions": _Spec(_COUNTER, "kvstore_tier_evictions", "Blocks evicted from the tier", _TIER),
    "demotions": _Spec(
        _COUNTER, "kvstore_tier_demotions", "Blocks moved down out of the tier", _TIER
    ),
    "promotions": _Spec(
        _COUNTER, "kvstore_tier_promotions", "Blocks moved up into the tier", _TIER
    ),
    "write_errors": _Spec(
        _COUNTER, "kvstore_tier_write_errors", "Writes the tier's medium refused", _TIER
    ),
    "corrupt": _Spec(
        _COUNTER, "kvstore_tier_corrupt_blocks", "Blocks that failed verification", _TIER
    ),
    "newer": _Spec(
        _COUNTER,
        "kvstore_tier_newer_format_blocks",
        "Blocks in a format version newer than this release reads: misses, left in place",
        _TIER,
    ),
    "untrusted": _Spec(
        _COUNTER,
        "kvstore_peer_untrusted",
        "Peers not trusted: descriptions in the index that do not verify "
        "(unverified_node), holders that did not prove themselves (unproven)",
        ("reason", "tenant"),
    ),
    "dropped": _Spec(
        _COUNTER,
        "kvstore_shared_writes_dropped",
        "Blocks never shared: write-throughs given up (backlog or re-send queue full)",
        _TENANT,
    ),
    "resent": _Spec(
        _COUNTER,
        "kvstore_shared_writes_resent",
        "Write-throughs Redis refused, then took when sent again",
        _TENANT,
    ),
    "reconnects": _Spec(
        _COUNTER, "kvstore_shared_reconnects", "Shared-tier outages ended", _TENANT
    ),
    "prefetch": _Spec(
        _COUNTER, "kvstore_prefetch_keys", "Prefetched keys by outcome", ("outcome", "tenant")
    ),
    "lookups": _Spec(_COUNTER, "kvstore_lookups", "Lookup calls", ("plane", "tenant")),
    "early": _Spec(
        _COUNTER,
        "kvstore_tier_retained_evicted_early",
        "Retained blocks evicted before their time (the tier was full of retained ones)",
        _TIER,
    ),
    "blocks": _Spec(_GAUGE, "kvstore_tier_resident_blocks", "Blocks the tier holds", _TIER),
    "retained_blocks": _Spec(
        _GAUGE, "kvstore_tier_retained_blocks", "Blocks held whose retention is not up", _TIER
    ),
    "retained_bytes": _Spec(
        _GAUGE, "kvstore_tier_retained_bytes", "Bytes of blocks whose retention is not up", _TIER
    ),
    "bytes": _Spec(_GAUGE, "kvstore_tier_resident_bytes", "Bytes the tier holds", _TIER),
    "capacity": _Spec(_GAUGE, "kvstore_tier_capacity_bytes", "The tier's capacity", _TIER),
    "read_rate": _Spec(
        _GAUGE,
        "kvstore_tier_read_rate_bytes_per_second",
        "Measured read rate of the tier (or of peers), fitted over recent batched reads",
        _TIER,
    ),
    "read_latency": _Spec(
        _GAUGE,
        "kvstore_tier_read_latency_seconds",
        "Measured fixed cost of one batched read from the tier (or from peers)",
        _TIER,
    ),
    "up": _Spec(_GAUGE, "kvstore_shared_tier_up", "1 while the shared tier answers", _TENANT),
    "mismatched": _Spec(
        _GAUGE,
        "kvstore_shared_keyring_mismatched_nodes",
        "Nodes on the shared tier whose integrity keyring shares no secret with this one",
        _TENANT,
    ),
    "backlog": _Spec(
        _GAUGE,
        "kvstore_shared_write_backlog_bytes",
        "Payload bytes on their way to the shared tier",
        _TENANT,
    ),
    "resend_queue": _Spec(
        _GAUGE,
        "kvstore_shared_write_queue_blocks",
        "Write-throughs Redis refused, waiting to be sent again",
        _TENANT,
    ),
    "resend_bytes": _Spec(
        _GAUGE,
        "kvstore_shared_write_queue_bytes",
        "Payload bytes of the write-throughs waiting to be sent again",
        _TENANT,
    ),
    "queue": _Spec(_GAUGE, "kvstore_prefetch_queue_keys", "Keys of unfinished prefetches", _TENANT),
    "connections": _Spec(
        _GAUGE, "kvstore_shm_connections", "Shared-memory connections open", _TENANT
    ),
    "leases": _Spec(_GAUGE, "kvstore_shm_leases", "Arena leases held by clients", _TENANT),
    "reservations": _Spec(
        _GAUGE, "kvstore_shm_reservations", "Arena reservations held by clients", _TENANT
    ),
}


class StoreCollector(Collector):
    """Reads every tenant's store, prefetcher and shared-memory server when scraped."""

    def __init__(self, tenants: Tenants, version: str, durations: Durations = DURATIONS) -> None:
        self._tenants = tenants
        self._version = version
        self._durations = durations

    def collect(self) -> Iterable[Metric]:
        """One family per metric name, a series per tenant (and tier, reason...)."""
        f: dict[str, Any] = {
            key: spec.kind(spec.name, spec.help, labels=list(spec.labels))
            for key, spec in _FAMILIES.items()
        }
        for tenant in self._tenants:
            self._collect_tenant(tenant, f)
        f["misses"].add_metric(["denied", ""], self._durations.denied)
        yield from f.values()
        yield self._histogram()
        info = GaugeMetricFamily("kvstore_build_info", "The server's version", labels=["version"])
        info.add_metric([self._version], 1)
        yield info

    def _collect_tenant(self, tenant: Tenant, f: dict[str, Any]) -> None:
        """Add ``tenant``'s series to the families ``f`` (by their :data:`_FAMILIES` key)."""
        name = tenant.name
        counters = tenant.store.counters
        _tier_series(name, tenant.store, f)
        _peer_series(name, counters.values, f)
        for reason in MISS_REASONS:
            if reason != "denied":
                f["misses"].add_metric([reason, name], counters.misses[reason])
        _shared_series(tenant, f)
        prefetch = tenant.prefetcher.stats()
        for outcome, counter in _PREFETCH_OUTCOMES.items():
            f["prefetch"].add_metric([outcome, name], prefetch.get(counter, 0))
        f["queue"].add_metric([name], prefetch.get("prefetch_queued_keys", 0))
        for plane in ("grpc", "shm"):
            f["lookups"].add_metric([plane, name], self._durations.count("lookup", plane, name))
        f["lookups"].add_metric(["index", name], counters.values["index_lookups"])
        shm = tenant.shm.stats() if tenant.shm is not None else {}
        f["connections"].add_metric([name], shm.get("connections", 0))
        f["leases"].add_metric([name], shm.get("leases", 0))
        f["reservations"].add_metric([name], shm.get("reservations", 0))

    def _histogram(self) -> HistogramMetricFamily:
        family = HistogramMetricFamily(
            "kvstore_request_duration_seconds",
            "Time to serve a request, by operation and data plane",
            labels=["op", "plane", "tenant"],
        )
        for labels, series in self._durations.items():
            running = 0.0
            buckets: list[tuple[str, float]] = []
            for bound, count in zip([*BUCKETS, float("inf")], series[:-1], strict=True):
                running += count
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), running))
            family.add_metric(list(labels), buckets, series[-1])
        return family


def _tier_series(name: str, store: TieredStore, f: dict[str, Any]) -> None:
    """Tenant ``name``'s series of each tier of its store: traffic, usage, measured read rates."""
    counters = store.counters
    stats = store.stats()
    shared_tier = store.shared_writer.tier
    for tier_name, entry in stats["tiers"].items():
        labels = [tier_name, name]
        f["hits"].add_metric(labels, counters.tier_hits[tier_name])
        f["read"].add_metric(labels, counters.read_bytes[tier_name])
        f["written"].add_metric(labels, counters.written_bytes[tier_name])
        f["evictions"].add_metric(labels, counters.evictions[tier_name])
        f["demotions"].add_metric(labels, counters.demotions[tier_name])
        f["promotions"].add_metric(labels, counters.promotions[tier_name])
        f["write_errors"].add_metric(labels, entry.get("write_errors", 0))
        f["corrupt"].add_metric(labels, entry.get("corrupt_blocks", 0))
        f["newer"].add_metric(labels, entry.get("newer_format_blocks", 0))
        f["blocks"].add_metric(labels, entry.get("blocks", 0))
        f["early"].add_metric(labels, counters.evicted_early[tier_name])
        f["retained_blocks"].add_metric(labels, entry.get("retained_blocks", 0))
        f["retained_bytes"].add_metric(labels, entry.get("retained_bytes", 0))
        f["bytes"].add_metric(labels, entry.get("used", 0))
        if not (shared_tier is not None and tier_name == shared_tier.name):
            # Redis evicts by itself and no node knows its size: the store's stand-in
            # capacity (2**62) would make every fill ratio read 0.
            f["capacity"].add_metric(labels, entry.get("capacity", 0))
    for tier_name, meter in counters.read_rates.items():
        rate = meter.rate()
        if rate.known:  # what the vLLM connector weighs loads by (kvstore.client.cost_model)
            f["read_rate"].add_metric([tier_name, name], rate.per_s)
            f["read_latency"].add_metric([tier_name, name], rate.latency_s)


def _peer_series(name: str, values: Mapping[str, int], f: dict[str, Any]) -> None:
    """Tenant ``name``'s series of blocks and nodes refused, where it reads its peers."""
    if "peer_corrupt_blocks" in values:  # a node reading its peers: blocks they sent refused
        f["corrupt"].add_metric(["peer", name], values["peer_corrupt_blocks"])
        f["newer"].add_metric(["peer", name], values.get("peer_newer_format_blocks", 0))
        for reason in ("unverified_node", "unproven"):
            key = "peer_unverified_nodes" if reason == "unverified_node" else "peer_unproven"
            f["untrusted"].add_metric([reason, name], values.get(key, 0))


def _shared_series(tenant: Tenant, f: dict[str, Any]) -> None:
    """``tenant``'s series of the shared tier (Redis): its keyring check and its write-throughs."""
    name = tenant.name
    if tenant.keyring_record is not None:  # with the shared tier it kept off, if it did
        f["mismatched"].add_metric([name], tenant.keyring_record.mismatched)
    writer = tenant.store.shared_writer
    shared = writer.tier
    if shared is not None:
        values = tenant.store.counters.values
        f["dropped"].add_metric([name], values["write_through_dropped"])
        f["resent"].add_metric([name], values["write_through_resent"])
        f["resend_queue"].add_metric([name], writer.queued_blocks)
        f["resend_bytes"].add_metric([name], writer.queued_bytes)
        f["reconnects"].add_metric([name], shared.reconnects)
        f["up"].add_metric([name], int(shared.up))
        f["backlog"].add_metric([name], writer.backlog_bytes)


def build_registry(tenants: Tenants, version: str | None = None) -> CollectorRegistry:
    """A registry holding only this server's metrics (no process or platform collectors);
    ``version`` defaults to the package's (read from the loaded package: importing it from here
    would be an import of a higher layer)."""
    if version is None:
        version = str(getattr(sys.modules["kvstore"], "__version__", ""))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(tenants, version))
    return registry


class TenantView(Collector):
    """What tenant ``tenant`` may see of ``source``: its own series and :data:`SERVER_WIDE`."""

    def __init__(self, source: Collector, tenant: str) -> None:
        self._source = source
        self._tenant = tenant

    def collect(self) -> Iterable[Metric]:
        """The source's families with every sample of another tenant (or of none) left out."""
        for family in self._source.collect():
            if family.name in SERVER_WIDE:
                yield family
                continue
            samples = [s for s in family.samples if s.labels.get("tenant") == self._tenant]
            if samples:
                own = Metric(family.name, family.documentation, family.type, family.unit)
                own.samples = samples
                yield own
