"""Paged KV-cache gather/scatter: an engine's per-layer block tensors <-> contiguous chunk buffers.

Public API::

    gather_blocks(layer_caches, block_ids, layout, out=None, *, impl="auto") -> Tensor
    scatter_blocks(buffer, layer_caches, block_ids, layout, *, impl="auto") -> None
    chunk_nbytes(cache_shape, dtype, num_layers, blocks_per_chunk, layout) -> int
    CacheLayout(name, block_dim, ndim=None), CUDA_LAYOUT, CPU_LAYOUT

A buffer holds ``[num_layers, len(block_ids), *block_shape]``: layer-major, then blocks in the
order listed, each block exactly as it sits in the cache (see :mod:`.layout`).

``impl="auto"`` runs the Triton kernels (one launch for all layers) on CUDA caches when triton
imports and the caches qualify (:func:`.triton_kernels.supports`), and the torch reference
otherwise; ``impl="torch"`` / ``impl="triton"`` force one. Both raise the same ``ValueError``s.
Triton is imported only when a CUDA call first needs it, so this package imports without it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Literal

import torch

from . import reference
from ._checks import BlockIds, check_caches
from .layout import CPU_LAYOUT, CUDA_LAYOUT, CacheLayout, chunk_nbytes

__all__ = [
    "CPU_LAYOUT",
    "CUDA_LAYOUT",
    "BlockIds",
    "CacheLayout",
    "Impl",
    "chunk_nbytes",
    "gather_blocks",
    "scatter_blocks",
]

logger = logging.getLogger(__name__)

Impl = Literal["auto", "torch", "triton"]
"""Implementation choice: ``"auto"`` (Triton on CUDA when possible), ``"torch"``, ``"triton"``."""


@functools.cache
def _triton_importable() -> bool:
    try:
        from . import triton_kernels  # noqa: F401
    except ImportError as exc:
        logger.debug("triton unavailable, using the torch reference: %s", exc)
        return False
    return True


def _use_triton(impl: str, layer_caches: Sequence[torch.Tensor], layout: CacheLayout) -> bool:
    if impl == "torch":
        return False
    if impl == "triton":
        if not _triton_importable():
            raise ValueError("impl='triton' needs the triton package, which does not import")
        return True
    if impl != "auto":
        raise ValueError(f"impl must be 'auto', 'torch' or 'triton', got {impl!r}")
    first = check_caches(layer_caches, layout)
    if first.device.type != "cuda" or not _triton_importable():
        return False
    from . import triton_kernels

    return triton_kernels.supports(layer_caches, layout)


def gather_blocks(
    layer_caches: Sequence[torch.Tensor],
    block_ids: BlockIds,
    layout: CacheLayout,
    out: torch.Tensor | None = None,
    *,
    impl: Impl = "auto",
) -> torch.Tensor:
    """Copy blocks ``block_ids`` of every layer cache into one contiguous buffer.

    Returns ``out`` (or a new tensor) of shape
    ``[len(layer_caches), len(block_ids), *layout.block_shape(cache.shape)]`` where
    ``result[l, i]`` is block ``block_ids[i]`` of layer ``l``. See
    :func:`kvstore_kernels.reference.gather_blocks` for the arguments.

    Raises:
        ValueError: on mismatched caches, ids out of range, a wrongly shaped ``out``, or an
            ``impl`` that cannot run here.
    """
    if _use_triton(impl, layer_caches, layout):
        from . import triton_kernels

        return triton_kernels.gather_blocks(layer_caches, block_ids, layout, out)
    return reference.gather_blocks(layer_caches, block_ids, layout, out)


def scatter_blocks(
    buffer: torch.Tensor,
    layer_caches: Sequence[torch.Tensor],
    block_ids: BlockIds,
    layout: CacheLayout,
    *,
    impl: Impl = "auto",
) -> None:
    """Copy a gathered buffer back into blocks ``block_ids`` of every layer cache, in place.

    The exact reverse of :func:`gather_blocks`; blocks not listed are never touched. See
    :func:`kvstore_kernels.reference.scatter_blocks` for the arguments.

    Raises:
        ValueError: on mismatched caches or buffer, ids out of range or repeated, or an
            ``impl`` that cannot run here.
    """
    if _use_triton(impl, layer_caches, layout):
        from . import triton_kernels

        triton_kernels.scatter_blocks(buffer, layer_caches, block_ids, layout)
        return
    reference.scatter_blocks(buffer, layer_caches, block_ids, layout)
