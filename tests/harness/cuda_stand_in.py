"""A STAND-IN for a CUDA device, for the CPU suite: asynchronous streams over CPU tensors.

The GPU cannot run here, but what the CUDA path gets wrong is mostly *order*: a scatter that
reads its staging before the DMA that fills it has run, a lease released while a DMA still reads
the arena, a save committed before its device-to-host copy has landed. A stand-in whose streams
did their work at once would hide all of that. These streams do not: work issued on a
:class:`StandInStream` (the connector's DMAs by address, and the kernels' gathers and scatters
while the stream is in use) is only *queued*, and runs when something waits for it the way CUDA
code must -- an event synchronized, a stream synchronized, or another stream's queued work
reaching a ``wait``/``wait_stream`` on it. Code that forgot such a wait reads the stand-in
device memory's garbage (7s), or reads the arena after its lease ended, and the tests see it.

``log`` records, in the order they *ran*, the DMAs' rows (``("h2d", host address, nbytes)``,
``("d2h", host address, nbytes)``), so tests can check them against when a lease was released or
a reservation committed.

:class:`StandInRegistrar` page-locks nothing: it records the ranges, and can refuse or be slow.
Torch copies (the staging path's ``copy_``) still run at once: they are not what these tests are
about.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import kvstore_kernels  # type: ignore[import-not-found, unused-ignore]
import torch

from kvstore.integrations.paged.arena_dma import RowCopy
from kvstore.integrations.paged.device import Device, Event, Stream

__all__ = ["StandInDevice", "StandInRegistrar", "deferred_kernels", "log"]

#: What the stand-in DMAs did, in the order they ran.
log: list[tuple[str, int, int]] = []
_run_lock = threading.RLock()
_current = threading.local()


class _Queue:
    """The raw side of a stand-in stream: work queued, and how much of it has run."""

    def __init__(self) -> None:
        self.ops: list[Callable[[], None]] = []
        self.done = 0

    def run_until(self, end: int) -> None:
        with _run_lock:
            while self.done < end:
                op = self.ops[self.done]
                self.done += 1
                op()

    def enqueue(self, op: Callable[[], None]) -> None:
        with _run_lock:
            self.ops.append(op)

    # The torch.cuda.Stream calls that Stream makes on its raw stream.
    def wait_event(self, event: _Mark) -> None:
        queue, end = event.queue, event.end
        if queue is not None:
            self.enqueue(lambda: queue.run_until(end))

    def wait_stream(self, other: _Queue) -> None:
        end = len(other.ops)
        self.enqueue(lambda: other.run_until(end))

    def synchronize(self) -> None:
        self.run_until(len(self.ops))


class _Mark:
    """The raw side of a stand-in event: a point in one queue."""

    def __init__(self) -> None:
        self.queue: _Queue | None = None
        self.end = 0

    def record(self, queue: _Queue) -> None:
        with _run_lock:
            self.queue, self.end = queue, len(queue.ops)

    def synchronize(self) -> None:
        if self.queue is not None:
            self.queue.run_until(self.end)


class StandInStream(Stream):
    """A stream whose work runs only when waited for (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__(_Queue())

    @contextlib.contextmanager
    def use(self) -> Iterator[None]:
        previous = getattr(_current, "queue", None)
        _current.queue = self.raw
        try:
            yield
        finally:
            _current.queue = previous


def _issue(op: Callable[[], None]) -> None:
    """Queue ``op`` on the stream in use on this thread; run it now if none is."""
    queue = getattr(_current, "queue", None)
    if queue is None:
        op()
    else:
        queue.enqueue(op)


class StandInRegistrar:
    """Registers nothing; records ``(address, nbytes)``; refuses with ``fail`` (an error code)
    or takes ``delay_s`` per call where asked."""

    def __init__(self, fail: int = 0, delay_s: float = 0.0) -> None:
        self.fail, self.delay_s = fail, delay_s
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []
        #: The ``(address, nbytes)`` registered for reading only (a read-only mapping).
        self.read_only: list[tuple[int, int]] = []

    def register(self, address: int, nbytes: int, read_only: bool = False) -> int:
        time.sleep(self.delay_s)  # sleep: the slow registration asked for
        if self.fail:
            return self.fail
        self.registered.append((address, nbytes))
        if read_only:
            self.read_only.append((address, nbytes))
        return 0

    def unregister(self, address: int) -> None:
        self.unregistered.append(address)

    def describe(self, code: int) -> str:
        return f"stand-in refusal {code}"


class StandInDevice(Device):
    """Claims CUDA for CPU tensors, with queued streams (see the module docstring). Device
    buffers start full of 7s; host buffers are not page-locked."""

    #: The registrar the next devices hand out (a test may replace it before building engines).
    registrar: StandInRegistrar = StandInRegistrar()

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.is_cuda = True
        self._compute = StandInStream()

    def current_stream(self) -> Stream:
        return self._compute

    def new_stream(self) -> Stream:
        return StandInStream()

    def new_event(self, *, blocking: bool = False) -> Event:
        return Event(_Mark())

    def host_buffer(
        self, shape: Sequence[int], dtype: torch.dtype, *, zero: bool = True
    ) -> torch.Tensor:
        return (torch.zeros if zero else torch.empty)(tuple(shape), dtype=dtype)

    def device_buffer(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.full(tuple(shape), 7, dtype=dtype)

    def gather_to_host(
        self,
        caches: Sequence[torch.Tensor],
        ids: Sequence[int],
        layout: Any,
        out: torch.Tensor,
    ) -> None:
        ids = list(ids)
        _issue(lambda: kvstore_kernels.gather_blocks(caches, ids, layout, out=out))

    def host_registrar(self) -> StandInRegistrar:
        return type(self).registrar

    def dma_to_device(self, copy: RowCopy, base: int, stream: Stream) -> None:
        stream.raw.enqueue(_rows("h2d", copy, base + copy.device, copy.device_pitch, to_host=False))

    def dma_to_host(self, copy: RowCopy, base: int, stream: Stream) -> None:
        stream.raw.enqueue(_rows("d2h", copy, base + copy.device, copy.device_pitch, to_host=True))


def _rows(
    kind: str, copy: RowCopy, device: int, device_pitch: int, *, to_host: bool
) -> Callable[[], None]:
    """A queued 2D copy between ``copy``'s host rows and device rows at ``device``, row by row,
    each logged with its host address."""

    def run() -> None:
        for row in range(copy.height):
            host, at = copy.host + row * copy.host_pitch, device + row * device_pitch
            log.append((kind, host, copy.width))
            ctypes.memmove(host if to_host else at, at if to_host else host, copy.width)

    return run


class _DeferredKernels:
    """``kvstore_kernels`` with gathers and scatters queued on the stream in use."""

    CacheLayout = kvstore_kernels.CacheLayout

    @staticmethod
    def scatter_blocks(buffer: Any, caches: Any, ids: Any, layout: Any, **kw: Any) -> None:
        ids = list(ids)
        _issue(lambda: kvstore_kernels.scatter_blocks(buffer, caches, ids, layout, **kw))

    @staticmethod
    def gather_blocks(caches: Any, ids: Any, layout: Any, out: Any = None, **kw: Any) -> Any:
        assert out is not None, "a queued gather needs its output up front"
        ids = list(ids)
        _issue(lambda: kvstore_kernels.gather_blocks(caches, ids, layout, out, **kw))
        return out


def deferred_kernels() -> Any:
    """A stand-in for the ``kvstore_kernels`` module whose gathers and scatters queue."""
    return _DeferredKernels()
