"""The worker half of the vLLM connector: moves chunks between the paged KV cache and the store.

Loads (:meth:`WorkerSide.start_load_kv`, :meth:`WorkerSide.wait_for_layer_load`) are layer-wise
(:mod:`kvstore.integrations.paged.device_pipeline`): the step's chunks are fetched in ONE batched
call on a background thread while the forward pass starts (:mod:`kvstore.integrations.vllm.fetch`:
over shared memory a lease on the chunks in the store's arena, else a get). On CUDA the same thread
then queues every layer's DMA (straight out of the leased chunks where this process's mapping of
the arena is page-locked: :meth:`kvstore.KVStoreClient.register_arena_with`, started here) and
scatters them layer by layer on a load stream, with an event per layer; on CPU each layer is
copied from the arena into the cache on the forward's own thread when its attention asks for it.
Each layer's attention waits for its own layer only. A chunk that cannot
be fetched (store down, evicted since the lookup, wrong size) leaves its blocks unwritten and
reported by :meth:`WorkerSide.get_block_ids_with_load_errors`, so vLLM recomputes those tokens.

Saves (:meth:`WorkerSide.wait_for_save`): the step's save plans are queued with the event that
ends the forward pass and the forward goes on (:mod:`kvstore.integrations.vllm.saves`).

The block copies go through :mod:`kvstore_kernels` (``gather_blocks`` / ``scatter_blocks``):
whole blocks along the cache's block dimension, never single tokens, because the order inside a
block belongs to the attention kernel. Which dimension that is comes from
:mod:`kvstore.integrations.paged.kv_layout`, from the cache's shape and vLLM's attention backend.

Nothing here imports vLLM (its objects are read duck-typed), so tests and the GPU harness drive
this half without it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from kvstore.client.cuda_runtime import CudaRuntimeUnavailable
from kvstore.errors import ConfigError
from kvstore.integrations.paged.device import Device
from kvstore.integrations.paged.device_pipeline import LoadPipeline, StepLoad
from kvstore.integrations.paged.groups import anchor_group
from kvstore.integrations.paged.kv_layout import detect_layout
from kvstore.integrations.paged.plan import chunk_blocks, kernel_ids
from kvstore.integrations.store_client import StoreClient
from kvstore.integrations.vllm.common import (
    Breaker,
    ConnectorSettings,
    LoadSpec,
    StepPlan,
    base_namespace,
    blocks_per_chunk,
    engine_groups,
    engine_shape,
    rank_keys,
    warm_up,
)
from kvstore.integrations.vllm.fetch import ChunkFetcher
from kvstore.integrations.vllm.hybrid import scheme_block_size
from kvstore.integrations.vllm.saves import SaveJob, SaveQueue
from kvstore.integrations.vllm.scheme import open_scheme
from kvstore.integrations.vllm.stats import ConnectorCounters
from kvstore.integrations.vllm.worker_config import _backend_name, _cache_spec, _ranks

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["WorkerSide"]

logger = logging.getLogger(__name__)

# The load staging buffer is allocated up front for the longest prompt, within this size.
_STAGING_BYTES = 256 << 20


class WorkerSide:
    """The worker half of :class:`kvstore.integrations.vllm.KVStoreConnector`."""

    def __init__(
        self,
        settings: ConnectorSettings,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        client: StoreClient | None = None,
        group: int = 0,
    ) -> None:
        """``client`` replaces the store client the worker would open (tests pass stand-ins);
        ``group`` is the KV cache group whose layers this worker moves (see
        :mod:`kvstore.integrations.vllm.workers` for an engine with several)."""
        tp_rank, pp_rank = _ranks(vllm_config)
        groups = engine_groups(kv_cache_config)
        self.group = groups[group]
        shape = engine_shape(vllm_config, kv_cache_config, pp_rank, group)
        self._vllm_config = vllm_config
        self._num_blocks = int(kv_cache_config.num_blocks)
        self._cache_spec = _cache_spec(vllm_config, kv_cache_config, group)
        self._max_model_len = int(getattr(vllm_config.model_config, "max_model_len", 0) or 0)
        self._layer_names = list(kv_cache_config.kv_cache_groups[group].layer_names)
        self._tp_rank, self._pp_rank = tp_rank, pp_rank
        # Every group stores under the engine's one namespace (the scheduler's): the anchor
        # group's shape names it; each group's keys differ (kvstore.integrations.paged.groups).
        anchor = engine_shape(vllm_config, kv_cache_config, pp_rank, anchor_group(groups))
        self._namespace = base_namespace(vllm_config, anchor, settings, tp_rank=tp_rank)
        self._client = settings.open_client(self._namespace) if client is None else client
        self._breaker = Breaker(settings.retry_after_s, reconnected=self._client.when_reconnected)
        # The chunk size is the store's, asked here too (vllm_scheme): a worker starts before
        # its scheduler, and every step plan says the scheduler's, checked against it.
        side = f"worker tp{tp_rank} pp{pp_rank}"
        scheme_shape = dataclasses.replace(shape, block_size=scheme_block_size(groups))
        self.scheme = open_scheme(
            settings, self._client, self._namespace, scheme_shape, self._breaker, side
        )
        self._settings = settings = self.scheme.settings
        self._blocks_per_chunk = blocks_per_chunk(settings, shape)
        self.counters = ConnectorCounters()
        # Every rank loads and saves the same chunks: only the first reports, or the engine's
        # figures would be multiplied by its number of ranks.
        self._reports = tp_rank == 0 and pp_rank == 0
        self._block_tokens = settings.chunk_size // self._blocks_per_chunk
        # Filled by register_kv_caches.
        self._caches: list[torch.Tensor] = []
        self._layer_index: dict[str, int] = {}
        self._device = Device(torch.device("cpu"))
        self._pipeline: LoadPipeline | None = None
        self._ratio = 1  # kernel blocks per engine block
        self._chunk_shape: tuple[int, ...] = ()
        self.layout_name = ""  # the detected cache layout, e.g. "kv_first/HND"
        #: How the last step's chunks arrived: "shm-lease", "ucx-device", "ucx-pinned", or the
        #: client's data plane for a get into host staging ("" before any load).
        self.last_load_path = ""
        # Loads of the current step.
        # One worker, on purpose: loads run in order, so when the latest one is done every
        # earlier (late, timed-out) one is too, which is what lets _staging_buffer reuse its buffer.
        self._fetch_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-load")
        self._load: StepLoad | None = None
        self._load_errors: set[int] = set()
        self._failed_requests: set[str] = set()  # requests with a chunk that failed to load
        # Requests with saves from a sliding or local group: vLLM frees such blocks while the
        # request runs, so their gathers end before the next step's forward can write them.
        self._windowed_saves: set[str] = set()
        # The loads' landing buffer, kept across steps: a fresh one would page-fault on every
        # byte the get writes, which costs about as much as the copy itself (and on CUDA,
        # page-locking is slower still).
        self._staging: torch.Tensor | None = None
        self._staging_user: Future[None] | None = None
        self._fetcher: ChunkFetcher | None = None  # made by register_kv_caches
        self._saves = SaveQueue(self._client, self._breaker, self.counters, settings.chunk_size)
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

    def register_kv_caches(
        self, kv_caches: dict[str, torch.Tensor], backend: str | None = None
    ) -> None:
        """Take the per-layer caches, in the order of the engine's KV cache group.

        ``backend`` is the attention backend's name (``get_name()``); by default it is read
        from vLLM's attention layers. Only the earlier-vLLM 5-D and 3-D layouts need it.

        Raises:
            ConfigError: for missing layers or a layout :mod:`~.kv_layout` does not know.
        """
        caches = [kv_caches[name] for name in self._layer_names if name in kv_caches]
        if len(caches) != len(self._layer_names):
            raise ConfigError(
                f"vLLM registered {len(kv_caches)} KV caches, expected the layers "
                f"{self._layer_names}"
            )
        first = caches[0]
        if backend is None:
            backend = _backend_name(self._vllm_config, self._layer_names[0])
        layout = detect_layout(first.shape, first.stride(), self._cache_spec, backend)
        for name, cache in zip(self._layer_names, caches, strict=True):
            if cache.shape != first.shape or cache.stride() != first.stride():
                raise ConfigError(
                    f"KV cache of layer {name} is {tuple(cache.shape)} strides {cache.stride()}, "
                    f"unlike the first layer's {tuple(first.shape)} strides {first.stride()}"
                )
        self._caches = caches
        self._layer_index = {name: i for i, name in enumerate(self._layer_names)}
        self._ratio = layout.ratio
        self.layout_name = layout.name
        self._chunk_shape = (
            len(caches),
            self._blocks_per_chunk * self._ratio,
            *layout.kernel.block_shape(first.shape),
        )
        self._device = Device(first.device)
        if self._device.is_cuda:
            self._register_arena()
        self._pipeline = LoadPipeline(
            self._device,
            caches,
            layout.kernel,
            self._chunk_shape,
            self._blocks_per_chunk,
            self._ratio,
            # CPU: copy each layer on the forward's thread when it is asked for. A loader
            # thread copying in the background competes with the forward pass for the same
            # cores and, single-threaded off the main thread (see device_pipeline), took about
            # twice as long as the forward's own parallel copy_ (bench_ttft, 8K: 13-14 ms vs 6).
            copy_on_wait=True,
        )
        self._fetcher = ChunkFetcher(self._client, self._breaker, self._pipeline)
        self._saves.set_target(self._device, caches, layout.kernel, self._chunk_shape)
        # One request of the longest prompt loads without growing the buffer mid-request.
        longest = self._max_model_len // self._settings.chunk_size + 1
        chunks = max(1, min(longest, _STAGING_BYTES // max(1, self._chunk_nbytes())))
        self._staging = self._device.host_buffer((chunks, *self._chunk_shape), first.dtype)
        self._staging_user = None
        logger.info(
            "kvstore connector: %d layers of %s %s on %s, layout %s (backend %s), chunk %s "
            "(%.2f MiB)",
            len(caches),
            tuple(first.shape),
            first.dtype,
            first.device,
            layout.name,
            backend,
            self._chunk_shape,
            self._chunk_nbytes() / 2**20,
        )

    def _register_arena(self) -> None:
        """Start page-locking this process's mapping of the store's arena (in the background),
        so that loads and saves over shared memory DMA straight from and into it."""
        try:
            self._client.register_arena_with(self._device.host_registrar())
        except CudaRuntimeUnavailable as exc:
            logger.warning("kvstore: loads and saves go through host staging: %s", exc)

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
        self.scheme.plan_agrees(meta.chunk_size)  # if not, the breaker is held: loads fail
        pipeline = self._pipeline
        if pipeline is None:
            self._fail_loads(meta.loads)
            self.counters.record_load(0, {"not_ready": self._load_tokens(meta.loads)}, None)
            return
        keys = self._keys([key for spec in meta.loads for key in spec.keys])
        load = pipeline.new_load(meta.loads, self._staging_buffer(len(keys)))
        assert self._fetcher is not None  # made with the pipeline
        fetch = functools.partial(self._fetcher.fetch, keys=keys)
        self._staging_user = self._fetch_pool.submit(pipeline.run, load, fetch)
        self._load = load

    def _staging_buffer(self, chunks: int) -> torch.Tensor:
        """``[chunks, *chunk_shape]`` to land a step's loads in, reused while nothing uses it."""
        staging = self._staging
        busy = self._staging_user is not None and not self._staging_user.done()
        if busy or staging is None or staging.shape[0] < chunks:
            shape = (chunks, *self._chunk_shape)
            fresh = self._device.host_buffer(shape, self._caches[0].dtype)
            if busy:  # a late load still owns the kept buffer (it times out on its own)
                return fresh
            self._staging = staging = fresh
        return staging[:chunks]

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Make this layer's loaded blocks ready before its attention reads them."""
        load, pipeline = self._load, self._pipeline
        layer = self._layer_index.get(layer_name)
        if load is None or pipeline is None or layer is None or layer in load.waited:
            return
        # A load waits at most for the get deadline of its own fetch and of one late fetch
        # before it on the loader thread, plus the copies.
        if not pipeline.wait_layer(load, layer, 2 * self._settings.timeout_s + 1.0):
            logger.warning("kvstore: layer %s was not loaded in time; recomputing", layer_name)
        self._resolve(load)

    def _resolve(self, load: StepLoad) -> None:
        """Once the fetch has answered, record the chunks that failed (once per step)."""
        if load.ok is None or load.reported:
            return
        load.reported = True
        chunk = 0
        for spec in load.specs:
            for index in range(len(spec.keys)):
                if not load.ok[chunk]:
                    self._load_errors.update(self._targets(spec, index))
                    self._failed_requests.add(spec.req_id)
                chunk += 1
        if not all(load.ok):
            logger.warning(
                "kvstore: %d of %d chunks could not be loaded; vLLM recomputes them",
                load.ok.count(False),
                len(load.ok),
            )

    def _chunk_bytes_loaded(self, spec: LoadSpec, index: int) -> int:
        per_block = self._chunk_nbytes() // max(1, self._blocks_per_chunk)
        return len(self._targets(spec, index)) * per_block

    def _targets(self, spec: LoadSpec, index: int) -> list[int]:
        return [b for b in chunk_blocks(spec.block_ids, index, self._blocks_per_chunk) if b >= 0]

    def _chunk_tokens(self, spec: LoadSpec, index: int) -> int:
        """Tokens chunk ``index`` of ``spec`` brings the engine (blocks it lacked only)."""
        return len(self._targets(spec, index)) * self._block_tokens

    def _spec_tokens(self, spec: LoadSpec) -> int:
        """The prompt tokens ``spec`` brings its request (see ``LoadSpec.tokens``)."""
        if spec.tokens >= 0:
            return spec.tokens
        return sum(self._chunk_tokens(spec, i) for i in range(len(spec.keys)))

    def _load_tokens(self, specs: list[LoadSpec]) -> int:
        return sum(self._spec_tokens(s) for s in specs)

    def _account(self, load: StepLoad, skipped: str | None) -> None:
        """Count a finished step's loads: tokens loaded, tokens failed and why."""
        if skipped is not None or load.ok is None:
            self.counters.record_load(0, {skipped or "error": self._load_tokens(load.specs)}, None)
            return
        loaded, failed, nbytes = 0, 0, 0
        chunk = 0
        for spec in load.specs:
            spec_loaded, spec_failed, whole = 0, 0, True
            for index in range(len(spec.keys)):
                tokens = self._chunk_tokens(spec, index)
                if load.ok[chunk]:
                    spec_loaded += tokens
                    nbytes += self._chunk_bytes_loaded(spec, index)
                else:
                    spec_failed += tokens
                    whole = False
                chunk += 1
            if spec.tokens >= 0:  # the request's tokens, not the blocks a window wrote
                spec_loaded, spec_failed = (spec.tokens, 0) if whole else (0, spec.tokens)
            loaded += spec_loaded
            failed += spec_failed
        asked = load.reason != "store_down"
        path = load.path or self._client.data_plane
        seconds = load.fetch_s if asked else None
        self.counters.record_load(loaded, {load.reason: failed}, seconds, path)
        self.counters.record_group_bytes(self.group.label, nbytes)

    def _end_load(self) -> None:
        """Close the step's load: anything the forward may have read unwritten is recomputed."""
        load, self._load = self._load, None
        if load is None:
            return
        if self._pipeline is not None and self._pipeline.copy_on_wait:
            self._pipeline.finish(load)  # layers never asked for: end the lease all the same
        if load.path == "shm-dma" and not load.settled.wait(2 * self._settings.timeout_s + 1):
            # DMAs not complete: whether the chunks stayed intact while read is unknown yet.
            logger.warning("kvstore: the step's DMAs did not complete in time; recomputing")
            load.ok = [False] * len(load.ok or ())
            load.reason, load.reported = "deadline", False
            self._resolve(load)
        self._check_intact(load)
        missed = set(range(len(self._caches))) - load.waited
        skipped: str | None = None
        if missed:
            # A layer whose attention never asked for its blocks ran without them: make
            # vLLM recompute those tokens rather than trust unwritten blocks.
            logger.warning("kvstore: layers %s were never loaded this step", sorted(missed))
            skipped = "layer_skipped"
        elif load.cancelled:
            skipped = "deadline"
        elif load.crashed:
            skipped = "error"
        if skipped is not None:
            if self._pipeline is not None:
                self._pipeline.stop(load)  # the loader writes nothing more into the caches
            self._fail_loads(load.specs)
        self._account(load, skipped)
        self.last_load_path = load.path or self._client.data_plane
        logger.debug(
            "kvstore load: %d chunks, %.1f MiB, get %.2f ms via %s, waited %.2f ms, "
            "scatter %.2f ms",
            len(load.ok or ()),
            load.host.nbytes / 2**20,
            load.fetch_s * 1e3,
            self.last_load_path,
            load.waited_s * 1e3,
            load.scatter_s * 1e3,
        )

    def _check_intact(self, load: StepLoad) -> None:
        """Chunks read in place through the published index, without a lease: any the store
        retired while they were copied may be torn, so vLLM recomputes their tokens."""
        if load.intact is None or load.ok is None:
            return
        torn = [c for c, good in enumerate(load.intact()) if load.ok[c] and not good]
        if torn:
            for chunk in torn:
                load.ok[chunk] = False
            load.reason, load.reported = "missing", False
            self._resolve(load)

    def take_stats(self) -> dict[str, Any] | None:
        """The figures since the last call; ``None`` on all ranks but the first."""
        data = self.counters.take()
        return data if self._reports else None

    def _fail_loads(self, specs: list[LoadSpec]) -> None:
        for spec in specs:
            self._failed_requests.add(spec.req_id)
            for index in range(len(spec.keys)):
                self._load_errors.update(self._targets(spec, index))

    def take_failed_requests(self) -> set[str]:
        """Requests with a chunk that failed to load since the last call (the form vLLM takes
        load failures in for an engine with several KV cache groups)."""
        failed, self._failed_requests = self._failed_requests, set()
        return failed

    @property
    def client(self) -> StoreClient:
        """The store client (the other groups' workers share it)."""
        return self._client

    @property
    def layer_names(self) -> list[str]:
        """The layers this worker moves, in the engine's order."""
        return list(self._layer_names)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (vLLM recomputes their tokens)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- saves -------------------------------------------------------------------------------

    def handle_preemptions(self, meta: StepPlan) -> None:
        """Finish reading the blocks of preempted requests before vLLM reuses them."""
        windowed, self._windowed_saves = self._windowed_saves, set()
        self._saves.wait_gathered(meta.preempted_req_ids | windowed, self._settings.timeout_s)

    def wait_for_save(self, meta: StepPlan) -> None:
        """Queue this step's saves behind the forward pass's event; return at once."""
        if not self._caches:
            return
        self.scheme.plan_agrees(meta.chunk_size)  # if not, the breaker is held: saves dropped
        if meta.saves:
            forward_done = self._device.new_event()
            forward_done.record(self._device.current_stream())
            for spec in meta.saves:
                ids = self._kernel_ids(spec.block_ids)
                self._saves.submit(
                    SaveJob(spec.req_id, self._keys(spec.keys), ids, forward_done, spec.retention)
                )
                if self.group.kind != "full":
                    self._windowed_saves.add(spec.req_id)
        self._end_load()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, None]:
        """Finished requests whose blocks no save reads any more (vLLM may free them now)."""
        done = self._saves.finished(finished_req_ids)
        return (done or None), None

    def shutdown(self, close_client: bool = True) -> None:
        """Let queued saves reach the store (bounded), then stop the threads and (unless
        another group's worker still uses it) the client."""
        if self._saves.shutdown():
            logger.info("kvstore connector (worker) shut down; all queued saves sent")
        else:
            logger.warning("kvstore: saves still queued at shutdown were dropped")
        self._fetch_pool.shutdown(wait=False, cancel_futures=True)
        if close_client:
            self._client.close()
