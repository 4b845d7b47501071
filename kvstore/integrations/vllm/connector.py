"""vLLM KV connector: an unmodified vLLM engine stores and loads prompt KV through kvstore.

Load it through vLLM's own connector interface, with ``kv_load_failure_policy="recompute"`` so
that a chunk the store cannot deliver is recomputed instead of failing the request::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVStoreConnector",
        "kv_connector_module_path": "kvstore.integrations.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"target": "127.0.0.1:50051"}}'

    LLM(model=MODEL, kv_transfer_config={
        "kv_connector": "KVStoreConnector",
        "kv_connector_module_path": "kvstore.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"target": "127.0.0.1:50051"},
    })

``kv_connector_extra_config`` keys (see
:class:`~kvstore.integrations.vllm.common.ConnectorSettings`): ``target`` (required,
``HOST:PORT`` of ``kvstore serve``), ``chunk_size`` (tokens per stored chunk, a multiple of the
engine's block size) and ``hash_algorithm`` (both optional: the store's by default, and refused
if they differ from it, see :mod:`~kvstore.integrations.vllm.scheme`), ``tenant``,
``timeout_s`` (get/put deadline, default 5), ``lookup_timeout_s`` (longest a request waits for
its lookup, default 0.5), ``retry_after_s`` (how long a failed store is left alone, default 5;
an unreachable one is tried again as soon as its connection comes back), ``secret`` (else
``$KVSTORE_HASH_SECRET``), ``handoff_wait_s`` (longest a decode request waits for a prefill
engine's chunks to reach the store, default 2).

``kv_role``: ``kv_both`` (loads and saves), ``kv_producer`` (a prefill engine: never loads, saves
every whole prompt chunk and reports their count in the request's ``kv_transfer_params``) or
``kv_consumer`` (a decode engine: loads, never saves; see ``kvstore router --prefill/--decode``).

How it works: only whole ``chunk_size`` chunks of prompt tokens are stored, each under the chained
key of :class:`kvstore.ChunkHasher` in a namespace built from the engine's configuration (model,
revision, layers, KV heads, head size, dtype, cache layout and block size, TP rank and size,
pipeline stage, tenant) and the request's LoRA adapter and cache salt. The scheduler half
(:mod:`~kvstore.integrations.vllm.scheduler`) looks chunks up without blocking the scheduler and
plans loads and saves; the worker half (:mod:`~kvstore.integrations.vllm.worker`) moves blocks.

Hybrid models (several KV cache groups: sliding window, chunked local attention, recurrent
state): the connector is ``SupportsHMA``, so vLLM keeps its hybrid KV cache manager on; each
group's chunks are stored and loaded by that group's hit rule (:mod:`.hybrid`, docs/vllm-hybrid.md).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvstore.integrations.vllm.common import ConnectorSettings, StepPlan
from kvstore.integrations.vllm.metrics import KVStoreConnectorStats, KVStorePromMetrics
from kvstore.integrations.vllm.scheduler import SchedulerSide
from kvstore.integrations.vllm.workers import GroupWorkers

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["ConnectorSettings", "KVStoreConnector", "KVStoreConnectorMetadata"]

logger = logging.getLogger(__name__)


def _log_through_vllm() -> None:
    """Show kvstore's log lines where vLLM shows its own.

    vLLM configures only the ``vllm`` logger; kvstore's lines (the namespace ``kvstore router
    --namespace`` needs, a store that went down) would otherwise reach nobody below WARNING.
    Where the application configured logging itself (root or ``kvstore`` has handlers) it is
    left alone, and so is a vLLM whose own logging is switched off (no handlers to share).
    """
    ours = logging.getLogger("kvstore")
    vllm_handlers = logging.getLogger("vllm").handlers
    if ours.handlers or logging.getLogger().handlers or not vllm_handlers:
        return
    for handler in vllm_handlers:
        ours.addHandler(handler)
    ours.setLevel(logging.INFO)
    ours.propagate = False


@dataclass
class KVStoreConnectorMetadata(StepPlan, KVConnectorMetadata):  # type: ignore[misc, unused-ignore]  # untyped base
    """One engine step's :class:`~kvstore.integrations.vllm.common.StepPlan` as the connector
    metadata vLLM carries from the scheduler to the workers."""

    @classmethod
    def of(cls, plan: StepPlan) -> KVStoreConnectorMetadata:
        """The same plan, typed for vLLM."""
        return cls(
            loads=plan.loads,
            saves=plan.saves,
            preempted_req_ids=plan.preempted_req_ids,
            chunk_size=plan.chunk_size,
        )


class KVStoreConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc, unused-ignore]
    """A ``KVConnectorBase_V1`` that shares prompt KV between engines through kvstore.

    vLLM creates one per process: the scheduler's instance delegates to a
    :class:`~kvstore.integrations.vllm.scheduler.SchedulerSide`, each worker's to a
    :class:`~kvstore.integrations.vllm.workers.GroupWorkers` (one
    :class:`~kvstore.integrations.vllm.worker.WorkerSide` per KV cache group).

    It supports vLLM's hybrid KV cache manager (``SupportsHMA``), so vLLM keeps it on with
    kvstore configured: every KV cache group's blocks are planned with that group's hit rule
    (:mod:`kvstore.integrations.vllm.hybrid`), and a model with a group kvstore does not store
    (recurrent state) runs with nothing loaded or saved.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _log_through_vllm()
        transfer = self._kv_transfer_config
        settings = ConnectorSettings.from_extra_config(dict(transfer.kv_connector_extra_config))
        self._scheduler: SchedulerSide | None = None
        self._worker: GroupWorkers | None = None
        if role == KVConnectorRole.SCHEDULER:
            if getattr(transfer, "kv_load_failure_policy", "recompute") != "recompute":
                logger.warning(
                    "kv_load_failure_policy is %r: a chunk the store fails to deliver will fail "
                    "its request; set it to 'recompute' to recompute such chunks instead",
                    transfer.kv_load_failure_policy,
                )
            self._scheduler = SchedulerSide(settings, vllm_config, kv_cache_config)
        else:
            self._worker = GroupWorkers(settings, vllm_config, kv_cache_config)

    @property
    def requires_kv_delivery(self) -> bool:
        """A cache, not a hand-off: a save lost to preemption is just a future miss."""
        return False

    def _scheduler_side(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("scheduler-side call on a worker-side KVStoreConnector")
        return self._scheduler

    def _worker_side(self) -> GroupWorkers:
        if self._worker is None:
            raise RuntimeError("worker-side call on a scheduler-side KVStoreConnector")
        return self._worker

    def _meta(self) -> KVStoreConnectorMetadata:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVStoreConnectorMetadata):
            raise TypeError(f"expected KVStoreConnectorMetadata, got {type(meta).__name__}")
        return meta

    # -- scheduler side ----------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        """Give the scheduler half the cache manager (block ids of saves)."""
        super().bind_kv_cache_manager(kv_cache_manager)
        self._scheduler_side().bind_kv_cache_manager(kv_cache_manager)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Stored tokens beyond ``num_computed_tokens``; ``None`` while the lookup runs."""
        return self._scheduler_side().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Record what to load into the request's newly allocated blocks."""
        self._scheduler_side().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's load and save plan for the workers."""
        return KVStoreConnectorMetadata.of(
            self._scheduler_side().build_connector_meta(scheduler_output)
        )

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Whether the request's blocks must stay until a save has read them."""
        return self._scheduler_side().request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """:meth:`request_finished` with every group's blocks (the hybrid manager calls this)."""
        return self._scheduler_side().request_finished(request, block_ids)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """A step's output: ends the step's timing and passes the workers' loads on to the
        load-or-recompute decision (kvstore.integrations.vllm.cost)."""
        super().update_connector_output(connector_output)
        stats = connector_output.kv_connector_stats
        data = stats.data if stats is not None else {}
        self._scheduler_side().update_connector_output(
            int(data.get("loaded_tokens", 0)), list(data.get("load_seconds") or ())
        )

    # -- worker side -------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Take the engine's per-layer paged KV caches."""
        self._worker_side().register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Finish reading preempted requests' blocks before they are reused."""
        if isinstance(kv_connector_metadata, KVStoreConnectorMetadata):
            self._worker_side().handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Start fetching this step's chunks."""
        self._worker_side().start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Make ``layer_name``'s loaded blocks ready before its attention runs."""
        self._worker_side().wait_for_layer_load(layer_name)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """Nothing per layer: whole chunks are saved after the step (see ``wait_for_save``).

        A stored chunk holds every layer, so saving starts once the last layer has written it;
        doing it here would only add work to the forward pass.
        """

    def wait_for_save(self) -> None:
        """Queue this step's saves and return at once; background threads do the copying."""
        self._worker_side().wait_for_save(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Finished requests whose blocks no pending save reads any more, and finished loads."""
        return self._worker_side().get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """:meth:`get_finished`, and the requests whose load failed (several KV cache groups:
        vLLM recomputes them; one group reports blocks instead)."""
        results = self._worker_side().get_transfer_results(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=results.finished_sending,
            finished_recving=results.finished_recving,
            failed_recving=results.failed_recving,
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed this step, for vLLM to recompute."""
        return self._worker_side().get_block_ids_with_load_errors()

    # -- figures (see kvstore.integrations.vllm.metrics) ---------------------------------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This half's figures since the last call; vLLM sums the scheduler's and the workers'."""
        side = self._worker if self._worker is not None else self._scheduler
        data = side.take_stats() if side is not None else None
        return KVStoreConnectorStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        """The figures as vLLM's front end receives them (a plain dict)."""
        return KVStoreConnectorStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        """The ``vllm:kvstore_*`` series in vLLM's ``/metrics``."""
        return KVStorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        """Drain queued saves (bounded) and close the store clients."""
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()
