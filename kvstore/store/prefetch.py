"""Background prefetch: move blocks from the lower tiers (nvme, the shared redis) into dram.

A client that knows which prefix it will read soon (the scheduler has seen the prompt, the worker
has not asked yet) calls ``Prefetch(keys)``; the get that follows is then served from dram.

:class:`Prefetcher` runs on the store's event loop. :meth:`Prefetcher.submit` validates the whole
request at once and returns an id; the keys are then promoted (:meth:`TieredStore.promote`) in
batches of at most ``batch_keys``, in request order so that the prefix, which the engine needs
first, arrives first. At most ``max_concurrency`` batches are in flight across all prefetches,
so a burst of prefetches cannot starve puts and gets of the store's lock and I/O.

Memory is bounded: the prefetches not yet finished may hold at most ``max_queued_keys`` keys
together (a submit beyond that is refused with :class:`CapacityError`, RESOURCE_EXHAUSTED; the
bound is global, as there are no tenants yet), and a finished prefetch keeps only its counts,
for the last ``keep_finished`` of them (older ids are forgotten, oldest first, and answer
NOT_FOUND).

Cancellation stops a prefetch from starting further batches. A batch already inside
``promote`` is never interrupted (it is shielded and finishes on its own, still holding its slot
of the concurrency bound): interrupting a move half-way (a demotion awaiting nvme under the
store's lock) is exactly what the store's lock exists to prevent. Blocks a cancelled prefetch
already moved stay in dram.

For callers that must know that no further batch will start: :meth:`Prefetcher.idle` waits
until nothing is queued, running or moving, and :meth:`Prefetcher.stats` counts the batches in
flight and those waiting for a slot (with the batches in flight held, nothing else can start).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstore.errors import CapacityError, StoreUnavailableError, UnknownPrefetchError
from kvstore.protocol.checks import check_keys
from kvstore.store.tiered import TieredStore
from kvstore.types import PrefetchProgress, PrefetchState

__all__ = ["PrefetchProgress", "PrefetchState", "Prefetcher"]

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Job:
    """One submitted prefetch (mutable, loop thread only)."""

    keys: list[bytes]  # emptied when the job finishes: only the counts are kept
    namespace: bytes
    total: int = 0
    state: PrefetchState = PrefetchState.QUEUED
    outcomes: Counter[str] = field(default_factory=Counter)
    next_key: int = 0  # index of the first key no batch has taken yet
    task: asyncio.Task[None] | None = None

    def progress(self) -> PrefetchProgress:
        return PrefetchProgress(
            self.state,
            self.total,
            self.outcomes["ready"],
            self.outcomes["missing"],
            self.outcomes["failed"],
        )


class Prefetcher:
    """Runs prefetches against one :class:`TieredStore`, on the loop that serves it.

    Every method must be called on that loop's thread (the gRPC servicer's methods are).
    """

    def __init__(
        self,
        store: TieredStore,
        *,
        max_concurrency: int = 4,
        batch_keys: int = 16,
        keep_finished: int = 1024,
        max_queued_keys: int = 65536,
    ) -> None:
        if max_concurrency < 1 or batch_keys < 1 or keep_finished < 0 or max_queued_keys < 1:
            raise ValueError(
                "max_concurrency, batch_keys and max_queued_keys must be >= 1 and keep_finished "
                f">= 0, got {max_concurrency}, {batch_keys}, {max_queued_keys}, {keep_finished}"
            )
        self.store = store
        self.max_concurrency = max_concurrency
        self.batch_keys = batch_keys
        self.keep_finished = keep_finished
        self.max_queued_keys = max_queued_keys
        self._queued_keys = 0  # keys of the jobs not yet finished
        self._slots = asyncio.Semaphore(max_concurrency)
        self._ids = itertools.count(1)
        self._jobs: dict[int, _Job] = {}
        self._finished: deque[int] = deque()  # ids of finished jobs, oldest first
        self._batches: set[asyncio.Task[None]] = set()  # promote batches in flight
        self._waiting = 0  # workers waiting for a slot, each to start its job's next batch
        self._live = 0  # jobs whose task has not finished (queued or running)
        self._idle = asyncio.Event()  # set while _live == 0 and no batch is in flight
        self._idle.set()
        self._counters: Counter[str] = Counter()
        self._closed = False

    # -- public API --------------------------------------------------------------------------

    def submit(self, keys: Sequence[bytes], namespace: bytes) -> int:
        """Queue a prefetch of ``keys`` under ``namespace``; returns its id at once.

        The whole request is validated first, as every store call does: a bad one raises
        :class:`InvalidRequestError` and queues nothing.
        """
        if self._closed:
            raise StoreUnavailableError("the server is shutting down; no new prefetches")
        self._validate(keys, namespace)
        if self._queued_keys + len(keys) > self.max_queued_keys:
            self._counters["refused"] += 1
            raise CapacityError(
                f"{self._queued_keys} keys of prefetches are queued or running; {len(keys)} more "
                f"would pass the limit of {self.max_queued_keys} (server.prefetch_queue_keys); "
                "retry later"
            )
        prefetch_id = next(self._ids)
        job = _Job([bytes(key) for key in keys], bytes(namespace), total=len(keys))
        self._queued_keys += job.total
        self._jobs[prefetch_id] = job
        self._live += 1
        self._idle.clear()
        job.task = asyncio.get_running_loop().create_task(
            self._run(job), name=f"kvstore-prefetch-{prefetch_id}"
        )
        # A done callback, not a ``finally`` in _run: it also runs for a task cancelled before
        # its first step, whose coroutine never starts.
        job.task.add_done_callback(lambda task: self._finish(prefetch_id, job, task))
        self._counters["submitted"] += 1
        return prefetch_id

    def status(self, prefetch_id: int) -> PrefetchProgress:
        """The progress of a prefetch; :class:`UnknownPrefetchError` if there is no such id."""
        return self._job(prefetch_id).progress()

    def cancel(self, prefetch_id: int) -> bool:
        """Stop a prefetch; False if it had already finished.

        Batches not yet started never start; a batch already moving blocks finishes (and its
        keys are counted), so the store is never left half-way through a move.
        """
        job = self._job(prefetch_id)
        if job.state.finished:
            return False
        job.state = PrefetchState.CANCELLED
        if job.task is not None:
            job.task.cancel()
        self._counters["cancelled"] += 1
        return True

    async def close(self) -> None:
        """Cancel every prefetch and wait until no batch is moving blocks any more.

        Call before the store is persisted or closed: afterwards nothing of the prefetcher
        touches the store.
        """
        self._closed = True
        tasks = [job.task for job in self._jobs.values() if job.task is not None]
        for prefetch_id, job in list(self._jobs.items()):
            if not job.state.finished:
                self.cancel(prefetch_id)
        # Cancelled jobs start no new batch, so the batches in flight now are the last ones.
        await asyncio.gather(*tasks, *self._batches, return_exceptions=True)

    async def idle(self) -> None:
        """Return once no prefetch is queued or running and no batch is moving blocks.

        From then on nothing of the prefetcher touches the store until the next :meth:`submit`
        (a cancelled prefetch counts once its task has stopped and its last batch finished).
        Returns at once if nothing was ever submitted.
        """
        await self._idle.wait()

    def stats(self) -> dict[str, int]:
        """Counters: prefetches submitted / cancelled / refused, active now, batches in flight,
        batches ready to start but waiting for a slot of ``max_concurrency``
        (``prefetch_waiting_for_slot``: a prefetch waits with at most ``max_concurrency`` of
        them), keys held by unfinished prefetches (``prefetch_queued_keys``), keys by outcome."""
        active = sum(not job.state.finished for job in self._jobs.values())
        return {
            **{f"prefetch_{name}": value for name, value in self._counters.items()},
            "prefetch_active": active,
            "prefetch_batches_in_flight": len(self._batches),
            "prefetch_waiting_for_slot": self._waiting,
            "prefetch_queued_keys": self._queued_keys,
        }

    # -- internals ---------------------------------------------------------------------------

    def _validate(self, keys: Sequence[bytes], namespace: bytes) -> None:
        # The same rules as the store applies to each promote batch, checked over the whole
        # request up front so that a bad key fails the Prefetch call rather than a later batch.
        check_keys(keys, namespace, self.store.max_keys_per_request)

    def _job(self, prefetch_id: int) -> _Job:
        job = self._jobs.get(prefetch_id)
        if job is None:
            raise UnknownPrefetchError(f"no prefetch has id {prefetch_id} (or it was forgotten)")
        return job

    async def _run(self, job: _Job) -> None:
        """Run a job's batches, up to ``max_concurrency`` of them at once."""
        batches = -(-len(job.keys) // self.batch_keys)
        async with asyncio.TaskGroup() as group:
            for _ in range(min(self.max_concurrency, batches)):
                group.create_task(self._worker(job))
        job.state = PrefetchState.DONE

    async def _worker(self, job: _Job) -> None:
        """Take the job's next batch whenever a slot is free, until no batch is left."""
        while job.next_key < len(job.keys):
            self._waiting += 1
            try:
                await self._slots.acquire()
            finally:
                self._waiting -= 1
            # Taken only once a slot is held, so the earliest remaining keys always go next.
            start = job.next_key
            if job.state is PrefetchState.CANCELLED or start >= len(job.keys):
                self._slots.release()
                return
            job.next_key = start + self.batch_keys
            job.state = PrefetchState.RUNNING
            batch = self._spawn_batch(job, job.keys[start : job.next_key])
            # Shielded: cancelling this worker must not interrupt a move in progress.
            await asyncio.shield(batch)

    def _spawn_batch(self, job: _Job, keys: list[bytes]) -> asyncio.Task[None]:
        """Start one promote batch; it holds an acquired slot and releases it when done."""

        async def batch() -> None:
            try:
                outcomes: Sequence[str] = await self.store.promote(keys, job.namespace)
            except Exception:
                logger.exception("prefetch batch of %d key(s) failed", len(keys))
                outcomes = ["failed"] * len(keys)
            finally:
                self._slots.release()
            job.outcomes.update(outcomes)
            self._counters.update(f"keys_{outcome}" for outcome in outcomes)

        task = asyncio.get_running_loop().create_task(batch())
        self._batches.add(task)
        task.add_done_callback(self._batch_done)
        return task

    def _batch_done(self, task: asyncio.Task[None]) -> None:
        self._batches.discard(task)
        self._check_idle()

    def _check_idle(self) -> None:
        if self._live == 0 and not self._batches:
            self._idle.set()

    def _finish(self, prefetch_id: int, job: _Job, task: asyncio.Task[None]) -> None:
        """Settle a job's final state; keep the last ``keep_finished`` jobs, forget older ones."""
        if task.cancelled():
            job.state = PrefetchState.CANCELLED
        elif task.exception() is not None:
            # Only a bug gets here (a failing batch is counted, not raised). There is no FAILED
            # state: DONE with keys left uncounted says the prefetch stopped early.
            logger.error("prefetch %d failed", prefetch_id, exc_info=task.exception())
            job.state = PrefetchState.DONE
        job.task = None  # let the task and its frames go
        job.keys = []  # a finished job answers with counts only
        self._queued_keys -= job.total
        self._finished.append(prefetch_id)
        while len(self._finished) > self.keep_finished:
            self._jobs.pop(self._finished.popleft(), None)
        self._live -= 1
        self._check_idle()
