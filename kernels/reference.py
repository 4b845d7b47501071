"""Torch reference implementation of the paged gather/scatter.

``gather_blocks`` copies the listed blocks of every layer into one contiguous buffer of shape
``[num_layers, len(block_ids), *block_shape]``; ``scatter_blocks`` copies such a buffer back into
the listed blocks, in place. Runs wherever torch runs (CPU and CUDA, any dtype, caches of any
strides) and is the definition the Triton kernels are tested against. On CUDA: one
``index_select`` / ``index_copy_`` per layer, ``num_layers`` launches per call. On the CPU, ids
that follow each other (block ``b``, ``b+1``, ...: what a fresh engine's allocator hands out, and
the common case for a loaded prefix) are copied as one slice each: a plain ``copy_`` of a run
moves memory about three times faster than ``index_copy_`` / ``index_select`` of the same blocks
on vLLM's CPU build (bf16, 2 cores), and the scatter sits on a loaded request's time to first
token.

Off the process's main thread, CPU copies go through numpy instead of ``copy_`` (see
:func:`_copy_cpu`): vLLM's CPU worker pins its OpenMP threads to cores, and a large ``copy_``
started from another thread (the connector's save and load threads) opens an OpenMP region of its
own that was seen to never finish there, holding a save's engine blocks for good.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import torch

from ._checks import (
    BlockIds,
    check_block_ids,
    check_buffer,
    check_caches,
    output_buffer,
    to_device_async,
)
from .layout import CacheLayout, chunk_nbytes

__all__ = ["SAME_WIDTH", "chunk_nbytes", "gather_blocks", "scatter_blocks"]


def gather_blocks(
    layer_caches: Sequence[torch.Tensor],
    block_ids: BlockIds,
    layout: CacheLayout,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Copy blocks ``block_ids`` of every layer cache into one contiguous buffer.

    Args:
        layer_caches: One tensor per layer, all of the same shape, dtype and device.
        block_ids: Blocks to copy, in buffer order; repeats are allowed.
        layout: Which cache dimension indexes blocks.
        out: Optional contiguous destination of shape
            ``[len(layer_caches), len(block_ids), *layout.block_shape(cache.shape)]``.

    Returns:
        ``out`` (or a new tensor); ``result[l, i]`` is block ``block_ids[i]`` of layer ``l``.

    Raises:
        ValueError: on mismatched caches, ids out of range, or a wrongly shaped ``out``.
    """
    first = check_caches(layer_caches, layout)
    ids = check_block_ids(block_ids, layout.num_blocks(first.shape), unique=False)
    shape = layout.buffer_shape(first.shape, len(layer_caches), ids.numel())
    result = output_buffer(out, shape, first)
    dim = layout.block_dim
    if first.device.type == "cpu":
        runs = _runs(ids)
        for layer, cache in enumerate(layer_caches):
            blocks, out_layer = cache.movedim(dim, 0), result[layer]
            for at, start, count in runs:
                _copy_cpu(out_layer[at : at + count], blocks[start : start + count])
        return result
    index = to_device_async(ids, first.device)
    for layer, cache in enumerate(layer_caches):
        # Moving the block dim to the front makes the selection land in buffer order, and
        # index_select's out= writes it straight into the buffer without a temporary.
        torch.index_select(cache.movedim(dim, 0), 0, index, out=result[layer])
    return result


def scatter_blocks(
    buffer: torch.Tensor,
    layer_caches: Sequence[torch.Tensor],
    block_ids: BlockIds,
    layout: CacheLayout,
) -> None:
    """Copy a gathered buffer back into blocks ``block_ids`` of every layer cache, in place.

    The exact reverse of :func:`gather_blocks`: ``buffer[l, i]`` is written to block
    ``block_ids[i]`` of layer ``l``; no other block is touched.

    Args:
        buffer: Shape ``[len(layer_caches), len(block_ids), *block_shape]``, same dtype and
            device as the caches (any strides).
        layer_caches: One tensor per layer, all of the same shape, dtype and device.
        block_ids: Destination blocks, in buffer order; each id at most once.
        layout: Which cache dimension indexes blocks.

    Raises:
        ValueError: on mismatched caches or buffer, ids out of range, or repeated ids.
    """
    first = check_caches(layer_caches, layout)
    ids = check_block_ids(block_ids, layout.num_blocks(first.shape), unique=True)
    shape = layout.buffer_shape(first.shape, len(layer_caches), ids.numel())
    check_buffer(buffer, shape, first, name="buffer")
    dim = layout.block_dim
    if first.device.type == "cpu":
        runs = _runs(ids)
        for layer, cache in enumerate(layer_caches):
            # movedim returns a view, so the slices are the cache's own storage.
            blocks, src = cache.movedim(dim, 0), buffer[layer]
            for at, start, count in runs:
                _copy_cpu(blocks[start : start + count], src[at : at + count])
        return
    index = to_device_async(ids, first.device)
    for layer, cache in enumerate(layer_caches):
        # movedim returns a view, so index_copy_ writes into the cache's own storage.
        cache.movedim(dim, 0).index_copy_(0, index, buffer[layer])


#: Integer dtypes of each element width: numpy has no bfloat16 or float8, and a copy moves bits
#: (also the connector's numpy copies, ``kvstore.integrations.paged.host_copies``).
SAME_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _copy_cpu(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[...] = src`` for CPU tensors of one shape and dtype.

    On the main thread this is ``copy_`` (parallel over torch's intra-op threads). On any other
    thread it is numpy's single-threaded ``copyto`` of same-width integer views, which never
    enters an OpenMP region (see the module docstring); it moves memory about half as fast.
    """
    width = SAME_WIDTH.get(dst.element_size())
    if threading.current_thread() is threading.main_thread() or width is None:
        dst.copy_(src)
        return
    np.copyto(dst.view(width).numpy(), src.view(width).numpy())


def _runs(ids: torch.Tensor) -> list[tuple[int, int, int]]:
    """``ids`` cut into runs of consecutive block ids: ``(buffer position, first id, count)``."""
    runs: list[tuple[int, int, int]] = []
    at = 0
    values = ids.tolist()
    while at < len(values):
        count = 1
        while at + count < len(values) and values[at + count] == values[at] + count:
            count += 1
        runs.append((at, values[at], count))
        at += count
    return runs
