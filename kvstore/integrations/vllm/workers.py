"""The worker half for every KV cache group: one :class:`~.worker.WorkerSide` per group.

vLLM's hybrid KV cache manager gives each group of layers its own block table, so a chunk is
stored per group (:mod:`kvstore.integrations.paged.groups`) and each group's layers are moved by
a :class:`~.worker.WorkerSide` of their own, all sharing one store client. An engine with one
group has one of them and behaves as before; so does the code: :class:`GroupWorkers` is the only
worker half the connector has.

Loads differ in one respect with several groups: vLLM takes a failed load as a set of block ids
only for one group (ids are per group, so a flat set cannot name a request), and otherwise as a
failed *request* of an asynchronous load. The scheduler half therefore answers hybrid engines'
hits as asynchronous loads; :meth:`GroupWorkers.start_load_kv`, which vLLM calls after the
step's forward for those, moves every group's chunks at once, and
:meth:`GroupWorkers.get_transfer_results` reports the requests done (and those that failed: vLLM
recomputes them). An engine with a group kvstore does not store has no group workers at all.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from kvstore.integrations.paged.groups import anchor_group
from kvstore.integrations.store_client import StoreClient
from kvstore.integrations.vllm import stats as vllm_stats
from kvstore.integrations.vllm.common import ConnectorSettings, StepPlan, engine_groups
from kvstore.integrations.vllm.worker import WorkerSide
from kvstore.integrations.vllm.worker_config import sink_split_warning

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["GroupWorkers", "TransferResults"]

logger = logging.getLogger(__name__)

# What a group other than the anchor adds to the engine's figures (the rest counts prompt
# tokens, which the anchor's loads and saves already count).
_PER_GROUP = ("loaded_bytes_by_group", "load_failed_tokens", "save_failed_tokens")


class TransferResults:
    """What :meth:`GroupWorkers.get_transfer_results` reports (vLLM's
    ``KVConnectorTransferResults`` fields, without vLLM)."""

    def __init__(self, sending: set[str], recving: set[str], failed: set[str]) -> None:
        self.finished_sending = sending
        self.finished_recving = recving
        self.failed_recving = failed


class GroupWorkers:
    """One worker half per KV cache group kvstore stores."""

    def __init__(
        self,
        settings: ConnectorSettings,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        client: StoreClient | None = None,
    ) -> None:
        """``client`` replaces the store client the groups would share (tests pass stand-ins)."""
        groups = engine_groups(kv_cache_config)
        self._vllm_config = vllm_config
        self.hybrid = len(groups) > 1
        self.workers: list[WorkerSide] = []
        self._by_layer: dict[str, WorkerSide] = {}
        self._saving: dict[str, set[int]] = defaultdict(set)  # request -> groups still saving
        self._loaded: set[str] = set()  # asynchronous loads done since the last report
        if not all(g.supported for g in groups):
            logger.info("kvstore connector (worker): no KV cache group is moved for this model")
            return
        for group in groups:
            worker = WorkerSide(settings, vllm_config, kv_cache_config, client, group.index)
            client = worker.client  # one client for every group
            self.workers.append(worker)
        self._by_layer = {name: w for w in self.workers for name in w.layer_names}
        self._anchor = anchor_group(groups)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Give each group its own layers' caches."""
        if len(self.workers) == 1:  # one group: the hybrid manager may be off
            warning = sink_split_warning(self._vllm_config, self.workers[0].layer_names)
            if warning:
                logger.warning(warning)
        for worker in self.workers:
            worker.register_kv_caches(
                {name: kv_caches[name] for name in worker.layer_names if name in kv_caches}
            )

    def _parts(self, meta: StepPlan) -> list[tuple[WorkerSide, StepPlan]]:
        """``meta`` split by group: each worker's loads and saves."""
        return [
            (
                worker,
                StepPlan(
                    loads=[s for s in meta.loads if s.group == worker.group.index],
                    saves=[s for s in meta.saves if s.group == worker.group.index],
                    preempted_req_ids=meta.preempted_req_ids,
                    chunk_size=meta.chunk_size,
                ),
            )
            for worker in self.workers
        ]

    def handle_preemptions(self, meta: StepPlan) -> None:
        """Finish reading preempted requests' blocks (and windows' blocks vLLM may free)."""
        for worker, part in self._parts(meta):
            worker.handle_preemptions(part)

    def start_load_kv(self, meta: StepPlan) -> None:
        """Start this step's loads (hybrid engines: do them, every layer of every group)."""
        for worker, part in self._parts(meta):
            worker.start_load_kv(part)
            if self.hybrid and part.loads:
                for name in worker.layer_names:
                    worker.wait_for_layer_load(name)
        if self.hybrid:
            self._loaded.update(spec.req_id for spec in meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Make ``layer_name``'s loaded blocks ready before its attention reads them."""
        worker = self._by_layer.get(layer_name) if self.workers else None
        if worker is not None:
            worker.wait_for_layer_load(layer_name)

    def wait_for_save(self, meta: StepPlan) -> None:
        """Queue this step's saves (and close the step's loads), group by group."""
        for worker, part in self._parts(meta):
            for spec in part.saves:
                self._saving[spec.req_id].add(worker.group.index)
            worker.wait_for_save(part)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Finished requests whose blocks no group's save reads any more, and (hybrid) the
        requests whose asynchronous loads are done."""
        for worker in self.workers:
            done, _ = worker.get_finished(finished_req_ids)
            for req_id in done or ():
                self._saving.get(req_id, set()).discard(worker.group.index)
        sent = {r for r, left in self._saving.items() if not left}
        for req_id in sent:
            del self._saving[req_id]
        received, self._loaded = self._loaded, set()
        return (sent or None), (received or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> TransferResults:
        """:meth:`get_finished`, with the requests whose load failed (hybrid engines)."""
        sent, received = self.get_finished(finished_req_ids)
        failed: set[str] = set()
        for worker in self.workers:
            failed |= worker.take_failed_requests()
        return TransferResults(
            set(sent or ()), set(received or ()), failed if self.hybrid else set()
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed (one group only: hybrid engines report requests)."""
        errors: set[int] = set()
        for worker in self.workers:
            errors |= worker.get_block_ids_with_load_errors()
        return set() if self.hybrid else errors

    def take_stats(self) -> dict[str, Any] | None:
        """Every group's figures since the last call, summed (``None``: none, or not rank 0:
        each worker reports on the first rank only).

        Prompt tokens are counted once: loaded and saved tokens (and the load's latency and
        path) are the anchor group's, the group whose keys are the plain chunk keys (full
        attention where the model has it); the other groups add their loaded bytes
        (``loaded_bytes_by_group``) and their failures.
        """
        data: dict[str, Any] | None = None
        for worker in self.workers:
            part = worker.take_stats()
            if not part:
                continue
            if worker.group.index != self._anchor:
                part = {name: part[name] for name in _PER_GROUP if name in part}
            data = vllm_stats.merge(data or vllm_stats.empty(), part)
        return data

    def shutdown(self) -> None:
        """Drain every group's saves (bounded) and close the client."""
        for at, worker in enumerate(self.workers):
            worker.shutdown(close_client=at == len(self.workers) - 1)
