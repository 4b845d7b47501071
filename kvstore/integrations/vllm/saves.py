"""The connector's saves: gather planned blocks out of the paged cache, then put them in the store.

:meth:`SaveQueue.submit` is called from ``wait_for_save`` with the event that marks the end of
the step's forward pass (a no-op stand-in on CPU) and returns at once. A gather thread makes a side
stream wait for that event, copies the planned blocks into page-locked host buffers
(:meth:`~kvstore.integrations.paged.device.Device.gather_to_host`) and waits for that copy only;
after it the engine's blocks are no longer needed (requests waiting on that are reported by
:meth:`SaveQueue.finished`); a put thread sends the buffers to the store. A slow or dead store
therefore never holds engine blocks, and the put backlog is bounded in bytes.

Over shared memory the gather writes straight into the store's arena: the gather thread
reserves pages for the chunks (:meth:`kvstore.KVStoreClient.reserve`), and the put thread
commits them; chunks the store holds already are not gathered at all. On CPU each block is
gathered into the reserved pages. On CUDA, where this process's mapping of the arena is
page-locked there (:mod:`kvstore.client.arena_registration`), the chunks are gathered on the
device and DMAed straight into the reserved pages, and the commit waits for those DMAs to
complete: no page-locked bounce buffer and no host copy. Only chunks without contiguous
reserved pages, whose pages are not page-locked yet, or without room go through a host buffer
(then written into their pages, or put).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import kvstore_kernels  # type: ignore[import-not-found, unused-ignore]
import torch

from kvstore.client.shm_reserve import ShmReservation
from kvstore.errors import DeadlineExceededError, KVStoreError, StoreUnavailableError
from kvstore.integrations.paged.arena_dma import plan_rows, save_rows
from kvstore.integrations.paged.device import Device, Event, Stream
from kvstore.integrations.store_client import StoreClient
from kvstore.integrations.vllm.common import Breaker
from kvstore.integrations.vllm.stats import ConnectorCounters
from kvstore.retention import KEEP, Retention

__all__ = ["SaveJob", "SaveQueue", "failure_reason"]

logger = logging.getLogger(__name__)

# Gathered chunks waiting for their put may hold at most this much memory; past it new saves are
# dropped (a cache may always forget), so a slow store cannot grow the engine's memory.
MAX_PUT_BACKLOG_BYTES = 1 << 30
# How long shutdown waits for queued saves to reach the store.
_SHUTDOWN_DRAIN_S = 10.0


def failure_reason(exc: KVStoreError) -> str:
    """The failure reason (``vllm_stats.LOAD_FAILURES``) of a store call that raised ``exc``."""
    return "deadline" if isinstance(exc, DeadlineExceededError) else "unavailable"


@dataclass(slots=True)
class SaveJob:
    """Chunks ``keys`` of request ``req_id``, read from ``kernel_ids`` after ``after``, stored
    with the request's ``retention``."""

    req_id: str
    keys: list[bytes]
    kernel_ids: list[int]
    after: Event
    retention: Retention = KEEP


@dataclass(slots=True)
class _Gathered:
    """A job's chunks ready for the store: ``reservation`` (committed for ``written``) holds
    those gathered in place; ``buffer`` holds chunks ``buffered`` (indices into the job's keys)
    for a put; ``present`` chunks the store held already."""

    keys: list[bytes]
    nbytes: int  # what the backlog counts for the job
    buffer: torch.Tensor | None = None
    buffered: list[int] | None = None  # None: every key, in order
    reservation: ShmReservation | None = None
    written: list[int] | None = None
    present: int = 0
    retention: Retention = KEEP


@dataclass(slots=True)
class _Target:
    """The caches saves read from (set by ``register_kv_caches``)."""

    device: Device
    caches: list[torch.Tensor]
    layout: kvstore_kernels.CacheLayout
    chunk_shape: tuple[int, ...]
    chunk_nbytes: int

    @property
    def dtype(self) -> torch.dtype:
        """The caches' element type."""
        return self.caches[0].dtype


class SaveQueue:
    """The gather and put threads of one worker."""

    def __init__(
        self,
        client: StoreClient,
        breaker: Breaker,
        counters: ConnectorCounters,
        tokens_per_chunk: int,
    ) -> None:
        self._client = client
        self._breaker = breaker
        self._counters = counters
        self._tokens_per_chunk = tokens_per_chunk
        self._target: _Target | None = None
        self._lock = threading.Condition()
        self._ungathered: defaultdict[str, int] = defaultdict(int)  # req -> jobs not gathered
        self._saving: set[str] = set()  # requests that ever had a save planned
        self._finished: set[str] = set()  # ... that vLLM has finished
        self._backlog_bytes = 0
        self._gather_queue: queue.Queue[SaveJob | None] = queue.Queue()
        self._put_queue: queue.Queue[_Gathered | None] = queue.Queue()
        self._threads = [
            threading.Thread(target=self._gather_loop, name="kvstore-gather", daemon=True),
            threading.Thread(target=self._put_loop, name="kvstore-put", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def set_target(
        self,
        device: Device,
        caches: Sequence[torch.Tensor],
        layout: kvstore_kernels.CacheLayout,
        chunk_shape: tuple[int, ...],
    ) -> None:
        """Read saves from these caches from now on."""
        nbytes = int(torch.Size(chunk_shape).numel()) * caches[0].element_size()
        self._target = _Target(device, list(caches), layout, chunk_shape, nbytes)

    def submit(self, job: SaveJob) -> None:
        """Queue a save; the threads do the work."""
        with self._lock:
            self._ungathered[job.req_id] += 1
            self._saving.add(job.req_id)
        self._gather_queue.put(job)

    def wait_gathered(self, req_ids: set[str], timeout: float) -> None:
        """Block until no queued save still reads the blocks of ``req_ids`` (bounded)."""
        with self._lock:
            waiting = req_ids & set(self._ungathered)
            if waiting:
                self._lock.wait_for(
                    lambda: not any(self._ungathered.get(r) for r in waiting), timeout=timeout
                )

    def finished(self, finished_req_ids: set[str]) -> set[str]:
        """Finished requests whose blocks no save reads any more."""
        with self._lock:
            self._finished.update(finished_req_ids & self._saving)
            done = {r for r in self._finished if r not in self._ungathered}
            self._finished -= done
            self._saving -= done
        return done

    def _gather_loop(self) -> None:
        stream: Any = None
        while (job := self._gather_queue.get()) is not None:
            target = self._target
            gathered: _Gathered | None = None
            reserved = False
            nbytes = 0
            try:
                assert target is not None, "a save was queued before register_kv_caches"
                if stream is None:
                    stream = target.device.new_stream()
                nbytes = len(job.keys) * target.chunk_nbytes
                with self._lock:
                    if self._backlog_bytes + nbytes <= MAX_PUT_BACKLOG_BYTES:
                        self._backlog_bytes += nbytes
                        reserved = True
                if not reserved:
                    logger.warning("kvstore put backlog full; dropping %d chunks", len(job.keys))
                    self._counters.record_save_failed("backlog_full", self._tokens(job.keys))
                else:
                    gathered = self._gather_in_place(target, stream, job, nbytes)
                    if gathered is None:
                        buffer = self._gather(target, stream, job, range(len(job.keys)))
                        gathered = _Gathered(job.keys, nbytes, buffer, retention=job.retention)
            except Exception:
                logger.exception("kvstore gather failed; not saving %d chunks", len(job.keys))
                self._counters.record_save_failed("error", self._tokens(job.keys))
                if reserved:
                    with self._lock:
                        self._backlog_bytes -= nbytes
                gathered = None
            finally:
                with self._lock:
                    self._ungathered[job.req_id] -= 1
                    if not self._ungathered[job.req_id]:
                        del self._ungathered[job.req_id]
                    self._lock.notify_all()
            if gathered is not None:
                self._put_queue.put(gathered)

    def _gather(
        self, target: _Target, stream: Any, job: SaveJob, chunks: Sequence[int]
    ) -> torch.Tensor:
        """Copy chunks ``chunks`` of the job into a new host buffer (in that order); returns once
        the copy has finished."""
        device = target.device
        shape = (len(chunks), *target.chunk_shape)
        buffer = device.host_buffer(shape, target.caches[0].dtype, zero=False)
        with stream.use():
            # The blocks are complete only once the forward pass that wrote them has run.
            stream.wait(job.after)
            for row, chunk in enumerate(chunks):
                ids = self._chunk_ids(target, job, chunk)
                device.gather_to_host(target.caches, ids, target.layout, buffer[row])
            copied = device.new_event(blocking=True)
            copied.record(stream)
        copied.synchronize()  # this copy only: the forward pass of later steps goes on
        return buffer

    def _gather_in_place(
        self, target: _Target, stream: Stream, job: SaveJob, nbytes: int
    ) -> _Gathered | None:
        """Over shared memory: gather the job's chunks straight into reserved arena pages;
        ``None`` where that is not possible (another data plane, a store down)."""
        if self._breaker.is_open():
            return None
        try:
            held: ShmReservation | None = self._client.reserve(
                job.keys, [target.chunk_nbytes] * len(job.keys), retention=job.retention
            )
        except KVStoreError as exc:
            logger.debug("kvstore: no arena pages for a save (%s); putting it", exc)
            return None
        if held is None:
            return None
        # On CPU the forward pass that wrote the blocks has returned (no event to wait for); on
        # CUDA every gather below waits for its event first.
        dtype = target.dtype
        written: list[int] = []
        scattered: list[int] = []
        buffered: list[int] = []
        try:
            if target.device.is_cuda:
                written = self._dma_in_place(target, stream, job, held)
            for chunk, (state, view) in enumerate(zip(held.states, held.views, strict=True)):
                if chunk in written:
                    continue
                if state == "reserved" and view is not None and not target.device.is_cuda:
                    out = torch.from_numpy(view).view(dtype).view(target.chunk_shape)
                    ids = self._chunk_ids(target, job, chunk)
                    target.device.gather_to_host(target.caches, ids, target.layout, out)
                    written.append(chunk)
                elif state == "reserved":
                    scattered.append(chunk)  # pages not in one piece: gathered, then written
                elif state == "no_room":
                    buffered.append(chunk)
            if scattered:
                buffer = self._gather(target, target.device.new_stream(), job, scattered)
                for row, chunk in enumerate(scattered):
                    held.write(chunk, buffer[row])
                written += scattered
            spilled = (
                self._gather(target, target.device.new_stream(), job, buffered)
                if buffered
                else None
            )
        except BaseException:
            held.cancel()
            raise
        return _Gathered(
            job.keys,
            nbytes,
            spilled,
            buffered,
            held,
            written,
            held.states.count("present"),
            job.retention,
        )

    def _dma_in_place(
        self, target: _Target, stream: Stream, job: SaveJob, held: ShmReservation
    ) -> list[int]:
        """CUDA: gather the reserved chunks whose pages are page-locked here on the device and
        DMA each straight into its pages; returns those chunks once every DMA has completed (so
        the commit that follows never publishes pages still being written)."""
        registration = held.registration
        if registration is None:
            return []
        nbytes = target.chunk_nbytes
        chosen: list[tuple[int, int]] = []  # (chunk, address of its pages)
        for chunk, (state, view) in enumerate(zip(held.states, held.views, strict=True)):
            if state != "reserved" or view is None:
                continue
            address = int(view.ctypes.data)
            if registration.covers(address, nbytes):
                chosen.append((chunk, address))
            else:
                registration.want(address, nbytes)  # pinned for a later save
        if not chosen or not registration.enter():
            return []
        device = target.device
        layers, per_chunk = target.chunk_shape[0], target.chunk_shape[1]
        ids = [i for chunk, _ in chosen for i in self._chunk_ids(target, job, chunk)]
        rows = save_rows([address for _, address in chosen], layers, nbytes // layers)
        try:
            with stream.use():
                stream.wait(job.after)  # the blocks are complete once their forward has run
                # Every chosen chunk in ONE launch: [layers, chunks * kernel blocks, *block],
                # then one strided DMA per chunk (its layers are rows of that buffer).
                shape = (layers, len(chosen) * per_chunk, *target.chunk_shape[2:])
                gathered = device.device_buffer(shape, target.dtype)
                assert gathered is not None
                kvstore_kernels.gather_blocks(target.caches, ids, target.layout, gathered)
                base = gathered.data_ptr()
                for copy in plan_rows(rows, nbytes // layers, registration.cut):
                    device.dma_to_host(copy, base, stream)
                copied = device.new_event(blocking=True)
                copied.record(stream)
            copied.synchronize()
        except BaseException:
            with contextlib.suppress(Exception):
                stream.synchronize()  # no DMA may still write the pages handed back
            raise
        finally:
            registration.leave()
        return [chunk for chunk, _ in chosen]

    @staticmethod
    def _chunk_ids(target: _Target, job: SaveJob, chunk: int) -> list[int]:
        per_chunk = target.chunk_shape[1]
        return job.kernel_ids[chunk * per_chunk : (chunk + 1) * per_chunk]

    def _put_loop(self) -> None:
        while (item := self._put_queue.get()) is not None:
            tokens = self._tokens(item.keys)
            try:
                if self._breaker.is_open():  # a reservation is cancelled below
                    self._counters.record_save_failed("store_down", tokens)
                else:
                    self._store(item)
                    self._counters.record_save(tokens)
            except (StoreUnavailableError, DeadlineExceededError) as exc:
                self._counters.record_save_failed(failure_reason(exc), tokens)
                self._breaker.trip(exc)
            except KVStoreError as exc:
                self._counters.record_save_failed("error", tokens)
                logger.warning("kvstore put of %d chunks failed: %s", len(item.keys), exc)
            except Exception:
                self._counters.record_save_failed("error", tokens)
                logger.exception("kvstore put of %d chunks crashed", len(item.keys))
            finally:
                if item.reservation is not None:
                    item.reservation.cancel()  # nothing if committed
                with self._lock:
                    self._backlog_bytes -= item.nbytes

    def _store(self, item: _Gathered) -> None:
        """Commit what was gathered in place and put what was buffered."""
        if item.reservation is not None:
            item.reservation.commit(item.written)
        if item.buffer is not None:
            keys = item.keys
            if item.buffered is not None:
                keys = [keys[chunk] for chunk in item.buffered]
            self._client.put(keys, list(item.buffer.unbind(0)), retention=item.retention)

    def _tokens(self, keys: list[bytes]) -> int:
        return len(keys) * self._tokens_per_chunk

    def shutdown(self) -> bool:
        """Let queued saves reach the store (bounded), then stop the threads; True if drained."""
        self._gather_queue.put(None)
        self._threads[0].join(timeout=_SHUTDOWN_DRAIN_S)
        self._put_queue.put(None)
        self._threads[1].join(timeout=_SHUTDOWN_DRAIN_S)
        return not any(thread.is_alive() for thread in self._threads)
