"""Block moves between the store and the paged KV cache: one code path for CPU and CUDA.

:class:`Device` hides the difference: on CUDA a :class:`Stream` is a ``torch.cuda.Stream``, an
:class:`Event` a ``torch.cuda.Event`` and host buffers are page-locked (so a host-to-device copy
is a DMA the copy engine runs while the SMs compute); on CPU the stream and the event are
stand-ins that do nothing, because there every copy has finished when the call returns.

**Loads are layer-wise** (:class:`LoadPipeline`). A stored chunk holds every layer of its
``chunk_size`` tokens (``[layers, blocks, *block]``, the format the store has always held), and
the store reads whole values, so a load cannot fetch "layer n of every chunk" without reading the
chunks anyway. The pipeline therefore fetches the step's chunks ONCE -- ``get_into`` straight
into a host staging buffer that is page-locked on CUDA (over shared memory the store copies each
block once, from its arena into that buffer; nothing pageable in between) -- and then works
layer by layer on a background thread: on CUDA, the layer's slice of every chunk is copied into a
device staging buffer on a dedicated load stream (one contiguous DMA per chunk and layer, the
layer's device staging being contiguous), scattered into the layer's paged cache by the kernels
on the same stream, and an event is recorded for the layer; on CPU the layer's slice of each chunk
is copied straight into the cache's blocks, one slice copy per run of consecutive blocks
(:func:`~kvstore.integrations.vllm_plan.copy_runs`; usually one per chunk), through numpy: no
gathered intermediate, and no torch op on the loader thread (a torch ``copy_`` or advanced index
there enters OpenMP, which vLLM's CPU worker pins to its own threads; see ``kernels/reference.py``).
Over shared memory on CPU the source is the store's arena itself: the worker leases the chunks
(``KVStoreClient.lease``) instead of a get, so each block is copied ONCE, arena -> cache, layer by
layer, and layer 0 waits for the lease and its own copy, not for the whole step's get. The
connector's worker goes further (``copy_on_wait``): the loader only takes the lease, and each
layer is copied on the forward pass's own thread when its attention asks for it, with torch's
parallel ``copy_`` there and chunks at equal distances in memory merged into one strided copy.
:meth:`LoadPipeline.wait_layer` waits only until the layer's work is
*issued* and then makes the compute stream wait on the layer's event (CUDA), so layer n+1's copy
and scatter overlap layer n's attention; on CPU it returns once the layer is scattered, while the
next layers proceed on the background thread during the forward pass of the earlier ones.
A CUDA worker whose store is on another host receives over UCX: where UCX reaches device memory
in the process (``cuda_copy``, ``cuda_ipc``, GPUDirect RDMA) the chunks land straight in a
device buffer (:meth:`LoadPipeline.device_landing`, through
:meth:`kvstore.KVStoreClient.get_into_device`) and each layer's scatter reads its slice there,
with no host copy and no DMA; otherwise they land in the page-locked staging as above.
Keeping the stored format means nothing changes for stored data or other clients; the price is
that, where no lease is possible (CUDA, gRPC, UCX), the first layer waits for the whole fetch.

**Saves** (:meth:`Device.gather_to_host`): after the forward pass an event is recorded on the
compute stream; the save thread makes a side stream wait for it, gathers the planned blocks on
the device and copies them into a page-locked host buffer, then waits for that copy only (never
for the forward pass of the next step). The engine's blocks are free once that copy is done.
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

from kvstore.integrations.host_copies import (
    SAME_WIDTH,
    arena_chunk,
    as_torch,
    copy_slices,
    copyable,
    strided_groups,
    width_of,
)
from kvstore.integrations.vllm_common import LoadSpec
from kvstore.integrations.vllm_plan import (
    CopyRun,
    ScatterPlan,
    chunk_blocks,
    copy_runs,
    kernel_ids,
    plan_scatter,
)

__all__ = ["Device", "Event", "LoadPipeline", "StepLoad", "Stream", "arena_chunk", "in_place"]

logger = logging.getLogger(__name__)


class Event:
    """A point in a stream's work: ``torch.cuda.Event`` on CUDA, a no-op on CPU."""

    def __init__(self, raw: Any = None) -> None:
        self.raw = raw

    def record(self, stream: Stream) -> None:
        """Mark the end of the work issued so far on ``stream``."""
        if self.raw is not None:
            self.raw.record(stream.raw)

    def synchronize(self) -> None:
        """Block this thread until the recorded work has finished."""
        if self.raw is not None:
            self.raw.synchronize()


class Stream:
    """An ordered queue of device work: ``torch.cuda.Stream`` on CUDA, a no-op on CPU."""

    def __init__(self, raw: Any = None) -> None:
        self.raw = raw

    def wait(self, event: Event) -> None:
        """Make later work on this stream wait for ``event`` (without blocking this thread)."""
        if self.raw is not None and event.raw is not None:
            self.raw.wait_event(event.raw)

    def wait_stream(self, other: Stream) -> None:
        """Make later work on this stream wait for all work issued on ``other`` so far."""
        if self.raw is not None and other.raw is not None:
            self.raw.wait_stream(other.raw)

    def synchronize(self) -> None:
        """Block this thread until the work issued on this stream has finished."""
        if self.raw is not None:
            self.raw.synchronize()

    def use(self) -> contextlib.AbstractContextManager[Any]:
        """Issue the work of a ``with`` block on this stream."""
        if self.raw is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.raw)


class Device:
    """Streams, events and staging buffers for the device the KV caches live on."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"

    def current_stream(self) -> Stream:
        """The stream the calling thread issues work on (vLLM's compute stream in the forward)."""
        return Stream(torch.cuda.current_stream(self.device) if self.is_cuda else None)

    def new_stream(self) -> Stream:
        """A stream of its own (loads, saves)."""
        # torch.cuda.Stream and Event are untyped classes.
        return Stream(torch.cuda.Stream(self.device) if self.is_cuda else None)  # type: ignore[no-untyped-call]

    def new_event(self, *, blocking: bool = False) -> Event:
        """An event to record on a stream; ``blocking``: a thread that synchronizes on it sleeps
        instead of spinning a core (for events the host waits on, not only streams)."""
        if not self.is_cuda:
            return Event(None)
        return Event(torch.cuda.Event(blocking=blocking))  # type: ignore[no-untyped-call]

    def host_buffer(
        self, shape: Sequence[int], dtype: torch.dtype, *, zero: bool = True
    ) -> torch.Tensor:
        """A host buffer, page-locked on CUDA; ``zero`` touches every page now, once, rather
        than inside the store's copy into it (a load's staging buffer is kept across steps)."""
        make = torch.zeros if zero else torch.empty
        return make(tuple(shape), dtype=dtype, pin_memory=self.is_cuda)

    def device_buffer(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor | None:
        """A staging buffer on the device; ``None`` on CPU, where the host buffer serves."""
        return torch.empty(tuple(shape), dtype=dtype, device=self.device) if self.is_cuda else None

    def gather_to_host(
        self,
        caches: Sequence[torch.Tensor],
        ids: Sequence[int],
        layout: kvstore_kernels.CacheLayout,
        out: torch.Tensor,
    ) -> None:
        """Gather blocks ``ids`` of every layer into host buffer ``out`` (``[layers, ids, ...]``).

        On CUDA the gather runs on the current stream into device memory and the result is
        copied into ``out`` without waiting: record an event and synchronize it before reading.
        """
        if not self.is_cuda:
            kvstore_kernels.gather_blocks(caches, ids, layout, out=out)
            return
        gathered = kvstore_kernels.gather_blocks(caches, ids, layout)
        out.copy_(gathered, non_blocking=True)


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
    path: str = ""
    crashed: bool = False  # the layer work failed: every chunk of the step is recomputed
    cancelled: bool = False  # the forward gave up waiting: write nothing more
    waited: set[int] = field(default_factory=set)  # layers whose attention asked for them
    fetch_s: float = 0.0  # the get, on the loader thread
    waited_s: float = 0.0  # the forward's waits, all layers together
    scatter_s: float = 0.0  # the loader's copies and scatters, all layers (overlapping the forward)
    reason: str = "missing"  # why its failed chunks failed (see vllm_stats.LOAD_FAILURES)
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
        self.blocks_per_chunk = blocks_per_chunk
        self.ratio = ratio
        self.stream = device.new_stream()
        self._dtype = caches[0].dtype
        # Device staging, kept across steps: [layers, chunks, kernel blocks, *block], so one
        # layer's blocks of every chunk are contiguous (one scatter source per layer).
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
            return
        started = time.perf_counter()
        try:
            self.stream.wait(load.started)
            with self.stream.use():
                for layer in range(len(self.caches)):
                    with load.issuing:
                        if load.cancelled or load.crashed:
                            break
                        self._issue_layer(load, layer)
                        load.events[layer].record(self.stream)
                    load.ready[layer].set()
                # The staging buffers are reused by the next step: its fetch must not overwrite
                # the host buffer while this step's copies may still read it.
                issued = self.device.new_event(blocking=True)
                issued.record(self.stream)
            issued.synchronize()
        except Exception:
            logger.exception("kvstore layer-wise load failed; recomputing the step's loads")
            load.crashed = True
            # Copies already issued may still read the staging and write the cache: let them
            # end before the next fetch reuses the buffers and vLLM recomputes those blocks.
            with contextlib.suppress(Exception):
                self.stream.synchronize()
        finally:
            load.scatter_s = time.perf_counter() - started
            for ready in load.ready:  # never leave the forward waiting
                ready.set()
            self.finish(load)  # nothing reads the leased blocks any more

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
        """End the step's lease on the store's blocks, if it holds one (idempotent)."""
        release, load.release = load.release, None
        if release is not None:
            release()

    def _issue_layer(self, load: StepLoad, layer: int) -> None:
        if load.runs is not None:
            self._copy_layer(load, layer)
            return
        plan = load.plan
        if plan is None or (not plan.whole and not plan.partial):
            return
        src = self._stage(load, layer)  # [chunks, kernel blocks, *block]
        cache = [self.caches[layer]]
        if plan.whole:
            # One call for every whole chunk of the step: [1, chunks * blocks, *block].
            whole = src[plan.whole].flatten(0, 1).unsqueeze(0)
            kvstore_kernels.scatter_blocks(whole, cache, plan.whole_ids, self.layout)
        for chunk, spec, index in plan.partial:
            self._scatter_partial(src[chunk].unsqueeze(0), cache, spec, index)

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

    def _stage(self, load: StepLoad, layer: int) -> torch.Tensor:
        """This layer's blocks of every chunk, where the scatter reads them."""
        if load.landed is not None:
            return load.landed[:, layer]  # already in device memory, nothing to copy
        host = load.host[:, layer]
        if not self.device.is_cuda:
            return host
        chunks = host.shape[0]
        staging = self._device_staging
        if staging is None or staging.shape[1] < chunks:
            shape = (len(self.caches), chunks, *self.chunk_shape[1:])
            # Allocated on the load stream, so the caching allocator orders its reuse there.
            staging = self._device_staging = self.device.device_buffer(shape, self._dtype)
        assert staging is not None
        dst = staging[layer, :chunks]
        # A chunk's layer slice is contiguous in the host buffer and lands contiguously: a
        # page-locked source makes each copy an asynchronous DMA on the load stream.
        for chunk in range(chunks):
            dst[chunk].copy_(host[chunk], non_blocking=True)
        return dst

    def _scatter_partial(
        self, src: torch.Tensor, cache: list[torch.Tensor], spec: LoadSpec, index: int
    ) -> None:
        """Write chunk ``index`` of ``spec`` (``src``: ``[1, kernel blocks, *block]``)."""
        bpc, ratio = self.blocks_per_chunk, self.ratio
        targets = chunk_blocks(spec.block_ids, index, bpc)
        wanted = [j for j, b in enumerate(targets) if b >= 0]
        if not wanted:
            return
        # Only part of the chunk is new to the engine: the rest sits in blocks that vLLM's own
        # prefix cache shares with other requests, which must not be written.
        rows = [j * ratio + i for j in wanted for i in range(ratio)]
        ids = kernel_ids([targets[j] for j in wanted], ratio)
        kvstore_kernels.scatter_blocks(src[:, rows], cache, ids, self.layout)

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


def in_place(device: Device, dtype: torch.dtype) -> bool:
    """Whether loads can read chunks in place from the store's arena (:func:`arena_chunk`):
    on CPU, for a dtype numpy can view as integers of its width (on CUDA the chunks go
    through page-locked staging, the DMA's source)."""
    return not device.is_cuda and width_of(dtype) is not None
