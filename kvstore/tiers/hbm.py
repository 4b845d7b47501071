"""The ``hbm`` tier: a pool of accelerator memory that holds the hottest blocks.

One tensor of ``capacity`` bytes is allocated on the device at start-up and cut into pages by
:class:`~kvstore.tiers.pages.PageAllocator`, like the ``dram`` arena, so no device allocation
happens per block. The tier is a *device* tier: the store never places a new block here, only
blocks read again often enough (promotions; :meth:`kvstore.policy.Policy.promote_to_device`), so
the pool fills with what engines reuse rather than with every block ever put.

Copies never run on the server's event loop: each goes to one copier thread (awaited through the
loop's executor machinery), which issues it on the tier's own CUDA stream and waits for a CUDA
event recorded after it. The store promotes a block resident in the ``dram`` arena from the arena
pages themselves, which are page-locked where CUDA exists, so the host-to-device copy is a DMA
straight from them; reads come back through a page-locked staging buffer. One thread and one
stream keep the copies in the order they were asked for, so pages freed and handed out again
are never written before an earlier copy out of them is done.

The device is a torch device name. The server builds the tier only where CUDA exists (``cuda``);
everything but the stream and events is device-independent, so the CPU test suite runs the same
code on a ``cpu`` tensor (the copier thread included). Device memory is trusted like DRAM: reads
are not checked against the checksum, and the header stays beside the pages to go with the block
when it is demoted.
"""

from __future__ import annotations

import asyncio
import threading
import warnings
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvstore.block import BlockHeader
from kvstore.buffers import byte_view
from kvstore.tiers.base import Buffer, StoredBlock
from kvstore.tiers.paged import PagedTier
from kvstore.tiers.pages import Extent

__all__ = ["COPIER_THREAD", "HbmTier"]

#: Name prefix of the thread every copy of an hbm tier runs on.
COPIER_THREAD = "kvstore-hbm-copy"


class HbmTier(PagedTier):
    """Blocks in one page-allocated tensor on an accelerator (or, for tests, on the CPU)."""

    name = "hbm"
    device = True

    def __init__(self, capacity: int, page_size: int = 1024**2, device: str = "cuda") -> None:
        import torch  # the server imports torch only when this tier is configured

        self._init_pages(capacity, page_size)
        self.torch_device = torch.device(device)
        self._cuda = self.torch_device.type == "cuda"
        self._pool = torch.empty(self.capacity, dtype=torch.uint8, device=self.torch_device)
        #: The tier's own stream (CUDA only): copies never queue behind an engine's kernels.
        cuda: Any = torch.cuda  # untyped in torch's stubs
        self.stream: Any = None
        if self._cuda:
            self.stream = cuda.Stream(device=self.torch_device)
            # The pool was allocated on the current stream; later copies run on ours.
            self.stream.wait_stream(cuda.current_stream(self.torch_device))
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix=COPIER_THREAD)
        self._blocks: dict[bytes, tuple[BlockHeader, list[Extent]]] = {}
        self._payload_bytes = 0
        #: Copies issued, and the thread the last one ran on (never the event loop's).
        self.copies = 0
        self.copy_thread = ""

    async def write(self, header: BlockHeader, payload: Buffer) -> bool:
        """Copy a block from host memory into free pages; False if too few are free.

        The block becomes visible to reads only once its copy is complete.
        """
        import torch

        view = byte_view(payload)
        if len(view) != header.length:
            raise ValueError(f"payload is {len(view)} bytes, header says {header.length}")
        old = self._blocks.get(header.key)
        reusable = sum(extent.pages for extent in old[1]) if old is not None else 0
        pages = self.footprint(header.length) // self.page_size
        if pages > self._pages.free_pages + reusable:  # decide before freeing anything
            return False
        if old is not None:
            self._forget(header.key)
        extents = self._pages.allocate(pages)
        assert extents is not None
        with warnings.catch_warnings():
            # torch warns that the buffer may be read-only; it is only read here.
            warnings.simplefilter("ignore", UserWarning)
            source: Any = torch.frombuffer(view, dtype=torch.uint8) if len(view) else None
        if source is not None:
            await self._run(self._copy_in, source, self._ranges(extents, header.length))
        self._blocks[header.key] = (header, extents)
        self._payload_bytes += header.length
        return True

    async def read(self, keys: Sequence[bytes]) -> list[StoredBlock | None]:
        """The payloads of ``keys``, copied into host memory (page-locked where CUDA exists)."""
        out: list[StoredBlock | None] = []
        for key in keys:
            held = self._blocks.get(key)
            if held is None:
                out.append(None)
                continue
            header, extents = held
            ranges = self._ranges(extents, header.length)
            payload = await self._run(self._copy_out, ranges, header.length)
            out.append(StoredBlock(header, payload))
        return out

    async def remove(self, keys: Sequence[bytes]) -> bool:
        """Free the pages of ``keys``; always succeeds."""
        for key in keys:
            if key in self._blocks:
                self._forget(key)
        return True

    def scan(self) -> Iterator[BlockHeader]:
        """Device memory does not survive a restart: nothing."""
        return iter(())

    def stats(self) -> dict[str, int]:
        """Capacity, usage, block count, payload bytes and rounding waste."""
        return {
            "capacity": self.capacity,
            "used": self.used,
            "blocks": len(self._blocks),
            "payload_bytes": self._payload_bytes,
            "wasted_bytes": self.used - self._payload_bytes,
            "page_size": self.page_size,
        }

    async def close(self) -> None:
        """Wait for copies under way, stop the copier thread, give the pool back."""
        import torch

        self._blocks.clear()
        await asyncio.get_running_loop().run_in_executor(None, self._copier.shutdown, True)
        self._pool = torch.empty(0, dtype=torch.uint8, device=self.torch_device)

    # -- copies, on the copier thread ---------------------------------------------------------

    async def _run(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` on the copier thread, awaited without blocking the loop."""
        self.copies += 1
        return await asyncio.get_running_loop().run_in_executor(
            self._copier, self._on_copier, fn, args
        )

    def _on_copier(self, fn: Any, args: tuple[Any, ...]) -> Any:
        self.copy_thread = threading.current_thread().name
        return fn(*args)

    def _copy_in(self, source: Any, ranges: list[tuple[int, int]]) -> None:
        """Host ``source`` into the pool at ``ranges``, done when this returns."""
        import torch

        if not self._cuda:
            self._scatter(source, ranges, non_blocking=False)
            return
        with torch.cuda.stream(self.stream):
            # Asynchronous where ``source`` is page-locked (the dram arena), a DMA from it.
            self._scatter(source, ranges, non_blocking=True)
            done: Any = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
            done.record(self.stream)
        done.synchronize()  # ``source`` must outlive the copy: wait for it here, off the loop

    def _scatter(self, source: Any, ranges: list[tuple[int, int]], non_blocking: bool) -> None:
        copied = 0
        for offset, size in ranges:
            target = self._pool[offset : offset + size]
            target.copy_(source[copied : copied + size], non_blocking=non_blocking)
            copied += size

    def _copy_out(self, ranges: list[tuple[int, int]], length: int) -> memoryview:
        """The pool's bytes at ``ranges`` in one host buffer (page-locked on CUDA)."""
        import torch

        staging = torch.empty(length, dtype=torch.uint8, pin_memory=self._cuda)
        if self._cuda:
            with torch.cuda.stream(self.stream):
                copied = 0
                for offset, size in ranges:
                    part = self._pool[offset : offset + size]
                    staging[copied : copied + size].copy_(part, non_blocking=True)
                    copied += size
                done: Any = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
                done.record(self.stream)
            done.synchronize()
        else:
            copied = 0
            for offset, size in ranges:
                staging[copied : copied + size].copy_(self._pool[offset : offset + size])
                copied += size
        # The array keeps the staging tensor alive as long as the payload is referenced.
        return staging.numpy().data

    def _forget(self, key: bytes) -> None:
        header, extents = self._blocks.pop(key)
        self._pages.release(extents)
        self._payload_bytes -= header.length
