"""Block plans of a paged KV cache, free of any engine and of torch so that they are tested alone.

A stored chunk is ``blocks_per_chunk`` engine blocks, and an engine block may be ``ratio`` kernel
blocks (attention kernels may split it). A :class:`LoadSpec` names, for every block of its
chunks, the engine block to write or ``-1`` for one the engine already holds; these functions
turn requests' block lists into such specs (scheduler half) and specs into the kernel block ids
that are written (worker half).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstore.retention import KEEP, Retention

__all__ = [
    "CopyRun",
    "LoadSpec",
    "SaveSpec",
    "ScatterPlan",
    "chunk_blocks",
    "copy_runs",
    "kernel_ids",
    "load_targets",
    "plan_scatter",
]


@dataclass(slots=True)
class LoadSpec:
    """Load chunks ``keys`` of one request into its blocks.

    ``block_ids[i * blocks_per_chunk + j]`` receives block ``j`` of chunk ``i``, or nothing where
    it is ``-1`` (blocks the engine already holds from its own prefix cache, and placeholder
    blocks such as vLLM's null block). ``group`` is the KV cache group the blocks belong to
    (:mod:`kvstore.integrations.paged.groups`). ``tokens``: the prompt tokens the load brings
    the request (a sliding window writes fewer blocks than that), or ``-1`` to count them from
    the blocks written.
    """

    req_id: str
    keys: list[bytes]
    block_ids: list[int]
    group: int = 0
    tokens: int = -1


@dataclass(slots=True)
class SaveSpec:
    """Store chunks ``keys`` of one request, read from ``block_ids`` (all blocks of each chunk),
    with the request's ``retention``, in KV cache group ``group``."""

    req_id: str
    keys: list[bytes]
    block_ids: list[int]
    retention: Retention = KEEP
    group: int = 0


def load_targets(
    block_ids: Sequence[int],
    start: int,
    end: int,
    chunk_size: int,
    block_size: int,
    blocks_per_chunk: int,
) -> tuple[range, list[int]]:
    """Where loading tokens ``[start, end)`` of a request with blocks ``block_ids`` lands.

    Returns the chunks the range touches and, for every block of those chunks, the request's
    block to write, or ``-1`` for a block outside the range (the engine computed it or holds it
    from its own prefix cache, so it must not be written).
    """
    first_chunk, end_chunk = start // chunk_size, math.ceil(end / chunk_size)
    first_block, end_block = start // block_size, math.ceil(end / block_size)
    targets = [
        block_ids[b] if first_block <= b < end_block and b < len(block_ids) else -1
        for b in range(first_chunk * blocks_per_chunk, end_chunk * blocks_per_chunk)
    ]
    return range(first_chunk, end_chunk), targets


def chunk_blocks(block_ids: Sequence[int], index: int, blocks_per_chunk: int) -> list[int]:
    """The entries of ``block_ids`` that belong to chunk ``index``."""
    return list(block_ids[index * blocks_per_chunk : (index + 1) * blocks_per_chunk])


def kernel_ids(block_ids: Sequence[int], ratio: int) -> list[int]:
    """The kernel blocks of engine blocks ``block_ids`` when one engine block is ``ratio``."""
    if ratio == 1:
        return list(block_ids)
    return [b * ratio + i for b in block_ids for i in range(ratio)]


@dataclass(slots=True)
class ScatterPlan:
    """How one step's loaded chunks are written into the cache.

    Chunks are numbered by their position in the step (every spec's chunks, in order).
    """

    #: Chunks written whole, all with one kernel call per layer ...
    whole: list[int] = field(default_factory=list)
    #: ... into these kernel blocks, in order.
    whole_ids: list[int] = field(default_factory=list)
    #: Chunks only partly new to the engine, written one by one: (position, spec, index in spec).
    partial: list[tuple[int, LoadSpec, int]] = field(default_factory=list)


def plan_scatter(
    specs: Sequence[LoadSpec], ok: Sequence[bool], blocks_per_chunk: int, ratio: int
) -> ScatterPlan:
    """Sort the chunks that loaded (``ok``, by position) into whole and partly new ones."""
    plan = ScatterPlan()
    chunk = 0
    for spec in specs:
        for index in range(len(spec.keys)):
            if ok[chunk]:
                targets = chunk_blocks(spec.block_ids, index, blocks_per_chunk)
                if len(targets) == blocks_per_chunk and all(b >= 0 for b in targets):
                    plan.whole.append(chunk)
                    plan.whole_ids.extend(kernel_ids(targets, ratio))
                else:
                    plan.partial.append((chunk, spec, index))
            chunk += 1
    if len(set(plan.whole_ids)) != len(plan.whole_ids):  # never expected; stay exact anyway
        chunks = [(spec, index) for spec in specs for index in range(len(spec.keys))]
        partial = [(chunk, spec, index) for chunk, (spec, index) in enumerate(chunks) if ok[chunk]]
        return ScatterPlan(partial=partial)
    return plan


#: ``(chunk, first row, first kernel block, count)``: rows ``row .. row+count-1`` of a loaded
#: chunk (its kernel blocks, in stored order) land in kernel blocks ``block .. block+count-1``.
CopyRun = tuple[int, int, int, int]


def copy_runs(plan: ScatterPlan, blocks_per_chunk: int, ratio: int) -> list[CopyRun]:
    """``plan`` as runs of consecutive rows of one chunk landing in consecutive kernel blocks.

    A fresh engine's allocator hands out consecutive blocks, so a loaded prefix is usually one
    run per chunk: one slice copy per chunk and layer, straight from the loaded chunk into the
    cache, with no gathered intermediate.
    """
    per_chunk = blocks_per_chunk * ratio
    rows: list[tuple[int, int, int]] = []  # (chunk, row, kernel block)
    for at, chunk in enumerate(plan.whole):
        ids = plan.whole_ids[at * per_chunk : (at + 1) * per_chunk]
        rows.extend((chunk, row, block) for row, block in enumerate(ids))
    for chunk, spec, index in plan.partial:
        for j, block in enumerate(chunk_blocks(spec.block_ids, index, blocks_per_chunk)):
            if block >= 0:  # -1: a block the engine holds already; never written
                rows.extend((chunk, j * ratio + i, block * ratio + i) for i in range(ratio))
    runs: list[CopyRun] = []
    for chunk, row, block in rows:
        if runs:
            last = runs[-1]
            if last[0] == chunk and last[1] + last[3] == row and last[2] + last[3] == block:
                runs[-1] = (chunk, last[1], last[2], last[3] + 1)
                continue
        runs.append((chunk, row, block, 1))
    return runs
