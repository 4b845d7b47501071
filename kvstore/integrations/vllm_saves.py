"""The connector's saves: gather planned blocks out of the paged cache, then put them in the store.

:meth:`SaveQueue.submit` is called from ``wait_for_save`` with the event that marks the end of
the step's forward pass (a no-op stand-in on CPU) and returns at once. A gather thread makes a side
stream wait for that event, copies the planned blocks into page-locked host buffers
(:meth:`~kvstore.integrations.device_pipeline.Device.gather_to_host`) and waits for that copy only;
after it the engine's blocks are no longer needed (requests waiting on that are reported by
:meth:`SaveQueue.finished`); a put thread sends the buffers to the store. A slow or dead store
therefore never holds engine blocks, and the put backlog is bounded in bytes.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import kvstore_kernels  # type: ignore[import-not-found, unused-ignore]
import torch

from kvstore.client import KVStoreClient
from kvstore.errors import DeadlineExceededError, KVStoreError, StoreUnavailableError
from kvstore.integrations.device_pipeline import Device, Event
from kvstore.integrations.vllm_common import Breaker
from kvstore.integrations.vllm_stats import ConnectorCounters

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
    """Chunks ``keys`` of request ``req_id``, read from ``kernel_ids`` after ``after``."""

    req_id: str
    keys: list[bytes]
    kernel_ids: list[int]
    after: Event


@dataclass(slots=True)
class _Target:
    """The caches saves read from (set by ``register_kv_caches``)."""

    device: Device
    caches: list[torch.Tensor]
    layout: kvstore_kernels.CacheLayout
    chunk_shape: tuple[int, ...]
    chunk_nbytes: int


class SaveQueue:
    """The gather and put threads of one worker."""

    def __init__(
        self,
        client: KVStoreClient,
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
        self._put_queue: queue.Queue[tuple[list[bytes], torch.Tensor, int] | None] = queue.Queue()
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
            buffer: torch.Tensor | None = None
            nbytes = 0
            try:
                assert target is not None, "a save was queued before register_kv_caches"
                if stream is None:
                    stream = target.device.new_stream()
                nbytes = len(job.keys) * target.chunk_nbytes
                with self._lock:
                    if self._backlog_bytes + nbytes <= MAX_PUT_BACKLOG_BYTES:
                        self._backlog_bytes += nbytes
                        buffer = torch.empty(0)  # reserved; allocated below, off the lock
                if buffer is None:
                    logger.warning("kvstore put backlog full; dropping %d chunks", len(job.keys))
                    self._counters.record_save_failed("backlog_full", self._tokens(job.keys))
                else:
                    buffer = self._gather(target, stream, job)
            except Exception:
                logger.exception("kvstore gather failed; not saving %d chunks", len(job.keys))
                self._counters.record_save_failed("error", self._tokens(job.keys))
                if buffer is not None:
                    with self._lock:
                        self._backlog_bytes -= nbytes
                buffer = None
            finally:
                with self._lock:
                    self._ungathered[job.req_id] -= 1
                    if not self._ungathered[job.req_id]:
                        del self._ungathered[job.req_id]
                    self._lock.notify_all()
            if buffer is not None:
                self._put_queue.put((job.keys, buffer, nbytes))

    def _gather(self, target: _Target, stream: Any, job: SaveJob) -> torch.Tensor:
        """Copy the job's blocks into a host buffer; returns once the copy has finished."""
        device = target.device
        shape = (len(job.keys), *target.chunk_shape)
        buffer = device.host_buffer(shape, target.caches[0].dtype, zero=False)
        per_chunk = target.chunk_shape[1]
        with stream.use():
            # The blocks are complete only once the forward pass that wrote them has run.
            stream.wait(job.after)
            for i in range(len(job.keys)):
                ids = job.kernel_ids[i * per_chunk : (i + 1) * per_chunk]
                device.gather_to_host(target.caches, ids, target.layout, buffer[i])
            copied = device.new_event()
            copied.record(stream)
        copied.synchronize()  # this copy only: the forward pass of later steps goes on
        return buffer

    def _put_loop(self) -> None:
        while (item := self._put_queue.get()) is not None:
            keys, buffer, nbytes = item
            tokens = self._tokens(keys)
            try:
                if self._breaker.is_open():
                    self._counters.record_save_failed("store_down", tokens)
                else:
                    self._client.put(keys, list(buffer.unbind(0)))
                    self._counters.record_save(tokens)
            except (StoreUnavailableError, DeadlineExceededError) as exc:
                self._counters.record_save_failed(failure_reason(exc), tokens)
                self._breaker.trip(exc)
            except KVStoreError as exc:
                self._counters.record_save_failed("error", tokens)
                logger.warning("kvstore put of %d chunks failed: %s", len(keys), exc)
            except Exception:
                self._counters.record_save_failed("error", tokens)
                logger.exception("kvstore put of %d chunks crashed", len(keys))
            finally:
                with self._lock:
                    self._backlog_bytes -= nbytes

    def _tokens(self, keys: list[bytes]) -> int:
        return len(keys) * self._tokens_per_chunk

    def shutdown(self) -> bool:
        """Let queued saves reach the store (bounded), then stop the threads; True if drained."""
        self._gather_queue.put(None)
        self._threads[0].join(timeout=_SHUTDOWN_DRAIN_S)
        self._put_queue.put(None)
        self._threads[1].join(timeout=_SHUTDOWN_DRAIN_S)
        return not any(thread.is_alive() for thread in self._threads)
