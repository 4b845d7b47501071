"""``ArenaLanding``: arena pages a remote source receives blocks into, placed with no copy.

A promotion of keys this node does not index (:meth:`BlockReader.promote`, what a shared-memory or
UCX reader's acquire runs) hands its remote source one landing. Once the source knows the lengths
of the blocks a peer is about to send, it asks :meth:`ArenaLanding.buffers` for room: pages of
the host tier, reserved (not yet a block; eviction makes room for them as for a put). The
transport receives into them; a block it received whole and the source accepted is then
:meth:`~ArenaLanding.install`-ed in place: checksummed over the received bytes (xxh3, as every
block placed here is) and made a block of the host tier, counted as a promotion like a copied
one, and in ``landed_blocks``. Everything else is given back when the promotion ends
(:meth:`~ArenaLanding.close`).

**A failed transfer.** Pages a receive may still write into (a transfer that failed, ran late or
was cancelled; the transport aborts its endpoint) are :meth:`~ArenaLanding.abandon`-ed: given back
only :data:`ABANDON_S` later, so that no late byte can land in a block that reuses them.

A block the arena cannot take in one run of pages (no room, fragmented free pages, or already
held here) gets no buffer: the source receives it into memory of its own and the store copies it
in as before.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from kvstore.block import BlockHeader
from kvstore.store.counters import StoreCounters
from kvstore.store.index import BlockIndex
from kvstore.store.layout import TierStack
from kvstore.store.mover import BlockMover
from kvstore.tiers.dram import DramTier, Reservation

__all__ = ["ABANDON_S", "ArenaLanding"]

logger = logging.getLogger(__name__)

#: How long pages of a failed transfer stay reserved before they are given back.
ABANDON_S = 5.0


class ArenaLanding:
    """Reserved host-tier pages for the blocks of one promotion's remote read."""

    def __init__(
        self,
        arena: DramTier,
        stack: TierStack,
        index: BlockIndex,
        counters: StoreCounters,
        mover: BlockMover,
    ) -> None:
        self._arena = arena
        self._stack = stack
        self._index = index
        self._counters = counters
        self._mover = mover
        #: Open reservations by key, and the buffer (a view of its pages) handed out for each.
        self._open: dict[bytes, tuple[Reservation, Any]] = {}

    async def buffers(self, keys: Sequence[bytes], lengths: Sequence[int]) -> list[Any | None]:
        """A writable buffer of exactly ``lengths[i]`` bytes in the host tier for each key, or
        ``None`` where the arena cannot take it in one run of pages or already holds the key."""
        arena, host = self._arena, self._stack.host_level
        out: list[Any | None] = []
        async with self._mover.lock:
            for key, length in zip(keys, lengths, strict=True):
                reservation = None
                if key not in self._index and key not in self._open and length > 0:
                    footprint = arena.footprint(length)
                    if footprint <= arena.capacity and await self._mover.make_room(host, footprint):
                        reservation = arena.reserve(length)
                if reservation is not None and len(reservation.ranges) != 1:
                    arena.cancel(reservation)  # one message per block: it needs one run
                    reservation = None
                if reservation is None:
                    out.append(None)
                    continue
                view = arena.range_view(*reservation.ranges[0])
                self._open[key] = (reservation, view)
                out.append(view)
        return out

    def holds(self, key: bytes, payload: object) -> bool:
        """True if ``payload`` is the buffer :meth:`buffers` handed out for ``key``."""
        entry = self._open.get(key)
        return entry is not None and entry[1] is payload

    def abandon(self, keys: Sequence[bytes]) -> None:
        """Give back ``keys``' pages only :data:`ABANDON_S` from now (a receive into them may
        still be under way)."""
        late = [self._open.pop(key)[0] for key in keys if key in self._open]
        if late:
            asyncio.get_running_loop().call_later(ABANDON_S, self._cancel, late)

    async def install(self, key: bytes, namespace: bytes) -> bool:
        """Make ``key``'s received pages a block of the host tier (checksummed now); True if it
        is held here now (by this or by a copy stored meanwhile under ``namespace``)."""
        reservation, _ = self._open.pop(key)
        arena, index = self._arena, self._index
        async with self._mover.lock:
            meta = index.meta.get(key)
            if meta is not None:  # stored or fetched meanwhile
                arena.cancel(reservation)
                return meta.namespace == namespace
            payload = arena.reserved_payload(reservation)
            header = BlockHeader.for_payload(key, namespace, payload)
            arena.install(header, reservation)
            index.add(
                key,
                namespace,
                header.length,
                self._stack.host_level,
                arena.footprint(header.length),
            )
            self._counters.written_bytes[arena.name] += header.length
            self._counters.add("promotions")
            self._counters.promotions[arena.name] += 1
            self._counters.add("landed_blocks")
            return True

    def close(self) -> None:
        """Give back every reservation not installed (their transfers ended)."""
        open_, self._open = self._open, {}
        self._cancel([reservation for reservation, _ in open_.values()])

    def _cancel(self, reservations: list[Reservation]) -> None:
        for reservation in reservations:
            self._arena.cancel(reservation)
