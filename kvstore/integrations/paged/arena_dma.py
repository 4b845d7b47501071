"""The direct path on CUDA: DMA between the store's arena and device memory, planned per layer.

A stored chunk is ``[layers, kernel blocks, *block]``, so "layer n of every chunk of a step" is
one row of ``layer bytes`` per chunk, at ``n * layer bytes`` into each chunk. Chunks stored one
after another in the arena are at equal distances, so the rows of one layer are too, and ONE
strided DMA (``cudaMemcpy2DAsync``) moves them all into the layer's device staging, where they
land back to back. :func:`plan_rows` turns a layer's rows into as few such copies as the arena
allows: it merges rows at equal distances that land one after another, and cuts rows (and never
merges across) where one page-locked piece of the arena ends and another begins, since each
registration is its own pinned range to the driver.

:func:`arena_source` decides whether a step's leased chunks can take this path (every one whole
and inside registered pieces of the mapping); the load pipeline
(:mod:`kvstore.integrations.paged.device_pipeline`) issues the copies on its DMA stream, layer by
layer, and the saves (:mod:`kvstore.integrations.vllm.saves`) gather a job's chunks on the device
in one launch and DMA each chunk straight into its reserved arena pages (:func:`save_rows`: one
strided copy per chunk, its layers being rows of the gathered buffer).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.client.arena_registration import ArenaRegistration

__all__ = ["ArenaSource", "RowCopy", "arena_source", "plan_rows", "save_rows"]

#: The largest pitch a 2D copy takes (CUDA's ``cudaDevAttrMaxPitch`` is at least this).
MAX_PITCH = (1 << 31) - 1

#: Cuts a host range into ``(address, nbytes, piece)`` parts, each inside one pinned piece.
Cut = Callable[[int, int], list[tuple[int, int, int]]]


@dataclass(frozen=True, slots=True)
class RowCopy:
    """``height`` rows of ``width`` bytes between host memory at ``host`` (rows ``host_pitch``
    apart) and device memory at byte ``device`` of a buffer (rows ``device_pitch`` apart): one
    DMA, either way."""

    host: int
    host_pitch: int
    device: int
    device_pitch: int
    width: int
    height: int


def plan_rows(rows: Sequence[tuple[int, int]], width: int, cut: Cut) -> list[RowCopy]:
    """Copies for ``rows`` (``(host address, device offset)``, ``width`` bytes each).

    Each row is cut where a page-locked piece ends (on the host side); consecutive parts merge
    into one copy while they have the same width and piece and both sides keep one distance
    (at least the width, at most :data:`MAX_PITCH`).
    """
    copies: list[RowCopy] = []
    last_piece = -1
    for host, device in rows:
        offset = 0
        for address, nbytes, piece in cut(host, width):
            at = device + offset
            offset += nbytes
            if copies and piece == last_piece and copies[-1].width == nbytes:
                run = copies[-1]
                host_pitch = address - run.host if run.height == 1 else run.host_pitch
                device_pitch = at - run.device if run.height == 1 else run.device_pitch
                if (
                    nbytes <= host_pitch <= MAX_PITCH
                    and nbytes <= device_pitch <= MAX_PITCH
                    and address == run.host + run.height * host_pitch
                    and at == run.device + run.height * device_pitch
                ):
                    copies[-1] = RowCopy(
                        run.host, host_pitch, run.device, device_pitch, nbytes, run.height + 1
                    )
                    continue
            copies.append(RowCopy(address, nbytes, at, nbytes, nbytes, 1))
            last_piece = piece
    return copies


@dataclass(slots=True)
class ArenaSource:
    """A step's chunks leased in the arena, in page-locked pieces: where each layer's DMA reads.

    ``addresses[c]`` is chunk ``c``'s first byte (``None``: it failed and is not copied).
    """

    addresses: list[int | None]
    layer_nbytes: int
    registration: ArenaRegistration

    def layer_copies(self, layer: int) -> list[RowCopy]:
        """The DMAs that move ``layer`` of every chunk into staging ``[chunks, layer bytes]``
        (device offsets into that layer's staging)."""
        width = self.layer_nbytes
        rows = [
            (address + layer * width, chunk * width)
            for chunk, address in enumerate(self.addresses)
            if address is not None
        ]
        return plan_rows(rows, width, self.registration.cut)


def arena_source(
    views: Sequence[Any], registration: ArenaRegistration | None, chunk_nbytes: int, layers: int
) -> ArenaSource | None:
    """The leased ``views`` as an :class:`ArenaSource`, or ``None`` where some chunk's pages
    are not page-locked yet (those are asked for first, so a later step finds them). A view
    that is missing or not a chunk's size is a failed chunk. On success the registration has
    been entered: leave it once the DMAs are complete."""
    if registration is None:
        return None
    addresses = registration.enter_blocks(views, [chunk_nbytes] * len(views))
    if addresses is None:
        return None
    return ArenaSource(addresses, chunk_nbytes // layers, registration)


def save_rows(addresses: Sequence[int], layers: int, layer_nbytes: int) -> list[tuple[int, int]]:
    """Rows of a save: chunk ``i`` of a gathered buffer ``[layers, chunks, layer bytes]`` to
    its reserved pages at ``addresses[i]`` (``[layers, layer bytes]``), chunk by chunk."""
    stride = len(addresses) * layer_nbytes  # between one layer's rows and the next's
    return [
        (address + layer * layer_nbytes, layer * stride + chunk * layer_nbytes)
        for chunk, address in enumerate(addresses)
        for layer in range(layers)
    ]
