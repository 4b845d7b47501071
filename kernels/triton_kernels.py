"""Triton implementation of the paged gather/scatter: one kernel launch per call, all layers.

Same contract as :mod:`kvstore_kernels.reference`. Importing this module imports triton; the
package imports it lazily, so ``kvstore_kernels`` works without triton installed.

How it works. A layer cache viewed as ``[outer, num_blocks, inner]`` (``outer`` = product of the
dims before the block dim, ``inner`` = product of those after) turns every block into ``outer``
contiguous *rows* of ``inner`` elements; the buffer ``[layers, ids, outer, inner]`` is the same
rows packed densely. The kernel's grid is ``(layers * ids * outer, tiles per row)``: each
program copies one tile of one row. The layers are separate allocations, so their base
addresses travel in an int64 tensor and are cast to pointers inside the kernel; that is what
lets one launch cover every layer. Rows are copied as the widest integer word (8/4/2/1 bytes)
that divides every address, stride and row length: dtype-agnostic (bf16 and fp8 included) and
as few memory transactions as the unknown alignment of those loaded addresses allows.

Requirements beyond the reference: every layer cache must be viewable as
``[outer, num_blocks, inner]`` with unit inner stride (true for contiguous caches, and for the
K/V-split ones vLLM allocates), all layers with the same strides, and the tensors on CUDA (or on
CPU under ``TRITON_INTERPRET=1``). :func:`supports` tells whether a set of caches qualifies.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import torch
import triton
import triton.language as tl

from ._checks import (
    BlockIds,
    check_block_ids,
    check_buffer,
    check_caches,
    output_buffer,
    to_device_async,
)
from .layout import CacheLayout

__all__ = ["DEFAULT_TILE_BYTES", "gather_blocks", "scatter_blocks", "supports"]

DEFAULT_TILE_BYTES = 16384
"""Bytes one program copies per row tile (before rounding to a power-of-two word count)."""

_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no type information
def _copy_rows_kernel(
    layer_addrs: tl.tensor,
    block_ids: tl.tensor,
    buf: tl.tensor,
    num_ids: tl.tensor,
    outer: tl.tensor,
    row_words: tl.tensor,
    stride_outer: tl.tensor,
    stride_block: tl.tensor,
    TO_CACHE: tl.constexpr,
    BLOCK: tl.constexpr,
) -> None:
    # int64 index math throughout: a layer cache can exceed 2**31 words.
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1).to(tl.int64)
    o = row % outer
    layer = row // outer // num_ids
    block = tl.load(block_ids + (row // outer) % num_ids)
    cache = tl.load(layer_addrs + layer).to(buf.dtype)
    cache_row = cache + o * stride_outer + block * stride_block
    buf_row = buf + row * row_words
    offs = tile * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_words
    if TO_CACHE:
        tl.store(cache_row + offs, tl.load(buf_row + offs, mask=mask), mask=mask)
    else:
        tl.store(buf_row + offs, tl.load(cache_row + offs, mask=mask), mask=mask)


def _rows_view(cache: torch.Tensor, layout: CacheLayout) -> torch.Tensor | None:
    """``cache`` as ``[outer, num_blocks, inner]`` with unit inner stride, or ``None``."""
    dim = layout.block_dim
    outer = int(torch.Size(cache.shape[:dim]).numel())
    inner = int(torch.Size(cache.shape[dim + 1 :]).numel())
    try:
        rows = cache.view(outer, cache.shape[dim], inner)
    except RuntimeError:
        return None
    return rows if inner == 1 or rows.stride(2) == 1 else None


def supports(layer_caches: Sequence[torch.Tensor], layout: CacheLayout) -> bool:
    """Whether the Triton kernels can handle these (already validated) layer caches."""
    first = layer_caches[0]
    if first.device.type != "cuda" and not triton.knobs.runtime.interpret:
        return False
    rows = _rows_view(first, layout)
    return rows is not None and all(cache.stride() == first.stride() for cache in layer_caches[1:])


def _word_size(rows: torch.Tensor, caches: Sequence[torch.Tensor], buffer: torch.Tensor) -> int:
    """Widest word (bytes) dividing the row length, both strides and every base address."""
    itemsize = rows.element_size()
    sizes = [rows.shape[2] * itemsize, rows.stride(0) * itemsize, rows.stride(1) * itemsize]
    sizes += [t.data_ptr() for t in (*caches, buffer)]
    # The buffer is reinterpreted with Tensor.view(dtype), which checks its storage offset too.
    sizes.append(int(buffer.storage_offset()) * itemsize)
    return next(w for w in (8, 4, 2, 1) if all(s % w == 0 for s in sizes))


def _launch(
    buffer: torch.Tensor,
    layer_caches: Sequence[torch.Tensor],
    ids: torch.Tensor,
    layout: CacheLayout,
    *,
    to_cache: bool,
    tile_bytes: int,
) -> None:
    first = layer_caches[0]
    if not supports(layer_caches, layout):
        raise ValueError(
            "triton gather/scatter needs CUDA tensors (or TRITON_INTERPRET=1) and layer caches "
            "viewable as [outer, num_blocks, inner] with equal strides; use impl='torch'"
        )
    if tile_bytes <= 0:
        raise ValueError(f"tile_bytes must be > 0, got {tile_bytes}")
    if buffer.numel() == 0:  # no ids, or zero-sized blocks: nothing to launch
        return
    rows = _rows_view(first, layout)
    assert rows is not None  # guaranteed by supports()
    word = _word_size(rows, layer_caches, buffer)
    itemsize = first.element_size()
    words = buffer.view(-1).view(torch.uint8).view(_WORD_DTYPES[word])
    row_words = rows.shape[2] * itemsize // word
    # tl.arange needs a power of two: round the tile down, but never past the row's own size.
    tile_words = 1 << (max(1, tile_bytes // word).bit_length() - 1)
    block = min(triton.next_power_of_2(row_words), tile_words)
    # Grid axis 1 is capped at 65535 programs; very long rows get larger tiles instead.
    block = max(block, triton.next_power_of_2(triton.cdiv(row_words, 65535)))
    device = first.device
    addrs = to_device_async(
        torch.tensor([c.data_ptr() for c in layer_caches], dtype=torch.int64), device
    )
    grid = (len(layer_caches) * ids.numel() * rows.shape[0], triton.cdiv(row_words, block))
    guard: Any = torch.cuda.device(device) if device.type == "cuda" else nullcontext()
    with guard:
        _copy_rows_kernel[grid](
            addrs,
            to_device_async(ids, device),
            words,
            ids.numel(),
            rows.shape[0],
            row_words,
            rows.stride(0) * itemsize // word,
            rows.stride(1) * itemsize // word,
            TO_CACHE=to_cache,
            BLOCK=block,
        )


def gather_blocks(
    layer_caches: Sequence[torch.Tensor],
    block_ids: BlockIds,
    layout: CacheLayout,
    out: torch.Tensor | None = None,
    *,
    tile_bytes: int = DEFAULT_TILE_BYTES,
) -> torch.Tensor:
    """Triton twin of :func:`kvstore_kernels.reference.gather_blocks` (one launch, all layers).

    ``tile_bytes`` bounds the bytes each program copies; raise it to get fewer, larger
    programs (the CPU interpreter pays per program).
    """
    first = check_caches(layer_caches, layout)
    ids = check_block_ids(block_ids, layout.num_blocks(first.shape), unique=False)
    shape = layout.buffer_shape(first.shape, len(layer_caches), ids.numel())
    result = output_buffer(out, shape, first)
    _launch(result, layer_caches, ids, layout, to_cache=False, tile_bytes=tile_bytes)
    return result


def scatter_blocks(
    buffer: torch.Tensor,
    layer_caches: Sequence[torch.Tensor],
    block_ids: BlockIds,
    layout: CacheLayout,
    *,
    tile_bytes: int = DEFAULT_TILE_BYTES,
) -> None:
    """Triton twin of :func:`kvstore_kernels.reference.scatter_blocks` (one launch, all layers).

    A non-contiguous ``buffer`` is first copied to a contiguous one.
    """
    first = check_caches(layer_caches, layout)
    ids = check_block_ids(block_ids, layout.num_blocks(first.shape), unique=True)
    shape = layout.buffer_shape(first.shape, len(layer_caches), ids.numel())
    check_buffer(buffer, shape, first, name="buffer")
    src = buffer.contiguous()
    _launch(src, layer_caches, ids, layout, to_cache=True, tile_bytes=tile_bytes)
