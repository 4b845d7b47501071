"""The worker half of the vLLM connector: moves chunks between the paged KV cache and the store.

Loads (:meth:`WorkerSide.start_load_kv`, :meth:`WorkerSide.wait_for_layer_load`): the step's
chunks are fetched in ONE batched get on a background thread while the forward pass starts; each
layer's blocks are scattered just before that layer's attention runs. A chunk that cannot be
fetched (store down, evicted since the lookup, wrong size) leaves its blocks unwritten and
reported by :meth:`WorkerSide.get_block_ids_with_load_errors`, so vLLM recomputes those tokens.

Saves (:meth:`WorkerSide.wait_for_save`): the step's save plans are queued and the forward pass
goes on. A gather thread copies the planned blocks out of the cache into private chunk buffers,
after which the blocks are no longer needed (requests waiting on that are reported by
:meth:`WorkerSide.get_finished`); a put thread sends the buffers to the store. A slow or dead
store therefore never holds engine blocks, and the put backlog is bounded in bytes.

The block copies go through :mod:`kvstore_kernels` (``gather_blocks`` / ``scatter_blocks``):
whole blocks along the cache's block dimension, never single tokens, because on CPU the order
inside a block belongs to the attention kernel. Only vLLM's CPU cache is accepted so far (see
:meth:`WorkerSide.register_kv_caches` for what CUDA still needs).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

# The kernels live in kernels/ and install as kvstore_kernels through a package-dir mapping that
# mypy's import search does not follow (an editable install's finder hook).
import kvstore_kernels  # type: ignore[import-not-found, unused-ignore]
import torch

from kvstore.client import KVStoreClient
from kvstore.errors import ConfigError, DeadlineExceededError, KVStoreError, StoreUnavailableError
from kvstore.integrations.vllm_common import (
    Breaker,
    ConnectorSettings,
    LoadSpec,
    StepPlan,
    base_namespace,
    blocks_per_chunk,
    engine_shape,
    rank_keys,
    warm_up,
)
from kvstore.integrations.vllm_plan import ScatterPlan, chunk_blocks, kernel_ids, plan_scatter
from kvstore.integrations.vllm_stats import ConnectorCounters

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["WorkerSide"]

logger = logging.getLogger(__name__)

# Gathered chunks waiting for their put may hold at most this much memory; past it new saves are
# dropped (a cache may always forget), so a slow store cannot grow the engine's memory.
_MAX_PUT_BACKLOG_BYTES = 1 << 30
# The load staging buffer is allocated up front for the longest prompt, within this size.
_STAGING_BYTES = 256 << 20
# How long shutdown waits for queued saves to reach the store.
_SHUTDOWN_DRAIN_S = 10.0


def _gather(
    caches: Sequence[torch.Tensor],
    ids: list[int],
    layout: kvstore_kernels.CacheLayout,
    out: torch.Tensor,
) -> None:
    """Copy blocks ``ids`` of every layer into ``out`` ``[layers, len(ids), *block]``."""
    kvstore_kernels.gather_blocks(caches, ids, layout, out=out)


def _scatter(
    buffer: torch.Tensor,
    caches: Sequence[torch.Tensor],
    ids: list[int],
    layout: kvstore_kernels.CacheLayout,
) -> None:
    """Copy ``buffer`` ``[layers, len(ids), *block]`` into blocks ``ids`` of every layer."""
    kvstore_kernels.scatter_blocks(buffer, caches, ids, layout)


@dataclass(slots=True)
class _StepLoad:
    """The loads of one engine step."""

    specs: list[LoadSpec]
    buffer: torch.Tensor  # [chunks, layers, kernel blocks per chunk, *block]
    fetched: Future[list[bool]] = field(default_factory=Future)
    ok: list[bool] | None = None
    scattered: set[int] = field(default_factory=set)
    fetch_s: float = 0.0  # the get itself, on the fetch thread
    waited_s: float = 0.0  # how long the forward pass waited for it
    scatter_s: float = 0.0
    plan: ScatterPlan | None = None  # made on the first scatter, once the fetch has answered
    reason: str = "missing"  # why its failed chunks failed (see vllm_stats.LOAD_FAILURES)


@dataclass(slots=True)
class _SaveJob:
    req_id: str
    keys: list[bytes]
    kernel_ids: list[int]


class WorkerSide:
    """The worker half of :class:`kvstore.integrations.vllm.KVStoreConnector`."""

    def __init__(
        self,
        settings: ConnectorSettings,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        client: KVStoreClient | None = None,
    ) -> None:
        """``client`` replaces the store client the worker would open (tests pass stand-ins)."""
        tp_rank, pp_rank = _ranks(vllm_config)
        shape = engine_shape(vllm_config, kv_cache_config, pp_rank=pp_rank)
        self._settings = settings
        self._blocks_per_chunk = blocks_per_chunk(settings, shape)
        self._num_blocks = int(kv_cache_config.num_blocks)
        self._max_model_len = int(getattr(vllm_config.model_config, "max_model_len", 0) or 0)
        self._layer_names = list(kv_cache_config.kv_cache_groups[0].layer_names)
        self._tp_rank, self._pp_rank = tp_rank, pp_rank
        self._namespace = base_namespace(vllm_config, shape, settings, tp_rank=tp_rank)
        self._client = settings.open_client(self._namespace) if client is None else client
        self._breaker = Breaker(settings.retry_after_s)
        self.counters = ConnectorCounters()
        # Every rank loads and saves the same chunks: only the first reports, or the engine's
        # figures would be multiplied by its number of ranks.
        self._reports = tp_rank == 0 and pp_rank == 0
        self._block_tokens = settings.chunk_size // self._blocks_per_chunk
        # Filled by register_kv_caches.
        self._caches: list[torch.Tensor] = []
        self._layer_index: dict[str, int] = {}
        self._layout = kvstore_kernels.CPU_LAYOUT
        self._ratio = 1  # kernel blocks per engine block
        self._chunk_shape: tuple[int, ...] = ()
        # Loads of the current step.
        # One worker, on purpose: fetches run in order, so when the latest one is done every
        # earlier (late, timed-out) one is too, which is what lets _staging_buffer reuse its buffer.
        self._fetch_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-load")
        self._load: _StepLoad | None = None
        self._load_errors: set[int] = set()
        # The loads' landing buffer, kept across steps: a fresh one would page-fault on every
        # byte the get writes, which costs about as much as the copy itself.
        self._staging: torch.Tensor | None = None
        self._staging_fetch: Future[list[bool]] | None = None
        # Saves.
        self._lock = threading.Condition()
        self._ungathered: defaultdict[str, int] = defaultdict(int)  # req -> jobs not yet gathered
        self._saving: set[str] = set()  # requests that ever had a save planned
        self._finished: set[str] = set()  # ... that vLLM has finished
        self._backlog_bytes = 0
        self._gather_queue: queue.Queue[_SaveJob | None] = queue.Queue()
        self._put_queue: queue.Queue[tuple[list[bytes], torch.Tensor] | None] = queue.Queue()
        self._threads = [
            threading.Thread(target=self._gather_loop, name="kvstore-gather", daemon=True),
            threading.Thread(target=self._put_loop, name="kvstore-put", daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        # Connect now, off the critical path: the first call on a fresh channel pays for it.
        self._fetch_pool.submit(warm_up, self._client, self._breaker, settings.timeout_s)
        logger.info(
            "kvstore connector (worker tp%d pp%d) -> %s, namespace %s",
            tp_rank,
            pp_rank,
            settings.target,
            self._namespace,
        )

    # -- setup -------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Take the per-layer caches, in the order of the engine's KV cache group."""
        caches = [kv_caches[name] for name in self._layer_names if name in kv_caches]
        if len(caches) != len(self._layer_names):
            raise ConfigError(
                f"vLLM registered {len(kv_caches)} KV caches, expected the layers "
                f"{self._layer_names}"
            )
        first = caches[0]
        if first.device.type != "cpu":
            # The kernels handle CUDA caches, but saving from them in the background needs the
            # copies ordered after the forward pass on its stream (CUDA events), and loading
            # needs a pinned staging buffer; neither is written yet, so refuse rather than race.
            raise ConfigError(
                f"KVStoreConnector supports vLLM's CPU KV cache only so far, got {first.device}"
            )
        layout = kvstore_kernels.CPU_LAYOUT
        cache_blocks = layout.num_blocks(first.shape)
        if cache_blocks % self._num_blocks:
            raise ConfigError(
                f"KV cache holds {cache_blocks} blocks, not a multiple of the engine's "
                f"{self._num_blocks}"
            )
        self._caches = caches
        self._layout = layout
        self._layer_index = {name: i for i, name in enumerate(self._layer_names)}
        # Attention kernels may split an engine block into smaller kernel blocks.
        self._ratio = cache_blocks // self._num_blocks
        self._chunk_shape = (
            len(caches),
            self._blocks_per_chunk * self._ratio,
            *layout.block_shape(first.shape),
        )
        # One request of the longest prompt loads without growing the buffer mid-request.
        longest = self._max_model_len // self._settings.chunk_size + 1
        chunks = max(1, min(longest, _STAGING_BYTES // max(1, self._chunk_nbytes())))
        self._staging = torch.zeros((chunks, *self._chunk_shape), dtype=first.dtype)
        logger.info(
            "kvstore connector: %d layers of %s %s, chunk %s (%.2f MiB)",
            len(caches),
            tuple(first.shape),
            first.dtype,
            self._chunk_shape,
            self._chunk_nbytes() / 2**20,
        )

    def _chunk_nbytes(self) -> int:
        return (
            int(torch.Size(self._chunk_shape).numel()) * self._caches[0].element_size()
            if self._caches
            else 0
        )

    def _keys(self, keys: list[bytes]) -> list[bytes]:
        """This rank's names for the scheduler's chunk keys."""
        return rank_keys(keys, self._namespace, self._tp_rank, self._pp_rank)

    def _kernel_ids(self, block_ids: Sequence[int]) -> list[int]:
        return kernel_ids(block_ids, self._ratio)

    # -- loads -------------------------------------------------------------------------------

    def start_load_kv(self, meta: StepPlan) -> None:
        """Start fetching this step's chunks; the forward pass goes on meanwhile."""
        self._load = None
        if not meta.loads:
            return
        if not self._caches:
            self._fail_loads(meta.loads)
            self.counters.record_load(0, {"not_ready": self._load_tokens(meta.loads)}, None)
            return
        keys = self._keys([key for spec in meta.loads for key in spec.keys])
        load = _StepLoad(meta.loads, self._staging_buffer(len(keys)))
        load.fetched = self._fetch_pool.submit(self._fetch, load, keys)
        self._staging_fetch = load.fetched
        self._load = load

    def _staging_buffer(self, chunks: int) -> torch.Tensor:
        """``[chunks, *chunk_shape]`` to land a step's loads in, reused while nothing writes it."""
        staging = self._staging
        busy = self._staging_fetch is not None and not self._staging_fetch.done()
        if busy or staging is None or staging.shape[0] < chunks:
            dtype = self._caches[0].dtype
            # zeros, not empty: touch every page now, once, rather than inside a get.
            fresh = torch.zeros((chunks, *self._chunk_shape), dtype=dtype, device="cpu")
            if busy:  # a late get still owns the kept buffer (it times out on its own)
                return fresh
            self._staging = staging = fresh
        return staging[:chunks]

    def _fetch(self, load: _StepLoad, keys: list[bytes]) -> list[bool]:
        if self._breaker.is_open():
            load.reason = "store_down"
            return [False] * len(keys)
        started = time.perf_counter()
        try:
            return self._client.get_into(keys, list(load.buffer.unbind(0)))
        except (StoreUnavailableError, DeadlineExceededError) as exc:
            load.reason = _failure(exc)
            self._breaker.trip(exc)
        except KVStoreError as exc:
            load.reason = "error"
            logger.warning("kvstore get of %d chunks failed: %s", len(keys), exc)
        finally:
            load.fetch_s = time.perf_counter() - started
        return [False] * len(keys)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Scatter this layer's loaded blocks before its attention reads them."""
        load = self._load
        layer = self._layer_index.get(layer_name)
        if load is None or layer is None or layer in load.scattered:
            return
        ok = self._resolve(load)
        started = time.perf_counter()
        if load.plan is None:
            load.plan = plan_scatter(load.specs, ok, self._blocks_per_chunk, self._ratio)
        plan = load.plan
        cache = [self._caches[layer]]
        if plan.whole:
            # One call for every whole chunk of the step: [1, chunks * blocks, *block].
            src = load.buffer[plan.whole, layer].flatten(0, 1).unsqueeze(0)
            _scatter(src, cache, plan.whole_ids, self._layout)
        for chunk, spec, index in plan.partial:
            self._scatter_chunk(load.buffer[chunk, layer : layer + 1], cache, spec, index)
        load.scattered.add(layer)
        load.scatter_s += time.perf_counter() - started

    def _resolve(self, load: _StepLoad) -> list[bool]:
        """Wait for the fetch (bounded by the get deadline) and record the chunks that failed."""
        if load.ok is None:
            started = time.perf_counter()
            try:
                load.ok = load.fetched.result()
            except Exception:
                logger.exception("kvstore fetch crashed; recomputing its tokens")
                load.ok = [False] * load.buffer.shape[0]
                load.reason = "error"
            load.waited_s = time.perf_counter() - started
            chunk = 0
            for spec in load.specs:
                for index in range(len(spec.keys)):
                    if not load.ok[chunk]:
                        self._load_errors.update(self._targets(spec, index))
                    chunk += 1
            if not all(load.ok):
                logger.warning(
                    "kvstore: %d of %d chunks could not be loaded; vLLM recomputes them",
                    load.ok.count(False),
                    len(load.ok),
                )
        return load.ok

    def _targets(self, spec: LoadSpec, index: int) -> list[int]:
        return [b for b in chunk_blocks(spec.block_ids, index, self._blocks_per_chunk) if b >= 0]

    def _scatter_chunk(
        self, src: torch.Tensor, caches: list[torch.Tensor], spec: LoadSpec, index: int
    ) -> None:
        """Write chunk ``index`` of ``spec`` (``src``: ``[layers, kernel blocks, *block]``)."""
        bpc, ratio = self._blocks_per_chunk, self._ratio
        targets = chunk_blocks(spec.block_ids, index, bpc)
        wanted = [j for j, b in enumerate(targets) if b >= 0]
        if not wanted:
            return
        if len(wanted) == bpc:
            _scatter(src, caches, self._kernel_ids(targets), self._layout)
            return
        # Only part of the chunk is new to the engine: the rest sits in blocks that vLLM's own
        # prefix cache shares with other requests, which must not be written.
        rows = [j * ratio + i for j in wanted for i in range(ratio)]
        ids = self._kernel_ids([targets[j] for j in wanted])
        _scatter(src[:, rows], caches, ids, self._layout)

    def _chunk_tokens(self, spec: LoadSpec, index: int) -> int:
        """Tokens chunk ``index`` of ``spec`` brings the engine (blocks it lacked only)."""
        return len(self._targets(spec, index)) * self._block_tokens

    def _load_tokens(self, specs: list[LoadSpec]) -> int:
        return sum(self._chunk_tokens(s, i) for s in specs for i in range(len(s.keys)))

    def _account(self, load: _StepLoad, skipped: bool) -> None:
        """Count a finished step's loads: tokens loaded, tokens failed and why."""
        if skipped or load.ok is None:
            self.counters.record_load(0, {"layer_skipped": self._load_tokens(load.specs)}, None)
            return
        loaded, failed = 0, 0
        chunk = 0
        for spec in load.specs:
            for index in range(len(spec.keys)):
                tokens = self._chunk_tokens(spec, index)
                if load.ok[chunk]:
                    loaded += tokens
                else:
                    failed += tokens
                chunk += 1
        asked = load.reason != "store_down"
        self.counters.record_load(loaded, {load.reason: failed}, load.fetch_s if asked else None)

    def take_stats(self) -> dict[str, Any] | None:
        """The figures since the last call; ``None`` on all ranks but the first."""
        data = self.counters.take()
        return data if self._reports else None

    def _fail_loads(self, specs: list[LoadSpec]) -> None:
        for spec in specs:
            for index in range(len(spec.keys)):
                self._load_errors.update(self._targets(spec, index))

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (vLLM recomputes their tokens)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- saves -------------------------------------------------------------------------------

    def handle_preemptions(self, meta: StepPlan) -> None:
        """Finish reading the blocks of preempted requests before vLLM reuses them."""
        with self._lock:
            waiting = meta.preempted_req_ids & set(self._ungathered)
            if waiting:
                self._lock.wait_for(
                    lambda: not any(self._ungathered.get(r) for r in waiting),
                    timeout=self._settings.timeout_s,
                )

    def wait_for_save(self, meta: StepPlan) -> None:
        """Queue this step's saves; the gather and put threads do the work."""
        if not self._caches:
            return
        for spec in meta.saves:
            with self._lock:
                self._ungathered[spec.req_id] += 1
                self._saving.add(spec.req_id)
            self._gather_queue.put(
                _SaveJob(spec.req_id, self._keys(spec.keys), self._kernel_ids(spec.block_ids))
            )
        load, self._load = self._load, None
        if load is not None:
            missed = set(range(len(self._caches))) - load.scattered
            if missed:
                # A layer whose attention never asked for its blocks ran without them: make
                # vLLM recompute those tokens rather than trust unwritten blocks.
                logger.warning("kvstore: layers %s were never loaded this step", sorted(missed))
                self._fail_loads(load.specs)
            self._account(load, skipped=bool(missed))
            logger.debug(
                "kvstore load: %d chunks, %.1f MiB, get %.2f ms, waited %.2f ms, scatter %.2f ms",
                len(load.ok or ()),
                load.buffer.nbytes / 2**20,
                load.fetch_s * 1e3,
                load.waited_s * 1e3,
                load.scatter_s * 1e3,
            )

    def _gather_loop(self) -> None:
        while (job := self._gather_queue.get()) is not None:
            buffer: torch.Tensor | None = None
            try:
                nbytes = len(job.keys) * self._chunk_nbytes()
                with self._lock:
                    if self._backlog_bytes + nbytes <= _MAX_PUT_BACKLOG_BYTES:
                        self._backlog_bytes += nbytes
                        buffer = torch.empty(
                            (len(job.keys), *self._chunk_shape), dtype=self._caches[0].dtype
                        )
                if buffer is None:
                    logger.warning("kvstore put backlog full; dropping %d chunks", len(job.keys))
                    self.counters.record_save_failed("backlog_full", self._save_tokens(job.keys))
                else:
                    per_chunk = self._blocks_per_chunk * self._ratio
                    for i in range(len(job.keys)):
                        ids = job.kernel_ids[i * per_chunk : (i + 1) * per_chunk]
                        _gather(self._caches, ids, self._layout, buffer[i])
            except Exception:
                logger.exception("kvstore gather failed; not saving %d chunks", len(job.keys))
                self.counters.record_save_failed("error", self._save_tokens(job.keys))
                buffer = None
            finally:
                with self._lock:
                    self._ungathered[job.req_id] -= 1
                    if not self._ungathered[job.req_id]:
                        del self._ungathered[job.req_id]
                    self._lock.notify_all()
            if buffer is not None:
                self._put_queue.put((job.keys, buffer))

    def _put_loop(self) -> None:
        while (item := self._put_queue.get()) is not None:
            keys, buffer = item
            tokens = self._save_tokens(keys)
            try:
                if self._breaker.is_open():
                    self.counters.record_save_failed("store_down", tokens)
                else:
                    self._client.put(keys, list(buffer.unbind(0)))
                    self.counters.record_save(tokens)
            except (StoreUnavailableError, DeadlineExceededError) as exc:
                self.counters.record_save_failed(_failure(exc), tokens)
                self._breaker.trip(exc)
            except KVStoreError as exc:
                self.counters.record_save_failed("error", tokens)
                logger.warning("kvstore put of %d chunks failed: %s", len(keys), exc)
            except Exception:
                self.counters.record_save_failed("error", tokens)
                logger.exception("kvstore put of %d chunks crashed", len(keys))
            finally:
                with self._lock:
                    self._backlog_bytes -= len(keys) * self._chunk_nbytes()

    def _save_tokens(self, keys: list[bytes]) -> int:
        return len(keys) * self._settings.chunk_size

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, None]:
        """Finished requests whose blocks no save reads any more (vLLM may free them now)."""
        with self._lock:
            self._finished.update(finished_req_ids & self._saving)
            done = {r for r in self._finished if r not in self._ungathered}
            self._finished -= done
            self._saving -= done
        return (done or None), None

    def shutdown(self) -> None:
        """Let queued saves reach the store (bounded), then stop the threads and the client."""
        self._gather_queue.put(None)
        self._threads[0].join(timeout=_SHUTDOWN_DRAIN_S)
        self._put_queue.put(None)
        self._threads[1].join(timeout=_SHUTDOWN_DRAIN_S)
        if any(thread.is_alive() for thread in self._threads):
            logger.warning("kvstore: saves still queued at shutdown were dropped")
        else:
            logger.info("kvstore connector (worker) shut down; all queued saves sent")
        self._fetch_pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()


def _ranks(vllm_config: VllmConfig) -> tuple[int, int]:
    """This worker's tensor- and pipeline-parallel ranks."""
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size == 1 and parallel.pipeline_parallel_size == 1:
        return 0, 0
    # With several ranks a wrong rank would make ranks share keys (silent corruption), so a
    # failure here must stop the engine rather than fall back to 0.
    from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank()), int(get_pp_group().rank_in_group)


def _failure(exc: KVStoreError) -> str:
    """The failure reason (``vllm_stats.LOAD_FAILURES``) of a store call that raised ``exc``."""
    return "deadline" if isinstance(exc, DeadlineExceededError) else "unavailable"
