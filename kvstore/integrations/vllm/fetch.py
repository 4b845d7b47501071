"""How a step's chunks reach the connector's load pipeline, on the loader thread.

:class:`ChunkFetcher` picks, per step, the first that applies:

- over shared memory on CPU, a *lease*: the chunks are read in place from the store's arena,
  each layer copied into the cache on the forward's thread (``shm-lease``);
- over shared memory on CUDA, a lease too: each layer is DMAed straight out of the leased
  chunks where this process's mapping of the arena is page-locked for them (``shm-dma``), else
  the chunks are copied into the page-locked host staging first (``shm-staged``, the first
  seconds of an engine, while :mod:`kvstore.client.arena_registration` works);
- over UCX on CUDA, a receive straight into device memory where UCX reaches it (``ucx-device``;
  else ``ucx-pinned``);
- otherwise a get into the page-locked host staging (``grpc``, ``ucx``).

See :mod:`kvstore.integrations.paged.device_pipeline` for what the layers do with each.
"""

from __future__ import annotations

import logging
import time

from kvstore.client.shm import ShmLease
from kvstore.errors import DeadlineExceededError, KVStoreError, StoreUnavailableError
from kvstore.integrations.paged.arena_dma import arena_source
from kvstore.integrations.paged.device_pipeline import LoadPipeline, StepLoad, arena_chunk, in_place
from kvstore.integrations.paged.host_copies import stage_views
from kvstore.integrations.store_client import StoreClient
from kvstore.integrations.vllm.common import Breaker
from kvstore.integrations.vllm.saves import failure_reason

__all__ = ["ChunkFetcher"]

logger = logging.getLogger(__name__)


class ChunkFetcher:
    """The fetch step of one worker's loads (see the module docstring)."""

    def __init__(self, client: StoreClient, breaker: Breaker, pipeline: LoadPipeline) -> None:
        self._client = client
        self._breaker = breaker
        self._pipeline = pipeline
        # Whether UCX receives reach device memory (None: not tried yet; see _fetch_into_device).
        self._device_receives: bool | None = None

    def fetch(self, load: StepLoad, keys: list[bytes]) -> list[bool]:
        """Bring ``keys`` where ``load``'s layers will read them (on the loader thread); which
        chunks came whole. Failures are recorded in ``load.reason`` (and trip the breaker
        where the store is down or slow); they never raise."""
        if self._breaker.is_open():
            load.reason = "store_down"
            return [False] * len(keys)
        started = time.perf_counter()
        try:
            device = self._pipeline.device
            if in_place(device, self._pipeline.caches[0].dtype):
                held = self._client.lease(keys)
                if held is not None:
                    return self._adopt(load, held)
            if device.is_cuda:
                held = self._client.lease(keys)
                if held is not None:
                    return self._adopt_for_dma(load, held)
            if self._receives_into_device():
                return self._fetch_into_device(load, keys)
            return self._client.get_into(keys, list(load.host.unbind(0)))
        except (StoreUnavailableError, DeadlineExceededError) as exc:
            load.reason = failure_reason(exc)
            self._breaker.trip(exc)
        except KVStoreError as exc:
            load.reason = "error"
            logger.warning("kvstore get of %d chunks failed: %s", len(keys), exc)
        finally:
            load.fetch_s = time.perf_counter() - started
        return [False] * len(keys)

    def _receives_into_device(self) -> bool:
        """Whether this step's chunks should go straight into device memory: CUDA caches, a
        store reached over UCX (another host), and no earlier load found that UCX cannot reach
        device memory here (then the pinned staging and per-layer DMAs overlap better)."""
        return (
            self._pipeline.device.is_cuda
            and self._device_receives is not False
            and self._client.data_plane == "ucx"
        )

    def _fetch_into_device(self, load: StepLoad, keys: list[bytes]) -> list[bool]:
        """Receive the chunks into the pipeline's device landing (UCX into device memory, or
        through ``load.host`` and one copy each where it cannot); the layers read them there."""
        landing = self._pipeline.device_landing(len(keys))
        fill = self._client.get_into_device(
            keys, list(landing.unbind(0)), staging=list(load.host.unbind(0))
        )
        load.landed, load.path = landing, fill.path
        direct = fill.path == "ucx-device"
        if direct is not self._device_receives:
            self._device_receives = direct
            if direct:
                logger.info("kvstore loads land in device memory over UCX (ucx-device)")
            else:
                logger.info(
                    "kvstore loads: UCX cannot reach device memory here (%s); using page-locked "
                    "staging and a copy per layer",
                    fill.path,
                )
        return fill.found

    def _adopt(self, load: StepLoad, lease: ShmLease) -> list[bool]:
        """Read the step's chunks in place from the store's arena (CPU over shared memory):
        one copy per block, arena -> cache, layer by layer, instead of a get and a scatter."""
        shape, dtype = self._pipeline.chunk_shape, self._pipeline.caches[0].dtype
        # None: missing, or of another size than a chunk (like get_into, a failed chunk).
        sources = [
            None if view is None else arena_chunk(view, shape, dtype) for view in lease.views
        ]
        load.sources, load.release, load.intact = sources, lease.release, lease.intact
        load.path = "shm-lease"
        return [source is not None for source in sources]

    def _adopt_for_dma(self, load: StepLoad, lease: ShmLease) -> list[bool]:
        """CUDA over shared memory: DMA each layer straight out of the leased chunks where this
        process's mapping of the arena is page-locked for them; else copy them into the
        page-locked host staging now (as a get would) and end the lease."""
        pipeline = self._pipeline
        source = arena_source(
            lease.views, lease.registration, pipeline.chunk_nbytes, len(pipeline.caches)
        )
        if source is not None:
            load.direct, load.release, load.intact = source, lease.release, lease.intact
            load.path = "shm-dma"
            return [address is not None for address in source.addresses]
        try:
            ok = stage_views(lease.views, load.host)
            intact = lease.intact()
        finally:
            lease.release()
        load.path = "shm-staged"
        return [good and whole for good, whole in zip(ok, intact, strict=True)]
