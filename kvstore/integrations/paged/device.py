"""The device the KV caches live on: streams, events, buffers and raw copies, CPU and CUDA alike.

:class:`Device` hides the difference: on CUDA a :class:`Stream` is a ``torch.cuda.Stream``, an
:class:`Event` a ``torch.cuda.Event`` and host buffers are page-locked (so a host-to-device copy
is a DMA the copy engine runs while the SMs compute); on CPU the stream and the event are
stand-ins that do nothing, because there every copy has finished when the call returns.

The copies by address (:meth:`Device.dma_to_device`, :meth:`Device.dma_to_host`) are the
direct path between the store's arena and device memory: page-locked arena pages
(:mod:`kvstore.client.arena_registration`) in, device buffers out, one DMA for many rows, through
the CUDA runtime torch loaded (:mod:`kvstore.client.cuda_runtime`). They exist on CUDA only; the
CPU tests replace the whole class with a stand-in that queues them
(``tests/harness/cuda_stand_in.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import kvstore_kernels  # type: ignore[import-not-found, unused-ignore]
import torch

from kvstore.client.arena_registration import CudaRegistrar, Registrar
from kvstore.client.cuda_runtime import DEVICE_TO_HOST, HOST_TO_DEVICE, cuda_runtime
from kvstore.integrations.paged.arena_dma import RowCopy

__all__ = ["Device", "Event", "Stream"]


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
    """Streams, events, staging buffers and raw copies for the device the KV caches live on."""

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

    # -- the direct path (CUDA only) --------------------------------------------------------

    def host_registrar(self) -> Registrar:
        """What page-locks host memory for this device's DMA (the CUDA runtime's).

        Raises:
            CudaRuntimeUnavailable: no CUDA runtime in this process.
        """
        return CudaRegistrar()

    def dma_to_device(self, copy: RowCopy, base: int, stream: Stream) -> None:
        """Queue ``copy`` as ONE DMA on ``stream``: its rows from page-locked host memory into
        the device buffer at address ``base``."""
        device, host = (base + copy.device, copy.device_pitch), (copy.host, copy.host_pitch)
        self._dma(device, host, copy, HOST_TO_DEVICE, stream)

    def dma_to_host(self, copy: RowCopy, base: int, stream: Stream) -> None:
        """Queue ``copy`` as ONE DMA on ``stream``: its rows from the device buffer at address
        ``base`` into page-locked host memory."""
        device, host = (base + copy.device, copy.device_pitch), (copy.host, copy.host_pitch)
        self._dma(host, device, copy, DEVICE_TO_HOST, stream)

    def _dma(
        self,
        dst: tuple[int, int],
        src: tuple[int, int],
        copy: RowCopy,
        kind: int,
        stream: Stream,
    ) -> None:
        """``cudaMemcpy2DAsync`` of ``copy``'s rows from ``src`` to ``dst`` (address, pitch)."""
        with torch.cuda.device(self.device):  # the runtime issues on the thread's device
            cuda_runtime().copy_2d_async(
                *dst, *src, copy.width, copy.height, kind, stream.raw.cuda_stream
            )
