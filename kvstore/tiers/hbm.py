"""The ``hbm`` tier: a pool of accelerator memory that holds the hottest blocks.

One tensor of ``capacity`` bytes is allocated on the device at start-up and cut into pages by
:class:`~kvstore.tiers.pages.PageAllocator`, like the ``dram`` arena, so no device allocation
happens per block. The tier is a *device* tier: the store never places a new block here, only
blocks that were read again (promotions), so the pool fills with what engines reuse rather than
with every block ever put.

The device is a torch device name. The server builds the tier only where CUDA exists (``cuda``);
everything but the copies is device-independent, so the CPU test suite runs the same code on a
``cpu`` tensor. Device memory is trusted like DRAM: reads are not checked against the checksum,
and the header stays beside the pages to go with the block when it is demoted.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from typing import Any

from kvstore.block import BlockHeader
from kvstore.buffers import byte_view
from kvstore.tiers.base import Buffer, StoredBlock
from kvstore.tiers.paged import PagedTier
from kvstore.tiers.pages import Extent

__all__ = ["HbmTier"]


class HbmTier(PagedTier):
    """Blocks in one page-allocated tensor on an accelerator (or, for tests, on the CPU)."""

    name = "hbm"
    device = True

    def __init__(self, capacity: int, page_size: int = 1024**2, device: str = "cuda") -> None:
        import torch  # the server imports torch only when this tier is configured

        self._init_pages(capacity, page_size)
        self.torch_device = torch.device(device)
        self._pool = torch.empty(self.capacity, dtype=torch.uint8, device=self.torch_device)
        self._blocks: dict[bytes, tuple[BlockHeader, list[Extent]]] = {}
        self._payload_bytes = 0

    async def write(self, header: BlockHeader, payload: Buffer) -> bool:
        """Copy a block from host memory into free pages; False if too few are free."""
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
            source: Any = torch.frombuffer(view, dtype=torch.uint8)
        copied = 0
        for offset, size in self._ranges(extents, header.length):
            self._pool[offset : offset + size].copy_(source[copied : copied + size])
            copied += size
        self._blocks[header.key] = (header, extents)
        self._payload_bytes += header.length
        return True

    async def read(self, keys: Sequence[bytes]) -> list[StoredBlock | None]:
        """Copies, in host memory, of the payloads of ``keys``."""
        out: list[StoredBlock | None] = []
        for key in keys:
            held = self._blocks.get(key)
            if held is None:
                out.append(None)
                continue
            header, extents = held
            parts = [
                self._pool[offset : offset + size].cpu().numpy().tobytes()
                for offset, size in self._ranges(extents, header.length)
            ]
            out.append(StoredBlock(header, parts[0] if len(parts) == 1 else b"".join(parts)))
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
        """Give the pool back to the device allocator."""
        import torch

        self._blocks.clear()
        self._pool = torch.empty(0, dtype=torch.uint8, device=self.torch_device)

    def _forget(self, key: bytes) -> None:
        header, extents = self._blocks.pop(key)
        self._pages.release(extents)
        self._payload_bytes -= header.length
