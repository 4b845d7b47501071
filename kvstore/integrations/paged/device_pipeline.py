"""Block moves between the store and the paged KV cache: one code path for CPU and CUDA.

The device's streams, events and buffers are :mod:`kvstore.integrations.paged.device`'s (no-ops on
CPU, where every copy has finished when its call returns).

**Loads are layer-wise** (:class:`LoadPipeline`). A stored chunk holds every layer of its
``chunk_size`` tokens (``[layers, blocks, *block]``, the format the store has always held), and
the store reads whole values. Over shared memory the worker does not read them at all: it
*leases* the step's chunks (``KVStoreClient.lease``) and works from the store's arena in place.

- **CUDA over shared memory** (``shm-dma``): where the worker's mapping of the arena is
  page-locked (:mod:`kvstore.client.arena_registration`), each layer is ONE strided DMA per run
  of chunks at equal distances in the arena (:mod:`kvstore.integrations.paged.arena_dma`) into the
  layer's device staging, on a DMA stream; the layer's scatter into the paged cache runs on the
  load stream after the layer's DMA event, so layer n+1's DMA runs while layer n scatters and
  the forward computes layer n-1. The lease is held until the step's last DMA has *completed*.
  No host copy at all. Until the pages a step needs are registered (the first seconds of an
  engine), the leased chunks are copied into page-locked host staging (``shm-staged``) and go
  on as below.
- **CUDA from host staging** (gRPC, UCX without device transports, ``shm-staged``): the step's
  chunks are in a page-locked host buffer; each layer's slice of every chunk is DMAed into the
  device staging (one copy per chunk and layer) on the load stream, scattered there, and an
  event recorded for the layer.
- **CUDA over UCX into device memory** (``ucx-device``): the chunks land straight in a device
  buffer (:meth:`LoadPipeline.device_landing`, through
  :meth:`kvstore.KVStoreClient.get_into_device`) and each layer's scatter reads its slice there.
- **CPU**: each layer's slice of each chunk is copied straight into the cache's blocks, one
  slice copy per run of consecutive blocks (:func:`~kvstore.integrations.paged.plan.copy_runs`),
  from the leased arena (or the staging a get filled). The connector's worker copies each layer
  on the forward's own thread when its attention asks for it (``copy_on_wait``: torch's
  parallel ``copy_`` there, chunks at equal distances merged into one strided copy); otherwise
  the loader thread copies through numpy (a torch op there would enter OpenMP, which vLLM's CPU
  worker pins to its own threads; see ``kernels/reference.py``).

:meth:`LoadPipeline.wait_layer` waits only until the layer's work is *issued* and then makes the
compute stream wait on the layer's event (CUDA); on CPU it returns once the layer is copied.
Where no lease is possible (gRPC, UCX) the first layer waits for the whole fetch.

**Saves** are :mod:`kvstore.integrations.vllm.saves`'s.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import kvstore_kernels  # type: ignore[import-not-found, unused-ignore]
import torch

from kvstore.integrations.paged.arena_dma import ArenaSource
from kvstore.integrations.paged.device import Device, Event, Stream
from kvstore.integrations.paged.host_copies import (
    SAME_WIDTH,
    arena_chunk,
    as_torch,
    copy_slices,
    copyable,
    strided_groups,
    width_of,
)
from kvstore.integrations.paged.plan import (
    CopyRun,
    LoadSpec,
    ScatterPlan,
    chunk_blocks,
    copy_runs,
    kernel_ids,
    plan_scatter,
)

__all__ = ["Device", "Event", "LoadPipeline", "StepLoad", "Stream", "arena_chunk", "in_place"]

logger = logging.getLogger(__name__)

#: Bytes of copies per scatter launch on CUDA at least (a whole number of layers): about 0.6 ms
#: of the PCIe link, more than a launch costs its thread (see LoadPipeline._layer_groups).
GROUP_BYTES = 32 << 20


@dataclass(slots=True)
class StepLoad:
    """The loads of one engine step and their progress, shared by the forward and the loader."""

    specs: list[LoadSpec]
    host: torch.Tensor  # [chunks, layers, kernel blocks per chunk, *block], page-locked on CUDA
    ready: list[threading.Event]  # layer issued (CUDA) / scattered (CPU)
    events: list[Event]  # one per layer, recorded on the load stream after its scatter
    # Recorded on the compute stream when the step's load starts: the load stream waits for it
    # before writing the cache, so no scatter overtakes compute work issued on those blocks.
    started: Event = field(default_factory=Event)
    # Held while the loader checks ``cancelled`` and issues a layer: once :meth:`LoadPipeline.stop`
    # has taken it, the loader writes nothing more.
    issuing: threading.Lock = field(default_factory=threading.Lock)
    fetched: threading.Event = field(default_factory=threading.Event)
    ok: list[bool] | None = None
    plan: ScatterPlan | None = None
    runs: list[CopyRun] | None = None  # the plan as slice copies (CPU)
    # CPU over shared memory: each chunk read in place from the store's arena under a lease
    # (``[layers, kernel blocks, *block]`` numpy views, None where it failed) instead of from
    # ``host``; ``release`` ends the lease once the last layer is copied.
    sources: list[Any] | None = None
    # The runs as torch copies on the main thread: (source [n, layers, rows, *block], row,
    # first block, n, count): n chunks at equal distances in memory, landing back to back.
    groups: list[tuple[Any, int, int, int, int]] | None = None
    release: Callable[[], None] | None = None
    intact: Callable[[], list[bool]] | None = None  # asked once every layer is copied
    # CUDA, a store on another host: the chunks received straight into device memory
    # (``[chunks, *chunk_shape]``, :meth:`LoadPipeline.device_landing`), read there by each
    # layer's scatter instead of the host staging; ``path`` is how they came
    # (:class:`kvstore.client.device_fill.DeviceFill`).
    landed: torch.Tensor | None = None
    # CUDA over shared memory: the leased chunks in page-locked arena pages, DMAed from there
    # layer by layer (``dma_events``: one per layer, recorded on the DMA stream).
    direct: ArenaSource | None = None
    dma_events: list[Event] = field(default_factory=list)
    # Set once the loader is done with the step: every copy complete, the lease ended.
    settled: threading.Event = field(default_factory=threading.Event)
    path: str = ""
    crashed: bool = False  # the layer work failed: every chunk of the step is recomputed
    cancelled: bool = False  # the forward gave up waiting: write nothing more
    waited: set[int] = field(default_factory=set)  # layers whose attention asked for them
    fetch_s: float = 0.0  # the get, on the loader thread
    waited_s: float = 0.0  # the forward's waits, all layers together
    scatter_s: float = 0.0  # the loader's copies and scatters, all layers (overlapping the forward)
    reason: str = "missing"  # why its failed chunks failed (an engine's load-failure reasons)
    reported: bool = False  # its failed chunks are in the load errors


class LoadPipeline:
    """Layer-wise loads into one engine's paged caches (see the module docstring)."""

    def __init__(
        self,
        device: Device,
        caches: Sequence[torch.Tensor],
        layout: kvstore_kernels.CacheLayout,
        chunk_shape: tuple[int, ...],
        blocks_per_chunk: int,
        ratio: int,
        *,
        copy_on_wait: bool = False,
    ) -> None:
        """``copy_on_wait`` (CPU only): the loader thread only fetches, and each layer is copied
        on the forward pass's own thread when its attention asks for it (:meth:`wait_layer`),
        with torch's parallel ``copy_`` on the main thread; else the loader copies every layer
        in the background, competing with the forward pass for the cores."""
        self.device = device
        self.copy_on_wait = copy_on_wait and not device.is_cuda
        self.caches = list(caches)
        self.layout = layout
        self.chunk_shape = chunk_shape  # [layers, kernel blocks per chunk, *block]
        self.chunk_nbytes = int(torch.Size(chunk_shape).numel()) * caches[0].element_size()
        self.blocks_per_chunk = blocks_per_chunk
        self.ratio = ratio
        self.stream = device.new_stream()  # scatters (CPU: no-op)
        # DMAs from the arena, apart from the scatters, so that they overlap them.
        self.dma_stream = device.new_stream()
        self._dtype = caches[0].dtype
        # Device staging, one flat buffer kept across steps, viewed per step as [layers, chunks,
        # kernel blocks, *block]: consecutive layers of every chunk are contiguous (one scatter
        # source per group of layers).
        self._device_staging: torch.Tensor | None = None
        # Device landing for receives straight into device memory, made on first use only:
        # [chunks, layers, kernel blocks, *block], a chunk's bytes contiguous as stored.
        self._landing: torch.Tensor | None = None
        # CPU: each layer's cache with the block dimension first, as numpy (a view of the
        # cache's own storage) where the dtype allows.
        self._cpu_blocks: list[Any] = []
        if not device.is_cuda:
            self._cpu_blocks = [copyable(c.movedim(layout.block_dim, 0)) for c in self.caches]

    def new_load(self, specs: list[LoadSpec], host: torch.Tensor) -> StepLoad:
        """A step's load landing in ``host`` (``[chunks, *chunk_shape]``)."""
        layers = len(self.caches)
        load = StepLoad(
            specs,
            host,
            ready=[threading.Event() for _ in range(layers)],
            events=[self.device.new_event() for _ in range(layers)],
            started=self.device.new_event(),
        )
        load.started.record(self.device.current_stream())  # called on the forward's thread
        return load

    def run(self, load: StepLoad, fetch: Callable[[StepLoad], list[bool]]) -> None:
        """Fetch the step's chunks, then issue every layer in order (on the loader thread)."""
        try:
            load.ok = fetch(load)
        except Exception:
            logger.exception("kvstore fetch crashed; recomputing its tokens")
            load.ok = [False] * load.host.shape[0]
            load.reason = "error"
        load.plan = plan_scatter(load.specs, load.ok, self.blocks_per_chunk, self.ratio)
        if not self.device.is_cuda:
            load.runs = copy_runs(load.plan, self.blocks_per_chunk, self.ratio)
        load.fetched.set()
        if self.copy_on_wait:
            # wait_layer copies each layer and the step's end calls finish(); a forward that
            # gave up waiting has ended its step already, so end the lease here.
            if load.cancelled:
                self.finish(load)
            load.settled.set()
            return
        started = time.perf_counter()
        try:
            self.stream.wait(load.started)
            if load.direct is not None and (load.plan.whole or load.plan.partial):
                self._dma_step(load, load.direct)
            with self.stream.use():
                for layers in self._layer_groups(load):
                    with load.issuing:
                        if load.cancelled or load.crashed:
                            break
                        self._issue_layers(load, layers)
                        for layer in layers:
                            load.events[layer].record(self.stream)
                    for layer in layers:
                        load.ready[layer].set()
                # The staging buffers are reused by the next step: its fetch must not overwrite
                # the host buffer while this step's copies may still read it. The load stream
                # waited for every DMA issued, so this also means the arena is read no more.
                self.stream.wait_stream(self.dma_stream)
                issued = self.device.new_event(blocking=True)
                issued.record(self.stream)
            issued.synchronize()
        except Exception:
            logger.exception("kvstore layer-wise load failed; recomputing the step's loads")
            load.crashed = True
            # Copies already issued may still read the staging and write the cache: let them
            # end before the next fetch reuses the buffers and vLLM recomputes those blocks.
            with contextlib.suppress(Exception):
                self.dma_stream.synchronize()
                self.stream.synchronize()
        finally:
            load.scatter_s = time.perf_counter() - started
            for ready in load.ready:  # never leave the forward waiting
                ready.set()
            self.finish(load)  # nothing reads the leased blocks any more
            load.settled.set()

    def stop(self, load: StepLoad) -> None:
        """Let ``load`` write nothing more into the caches: the loader issues no further layer
        (it may be inside one: this waits for it), and on CUDA the compute stream waits for
        what was issued, so vLLM's recompute of those blocks lands after it. Called on the
        forward's thread when the step's loaded tokens are to be recomputed."""
        load.cancelled = True  # before the lock: the loader may take it again at once
        with load.issuing:
            pass  # the layer being issued, if any, is issued now; the loader sees the flag
        self.device.current_stream().wait_stream(self.stream)

    def finish(self, load: StepLoad) -> None:
        """End the step's lease on the store's blocks, if it holds one (idempotent). Called
        once nothing reads them any more: on CUDA, once every DMA out of them has completed."""
        release, load.release = load.release, None
        if release is not None:
            release()
        direct, load.direct = load.direct, None
        if direct is not None:
            direct.registration.leave()

    def _layer_groups(self, load: StepLoad) -> list[range]:
        """The layers issued together, in order: on CUDA, the first layer alone (so that the
        forward starts early), then enough layers per scatter launch that their copies outlast
        the launch's own cost on this thread (about a third of a ms of Python and Triton); on
        CPU one by one."""
        layers = len(self.caches)
        if not self.device.is_cuda:
            return [range(layer, layer + 1) for layer in range(layers)]
        layer_bytes = load.host[:, 0].nbytes  # one layer of every chunk of the step
        size = max(1, -(-GROUP_BYTES // max(1, layer_bytes)))
        starts = [0, *range(1, layers, size)]
        return [
            range(a, min(b, layers)) for a, b in zip(starts, [*starts[1:], layers], strict=True)
        ]

    def _issue_layers(self, load: StepLoad, layers: range) -> None:
        """Write ``layers`` of the step's loaded chunks into their caches (one scatter launch
        per run of whole chunks for all of them; CPU: slice copies layer by layer)."""
        if load.runs is not None:
            for layer in layers:
                self._copy_layer(load, layer)
            return
        plan = load.plan
        if plan is None or (not plan.whole and not plan.partial):
            return
        src = self._stage(load, layers)  # [layers, chunks, kernel blocks, *block]
        caches = self.caches[layers.start : layers.stop]
        per_chunk = src.shape[2]
        at = 0
        # One call per run of consecutive whole chunks (usually one for the step), from a view
        # of the staging: [layers, chunks * blocks, *block], no copy of it on the device.
        for first, count in _consecutive(plan.whole):
            whole = src[:, first : first + count].flatten(1, 2)
            ids = plan.whole_ids[at * per_chunk : (at + count) * per_chunk]
            kvstore_kernels.scatter_blocks(whole, caches, ids, self.layout)
            at += count
        for chunk, spec, index in plan.partial:
            self._scatter_partial(src[:, chunk], caches, spec, index)

    def _copy_layer(self, load: StepLoad, layer: int) -> None:
        """CPU: copy ``layer``'s blocks of every loaded chunk straight into its cache."""
        if not load.runs:
            return
        sources = load.sources if load.sources is not None else copyable(load.host)
        if threading.current_thread() is threading.main_thread():
            # torch's copy_ runs on the intra-op threads: safe (and faster) on the main thread.
            if load.groups is None:
                with warnings.catch_warnings():  # the arena views are read-only; only read
                    warnings.simplefilter("ignore", UserWarning)
                    load.groups = [
                        (as_torch(src), row, block, n, count)
                        for src, row, block, n, count in strided_groups(load.runs, sources)
                    ]
            cache = self.caches[layer].movedim(self.layout.block_dim, 0)
            width = SAME_WIDTH.get(cache.element_size())
            cache = cache if width is None else cache.view(width)
            for src, row, block, n, count in load.groups:
                dst = cache[block : block + n * count].unflatten(0, (n, count))  # type: ignore[no-untyped-call]
                dst.copy_(src[:, layer, row : row + count])
            return
        blocks = self._cpu_blocks[layer]
        for chunk, row, block, count in load.runs:
            copy_slices(blocks[block : block + count], sources[chunk][layer, row : row + count])

    def device_landing(self, chunks: int) -> torch.Tensor:
        """``[chunks, *chunk_shape]`` in device memory for a load to receive into (CUDA only),
        kept across steps: the loader thread's steps run one after another, and each waits for
        its layers' scatters before the next fetch starts."""
        assert self.device.is_cuda, "device landing is for CUDA caches"
        landing = self._landing
        if landing is None or landing.shape[0] < chunks:
            with self.stream.use():  # ordered with the scatters that read it
                landing = self.device.device_buffer((chunks, *self.chunk_shape), self._dtype)
            assert landing is not None
            self._landing = landing
        return landing[:chunks]

    def _stage(self, load: StepLoad, layers: range) -> torch.Tensor:
        """``layers`` of every chunk (``[layers, chunks, kernel blocks, *block]``), where the
        scatter reads them."""
        group = slice(layers.start, layers.stop)
        if load.landed is not None:  # already in device memory, nothing to copy
            return load.landed[:, group].transpose(0, 1)
        if not self.device.is_cuda:
            return load.host[:, group].transpose(0, 1)
        chunks = load.host.shape[0]
        staging = self._staging(chunks)
        if load.direct is not None:
            # The DMA stream runs in order: the group's last layer done means all of it is.
            self.stream.wait(load.dma_events[layers.stop - 1])  # queued by _dma_step
            return staging[group]
        # A chunk's layer slice is contiguous in the host buffer and lands contiguously: a
        # page-locked source makes each copy an asynchronous DMA on the load stream.
        for layer in layers:
            for chunk in range(chunks):
                staging[layer, chunk].copy_(load.host[chunk, layer], non_blocking=True)
        return staging[group]

    def _staging(self, chunks: int) -> torch.Tensor:
        """The device staging of a step of ``chunks``: ``[layers, chunks, kernel blocks,
        *block]``, contiguous (a view of one buffer kept across steps)."""
        shape = (len(self.caches), chunks, *self.chunk_shape[1:])
        size = int(torch.Size(shape).numel())
        staging = self._device_staging
        if staging is None or staging.numel() < size:
            with self.stream.use():  # the caching allocator orders its reuse on the load stream
                staging = self._device_staging = self.device.device_buffer((size,), self._dtype)
        assert staging is not None
        return staging[:size].view(shape)

    def _dma_step(self, load: StepLoad, source: ArenaSource) -> None:
        """Queue every layer's DMA, arena -> device staging, on the DMA stream at once (one
        strided copy per run of chunks and layer), each layer followed by its event: the copy
        engine then streams at the link's speed however fast the layers' scatters are issued,
        and each scatter waits for its own layer only (:meth:`_stage`)."""
        staging = self._staging(load.host.shape[0])
        self.dma_stream.wait_stream(self.stream)  # after any earlier use of the staging
        load.dma_events = [self.device.new_event() for _ in self.caches]
        for layer, event in enumerate(load.dma_events):
            base = staging[layer].data_ptr()
            for copy in source.layer_copies(layer):
                self.device.dma_to_device(copy, base, self.dma_stream)
            event.record(self.dma_stream)

    def _scatter_partial(
        self, src: torch.Tensor, caches: list[torch.Tensor], spec: LoadSpec, index: int
    ) -> None:
        """Write chunk ``index`` of ``spec`` (``src``: ``[layers, kernel blocks, *block]``)."""
        bpc, ratio = self.blocks_per_chunk, self.ratio
        targets = chunk_blocks(spec.block_ids, index, bpc)
        wanted = [j for j, b in enumerate(targets) if b >= 0]
        if not wanted:
            return
        # Only part of the chunk is new to the engine: the rest sits in blocks that vLLM's own
        # prefix cache shares with other requests, which must not be written.
        rows = [j * ratio + i for j in wanted for i in range(ratio)]
        ids = kernel_ids([targets[j] for j in wanted], ratio)
        at = 0
        for first, count in _consecutive(rows):  # views of the source, one call per run
            part = src[:, first : first + count]
            kvstore_kernels.scatter_blocks(part, caches, ids[at : at + count], self.layout)
            at += count

    def wait_layer(self, load: StepLoad, layer: int, timeout: float) -> bool:
        """Make ``layer``'s loaded blocks visible to the forward pass; False if it gave up.

        Blocks this thread until the layer's work is issued (CUDA) or done (CPU), at most
        ``timeout`` seconds; then the compute stream waits for the layer's event on the device.
        """
        started = time.perf_counter()
        if self.copy_on_wait:
            return self._copy_on_wait(load, layer, timeout)
        issued = load.ready[layer].wait(timeout)
        load.waited_s += time.perf_counter() - started
        load.waited.add(layer)
        if not issued:
            load.cancelled = True
            return False
        self.device.current_stream().wait(load.events[layer])
        return True

    def _copy_on_wait(self, load: StepLoad, layer: int, timeout: float) -> bool:
        started = time.perf_counter()
        fetched = load.fetched.wait(timeout)
        load.waited_s += time.perf_counter() - started
        load.waited.add(layer)
        if not fetched:
            load.cancelled = True
            return False
        if not (load.cancelled or load.crashed):
            started = time.perf_counter()
            try:
                self._copy_layer(load, layer)
            except Exception:
                logger.exception("kvstore layer copy failed; recomputing the step's loads")
                load.crashed = True
            load.scatter_s += time.perf_counter() - started
        load.ready[layer].set()
        if len(load.waited) == len(self.caches):
            self.finish(load)
        return True


def _consecutive(values: Sequence[int]) -> list[tuple[int, int]]:
    """Ascending ``values`` as ``(first, count)`` runs of consecutive integers."""
    runs: list[tuple[int, int]] = []
    for value in values:
        if runs and runs[-1][0] + runs[-1][1] == value:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((value, 1))
    return runs


def in_place(device: Device, dtype: torch.dtype) -> bool:
    """Whether loads can read chunks in place from the store's arena (:func:`arena_chunk`):
    on CPU, for a dtype numpy can view as integers of its width (on CUDA the chunks go
    through page-locked staging, the DMA's source)."""
    return not device.is_cuda and width_of(dtype) is not None
