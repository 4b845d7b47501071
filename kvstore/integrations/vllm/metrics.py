"""The connector's figures through vLLM's KV-connector statistics hooks, into vLLM's ``/metrics``.

vLLM (0.32) asks every worker's connector and the scheduler's for a
:class:`KVStoreConnectorStats` each engine step, sums them
(:meth:`~KVStoreConnectorStats.aggregate`) and sends the sum to its front end, which logs
:meth:`~KVStoreConnectorStats.reduce` every log interval (``KV Transfer metrics: ...``) and
feeds :class:`KVStorePromMetrics`, which adds it to these Prometheus series, labelled like
vLLM's own (``model_name``, ``engine``):

- ``vllm:kvstore_lookup_tokens_total``, ``vllm:kvstore_hit_tokens_total``
- ``vllm:kvstore_declined_tokens_total`` (hit tokens the load plan recomputed instead: a tier
  slower than the engine's prefill)
- ``vllm:kvstore_loaded_tokens_total`` (the prompt tokens kvstore saved the engine computing)
  and ``vllm:kvstore_loaded_tokens_by_path_total{path}`` (the same by the way they came: on a GPU,
  ``shm-dma`` straight from the arena, ``shm-staged`` through host staging)
- ``vllm:kvstore_load_failed_tokens_total{reason}``
- ``vllm:kvstore_saved_tokens_total``, ``vllm:kvstore_save_failed_tokens_total{reason}``
- ``vllm:kvstore_loaded_bytes_by_group_total{group}`` (bytes loaded into each KV cache group,
  ``kind/index``: a sliding-window group loads only its window)
- ``vllm:kvstore_unsupported_group_total{kind}`` (requests answered 0 tokens because the model
  has a KV cache group of a kind kvstore does not store, such as recurrent ``state``)
- ``vllm:kvstore_lookup_seconds``, ``vllm:kvstore_load_seconds`` (histograms)

The figures themselves are kept and summed by :mod:`kvstore.integrations.vllm.stats`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from kvstore.integrations.vllm import stats as vllm_stats

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["KVStoreConnectorStats", "KVStorePromMetrics"]

_COUNTERS = {
    "lookup_tokens": "Prompt tokens the kvstore connector looked up in kvstore.",
    "hit_tokens": "Prompt tokens the kvstore connector found in kvstore.",
    "declined_tokens": "Prompt tokens found in kvstore that loading would not have sped up.",
    "loaded_tokens": (
        "Prompt tokens loaded from kvstore: the tokens kvstore saved the engine computing."
    ),
    "saved_tokens": "Prompt tokens the engine stored into kvstore.",
}
_BY_REASON = {
    "load_failed_tokens": "Prompt tokens planned for loading from kvstore that failed, by reason.",
    "save_failed_tokens": "Prompt tokens planned for saving to kvstore that never got there.",
}
# data field -> (series name, label, help)
_LABELLED = {
    "loaded_tokens_by_path": (
        "loaded_tokens_by_path",
        "path",
        "Prompt tokens loaded from kvstore, by the path they took.",
    ),
    "loaded_bytes_by_group": (
        "loaded_bytes_by_group",
        "group",
        "Bytes loaded from kvstore into each KV cache group (kind/index).",
    ),
    "unsupported_group_requests": (
        "unsupported_group",
        "kind",
        "Requests answered 0 tokens for a KV cache group kind kvstore does not store.",
    ),
}
_HISTOGRAMS = {
    "lookup_seconds": "Latency of the kvstore connector's lookups.",
    "load_seconds": "Latency of the kvstore connector's batched get per engine step.",
}
_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]


@dataclass
class KVStoreConnectorStats(KVConnectorStats):  # type: ignore[misc, unused-ignore]  # untyped base
    """The connector's figures over an interval, in the form vLLM moves and sums them."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        """Start afresh."""
        self.data = vllm_stats.empty()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Add ``other`` (another rank's, or the scheduler's) to these figures."""
        vllm_stats.merge(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval's figures as vLLM logs them."""
        return vllm_stats.summary(self.data)

    def is_empty(self) -> bool:
        """Whether nothing was recorded."""
        return vllm_stats.is_empty(self.data)


class KVStorePromMetrics(KVConnectorPromMetrics):  # type: ignore[misc, unused-ignore]  # untyped base
    """The connector's Prometheus series in vLLM's registry, one child per engine."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {
            name: create_metric_per_engine(
                self._counter_cls(
                    name=f"vllm:kvstore_{name}", documentation=doc, labelnames=labelnames
                ),
                per_engine_labelvalues,
            )
            for name, doc in _COUNTERS.items()
        }
        self._by_reason: dict[str, Any] = {
            name: self._counter_cls(
                name=f"vllm:kvstore_{name}", documentation=doc, labelnames=[*labelnames, "reason"]
            )
            for name, doc in _BY_REASON.items()
        }
        self._by_path: dict[str, Any] = {
            field: self._counter_cls(
                name=f"vllm:kvstore_{name}", documentation=doc, labelnames=[*labelnames, label]
            )
            for field, (name, label, doc) in _LABELLED.items()
        }
        self._histograms: dict[str, dict[int, Any]] = {
            name: create_metric_per_engine(
                self._histogram_cls(
                    name=f"vllm:kvstore_{name}",
                    documentation=doc,
                    buckets=_BUCKETS,
                    labelnames=labelnames,
                ),
                per_engine_labelvalues,
            )
            for name, doc in _HISTOGRAMS.items()
        }
        # Every reason appears from the start (at 0), so an alert on one need not wait for it.
        for values in per_engine_labelvalues.values():
            for reason in vllm_stats.LOAD_FAILURES:
                self._by_reason["load_failed_tokens"].labels(*values, reason)
            for reason in vllm_stats.SAVE_FAILURES:
                self._by_reason["save_failed_tokens"].labels(*values, reason)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add one step's summed figures to engine ``engine_idx``'s series."""
        for name, children in self._counters.items():
            if value := int(transfer_stats_data.get(name, 0)):
                children[engine_idx].inc(value)
        labels = self.per_engine_labelvalues[engine_idx]
        for name, counter in (*self._by_reason.items(), *self._by_path.items()):
            for reason, tokens in (transfer_stats_data.get(name) or {}).items():
                if tokens:
                    counter.labels(*labels, reason).inc(int(tokens))
        for name, children in self._histograms.items():
            for seconds in transfer_stats_data.get(name) or ():
                children[engine_idx].observe(float(seconds))
