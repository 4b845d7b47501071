"""The ``dram`` tier: one preallocated host-memory arena.

The arena is a single shared-memory mapping (a ``memfd``), allocated once at start-up and cut into
pages by :class:`~kvstore.tiers.pages.PageAllocator`; a put copies the payload into free pages and
allocates nothing else in steady state. Capacity is counted in whole pages, so the bytes the tier
occupies never exceed ``capacity``, and the space lost to rounding up the last page of each block is
reported as ``wasted_bytes``. Living in a memfd lets co-located clients map the same pages later.

The header, with the payload's xxh3-64 checksum computed at put (no MAC: see
:mod:`kvstore.block`), is kept beside the pages in the server's own memory, never in the arena, and
goes with the block when it is demoted; the tier it goes to checks the payload against it before
signing. By default reads are not re-verified; with ``verify_reads`` (setting
``dram.verify_reads``) every server-side read and lease checks the block against its checksum
first; a block that fails is dropped, counted in ``corrupt_blocks`` and is a miss. The published
index then carries a checksum of each block too, which clients reading through it check
(:mod:`kvstore.protocol.dram_index`): a block that fails there takes the leased path, and so the
server's check.

Only the server writes the arena: once mapped here, the memfd is sealed against every new
writable mapping (``F_SEAL_FUTURE_WRITE``), so a client maps it read-only and cannot write,
truncate or punch holes in it, whatever its namespace; clients write blocks into windows of their
own that the server copies from (:mod:`kvstore.server.shm_window`).

Two things let a co-located client touch the pages directly (``kvstore.server.shm``):

* a **lease** (:meth:`DramTier.lease`) names the byte ranges of a resident block for a reader.
  Removing or replacing a leased block unindexes it at once but keeps its pages allocated until
  the last lease on it is released, so a reader never sees its bytes change under it;
* a **reservation** (:meth:`DramTier.reserve`) hands out free pages before there is a block: the
  client writes the payload into them, then :meth:`DramTier.install` makes them a block.

Resident blocks are also *published* (:mod:`kvstore.protocol.dram_index`): a client that finds a
block there copies it without asking the server and checks afterwards that the entry did not
change; a block is withdrawn from that index before its pages can be freed.

Where a CUDA device exists the arena is page-locked (``cudaHostRegister``) in the server's
process, so that its copies between the arena and GPU memory (the ``hbm`` tier) are DMAs at full
PCIe speed; elsewhere nothing changes. Registration holds for the registering process only: an
engine that maps the arena sees pageable memory, which is why CUDA engines load through their own
page-locked staging and never DMA from the arena in place.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.block import BlockHeader, CorruptBlockError
from kvstore.buffers import byte_view
from kvstore.protocol.dram_index import IndexWriter, payload_checksum
from kvstore.tiers.base import Buffer, StoredBlock
from kvstore.tiers.dram_memory import page_lock, page_unlock, seal_arena
from kvstore.tiers.dram_memory import prefault as prefault_arena
from kvstore.tiers.paged import PagedTier
from kvstore.tiers.pages import Extent

__all__ = ["DramLease", "DramTier", "Reservation"]

logger = logging.getLogger(__name__)


class _Resident:
    """A block's pages, and how many readers hold a lease on them."""

    __slots__ = ("extents", "header", "leases", "retired")

    def __init__(self, header: BlockHeader, extents: list[Extent]) -> None:
        self.header = header
        self.extents = extents
        self.leases = 0
        #: Removed or replaced while leased: the pages go back when the last lease does.
        self.retired = False


@dataclass(frozen=True, slots=True)
class DramLease:
    """A reader's hold on one block's pages; ``ranges`` are ``(offset, length)`` in the arena."""

    key: bytes
    ranges: list[tuple[int, int]]
    _resident: _Resident

    @property
    def header(self) -> BlockHeader:
        """The header the block was stored with (its checksum describes the leased pages)."""
        return self._resident.header


@dataclass(slots=True)
class Reservation:
    """Free pages handed out for a block of ``length`` bytes that a client is about to write."""

    length: int
    ranges: list[tuple[int, int]]
    _extents: list[Extent]
    open: bool = True


class DramTier(PagedTier):
    """Blocks in a page-allocated, memfd-backed host arena.

    The arena is page-locked for CUDA where ``/dev/nvidiactl`` exists, or, with
    ``force_cuda_check`` (setting ``dram.force_cuda_check``), wherever torch sees a CUDA device.
    """

    name = "dram"

    def __init__(
        self,
        capacity: int,
        page_size: int = 64 * 1024,
        *,
        force_cuda_check: bool = False,
        verify_reads: bool = False,
        prefault: bool = False,
    ) -> None:
        self.verify_reads = verify_reads
        self.corrupt_blocks = 0
        num_pages = self._init_pages(capacity, page_size)
        self._fd = -1
        self.index: IndexWriter | None = None
        if self.capacity:
            self._fd = os.memfd_create("kvstore-dram", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            os.ftruncate(self._fd, self.capacity)
            self._mapping: mmap.mmap | None = mmap.mmap(self._fd, self.capacity)
            # Clients get this fd: one that shrank it would crash the server on its next access,
            # one that wrote it could change any namespace's blocks; so: no resizing, no new
            # writable mapping (the one above stays), no more seals.
            self.sealed = seal_arena(self._fd)
            self._arena = np.frombuffer(self._mapping, dtype=np.uint8)
            if prefault:
                prefault_arena(self._mapping)
            self.index = IndexWriter(max_blocks=num_pages, checksums=verify_reads)
        else:
            self.sealed = False
            self._mapping = None
            self._arena = np.empty(0, dtype=np.uint8)
        self.pinned = page_lock(self._arena, force_cuda_check)
        self._blocks: dict[bytes, _Resident] = {}
        self._payload_bytes = 0
        self._leases = 0
        self._retired_bytes = 0
        self._reserved_bytes = 0

    @property
    def fd(self) -> int:
        """The memfd holding the arena (``-1`` when the tier has no capacity)."""
        return self._fd

    def extents(self, key: bytes) -> list[tuple[int, int]]:
        """Byte ranges ``(offset, length)`` of ``key``'s payload in the arena, in order."""
        resident = self._blocks[key]
        return self._ranges(resident.extents, resident.header.length)

    def write_sync(self, header: BlockHeader, payload: Buffer) -> bool:
        """:meth:`write` without the coroutine, for callers already on the event loop."""
        data = np.frombuffer(byte_view(payload), dtype=np.uint8)
        if len(data) != header.length:
            raise ValueError(f"payload is {len(data)} bytes, header says {header.length}")
        pages = self.footprint(header.length) // self.page_size
        old = self._blocks.get(header.key)
        # A leased block's pages stay allocated after replacement, so they are not reusable.
        reusable = 0
        if old is not None and not old.leases:
            reusable = sum(extent.pages for extent in old.extents)
        # Decide before freeing anything: False must leave a block being replaced intact. The
        # allocator succeeds whenever enough pages are free, so this check is exact.
        if pages > self._pages.free_pages + reusable:
            return False
        if old is not None:
            del self._blocks[header.key]
            self._forget(old)
        extents = self._pages.allocate(pages)
        assert extents is not None
        self._blocks[header.key] = _Resident(header, extents)
        self._payload_bytes += header.length
        copied = 0
        for offset, size in self.extents(header.key):
            self._arena[offset : offset + size] = data[copied : copied + size]
            copied += size
        self._publish(header, extents)
        return True

    async def write(self, header: BlockHeader, payload: Buffer) -> bool:
        """Copy a block into free pages; False if too few pages are free."""
        return self.write_sync(header, payload)

    def _resident(self, key: bytes) -> _Resident | None:
        """``key``'s block, checked against its checksum with ``verify_reads`` (else dropped)."""
        resident = self._blocks.get(key)
        if resident is None or not self.verify_reads:
            return resident
        parts = [
            self._arena[offset : offset + size].data
            for offset, size in self._ranges(resident.extents, resident.header.length)
        ]
        try:
            resident.header.verify_parts(parts)
        except CorruptBlockError as exc:
            logger.error("dropping corrupt dram block %s: %s", key.hex(), exc)
            self.corrupt_blocks += 1
            self.remove_sync([key])
            return None
        return resident

    def read_sync(self, key: bytes) -> StoredBlock | None:
        """One block copied out of the arena, or ``None``."""
        resident = self._resident(key)
        if resident is None:
            return None
        ranges = self.extents(key)
        if len(ranges) == 1:
            offset, size = ranges[0]
            return StoredBlock(resident.header, self._arena[offset : offset + size].tobytes())
        out = bytearray(resident.header.length)
        copied = 0
        for offset, size in ranges:
            out[copied : copied + size] = self._arena[offset : offset + size].data
            copied += size
        return StoredBlock(resident.header, bytes(out))

    def copy_into(self, key: bytes, destination: memoryview) -> bool:
        """Copy ``key``'s payload straight into ``destination``; False if absent or sizes differ."""
        resident = self._blocks.get(key)
        if resident is None or len(destination) != resident.header.length:
            return False
        if self._resident(key) is None:
            return False
        target = np.frombuffer(destination, dtype=np.uint8)
        copied = 0
        for offset, size in self.extents(key):
            target[copied : copied + size] = self._arena[offset : offset + size]
            copied += size
        return True

    def view(self, key: bytes) -> memoryview | None:
        """A zero-copy view of a single-run payload, else ``None``; valid until the block moves."""
        resident = self._blocks.get(key)
        if resident is None or len(resident.extents) != 1 or self._resident(key) is None:
            return None
        offset, size = self.extents(key)[0]
        return self._arena[offset : offset + size].data

    async def read(self, keys: Sequence[bytes]) -> list[StoredBlock | None]:
        """Copies of the payloads of ``keys``."""
        return [self.read_sync(key) for key in keys]

    def header(self, key: bytes) -> BlockHeader | None:
        """The header of a resident block, or ``None``."""
        resident = self._blocks.get(key)
        return None if resident is None else resident.header

    def remove_sync(self, keys: Sequence[bytes]) -> None:
        """:meth:`remove` without the coroutine."""
        for key in keys:
            resident = self._blocks.pop(key, None)
            if resident is not None:
                self._forget(resident)

    async def remove(self, keys: Sequence[bytes]) -> bool:
        """Free the pages of ``keys``; always succeeds."""
        self.remove_sync(keys)
        return True

    def scan(self) -> Iterator[BlockHeader]:
        """Headers of resident blocks (the arena does not survive a restart, so at start: none)."""
        return iter([resident.header for resident in self._blocks.values()])

    # -- direct access by co-located clients ----------------------------------------------

    def range_view(self, offset: int, length: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """A writable view (no copy) of arena bytes ``[offset, offset + length)``.

        For transports that move a lease's or a reservation's ranges themselves (UCX); valid while
        the caller holds that lease or reservation.
        """
        if offset < 0 or length < 0 or offset + length > self.capacity:
            raise ValueError(f"range {offset}+{length} is outside the {self.capacity}-byte arena")
        return self._arena[offset : offset + length]

    def lease(self, key: bytes) -> DramLease | None:
        """Hold ``key``'s pages for a reader until :meth:`release`; ``None`` if not resident."""
        resident = self._resident(key)
        if resident is None:
            return None
        resident.leases += 1
        self._leases += 1
        return DramLease(key, self._ranges(resident.extents, resident.header.length), resident)

    def release(self, lease: DramLease) -> None:
        """Give back one lease; frees the pages of a block removed while it was leased."""
        resident = lease._resident
        if resident.leases <= 0:
            raise ValueError(f"lease on {lease.key.hex()} released twice")
        resident.leases -= 1
        self._leases -= 1
        if resident.leases == 0 and resident.retired:
            self._retired_bytes -= self._footprint_of(resident)
            self._pages.release(resident.extents)

    def reserve(self, length: int) -> Reservation | None:
        """Pages for a block of ``length`` bytes, not yet a block; ``None`` if too few are free."""
        if length <= 0:
            raise ValueError(f"length must be > 0, got {length}")
        extents = self._pages.allocate(self.footprint(length) // self.page_size)
        if extents is None:
            return None
        self._reserved_bytes += self.footprint(length)
        return Reservation(length, self._ranges(extents, length), extents)

    def reserved_payload(self, reservation: Reservation) -> memoryview:
        """The bytes written into a reservation (a view if contiguous, else a copy)."""
        if len(reservation.ranges) == 1:
            offset, size = reservation.ranges[0]
            return self._arena[offset : offset + size].data
        return memoryview(
            b"".join(
                self._arena[offset : offset + size].data for offset, size in reservation.ranges
            )
        )

    def install(self, header: BlockHeader, reservation: Reservation) -> None:
        """Make a written reservation the block ``header`` describes, replacing any older one."""
        if not reservation.open:
            raise ValueError("reservation already installed or cancelled")
        if header.length != reservation.length:
            raise ValueError(f"header says {header.length} bytes, reserved {reservation.length}")
        reservation.open = False
        self._reserved_bytes -= self.footprint(reservation.length)
        old = self._blocks.pop(header.key, None)
        if old is not None:
            self._forget(old)
        self._blocks[header.key] = _Resident(header, reservation._extents)
        self._payload_bytes += header.length
        self._publish(header, reservation._extents)

    def cancel(self, reservation: Reservation) -> None:
        """Give back a reservation's pages (idempotent)."""
        if reservation.open:
            reservation.open = False
            self._reserved_bytes -= self.footprint(reservation.length)
            self._pages.release(reservation._extents)

    def stats(self) -> dict[str, int]:
        """Capacity, usage, block count, payload bytes, rounding waste and fragmentation.

        ``used`` includes pages that are reserved for puts in progress (``reserved_bytes``) and
        pages of removed blocks that readers still lease (``retired_bytes``). ``published``
        counts blocks in the index that clients read directly.
        """
        return {
            "capacity": self.capacity,
            "used": self.used,
            "blocks": len(self._blocks),
            "payload_bytes": self._payload_bytes,
            "wasted_bytes": self.used
            - self._payload_bytes
            - self._reserved_bytes
            - self._retired_bytes,
            "page_size": self.page_size,
            "free_runs": self._pages.free_runs,
            "leases": self._leases,
            "reserved_bytes": self._reserved_bytes,
            "retired_bytes": self._retired_bytes,
            "pinned": int(self.pinned),
            "corrupt_blocks": self.corrupt_blocks,
            # Blocks clients can read without the server, and ones left out for a full bucket.
            "published": len(self.index) if self.index is not None else 0,
            "publish_overflows": self.index.overflows if self.index is not None else 0,
        }

    async def close(self) -> None:
        """Unmap the arena and close the memfd (readers of the index are told first)."""
        if self.index is not None:
            self.index.close()
            self.index = None
        self._blocks.clear()
        if self.pinned:
            page_unlock(self._arena)
            self.pinned = False
        self._arena = np.empty(0, dtype=np.uint8)
        if self._mapping is not None:
            # A view may still be exported; then the mapping dies with the process.
            with contextlib.suppress(BufferError):
                self._mapping.close()
            self._mapping = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _footprint_of(self, resident: _Resident) -> int:
        return sum(extent.pages for extent in resident.extents) * self.page_size

    def _publish(self, header: BlockHeader, extents: Sequence[Extent]) -> None:
        """Let clients find a block that is one run of pages (others go through the server)."""
        if self.index is not None and len(extents) == 1:
            offset = extents[0].first * self.page_size
            checksum = 0
            if self.index.checksums:
                checksum = payload_checksum([self._arena[offset : offset + header.length].data])
            self.index.publish(header.key, header.namespace, offset, header.length, checksum)

    def _forget(self, resident: _Resident) -> None:
        """Account for an unindexed block; free its pages unless a reader still leases them."""
        if self.index is not None:
            # Before anything can reuse the pages: readers that copied them see the change.
            self.index.withdraw(resident.header.key)
        self._payload_bytes -= resident.header.length
        if resident.leases:
            resident.retired = True
            self._retired_bytes += self._footprint_of(resident)
        else:
            self._pages.release(resident.extents)
