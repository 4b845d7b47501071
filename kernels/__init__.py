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
Where a Triton kernel cannot be built or launched here (Triton compiles a small C launcher on
first use, which needs a C compiler and Python's headers), ``"auto"`` logs why once and uses the
torch reference from then on.
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


#: Why the Triton kernels failed here (``"auto"`` then runs the torch reference); None: they work.
_triton_failed: str | None = None


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
    if first.device.type != "cuda" or _triton_failed is not None or not _triton_importable():
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

        try:
            return triton_kernels.gather_blocks(layer_caches, block_ids, layout, out)
        except Exception as exc:
            _fall_back_or_raise(impl, exc)
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

        try:
            triton_kernels.scatter_blocks(buffer, layer_caches, block_ids, layout)
            return
        except Exception as exc:
            _fall_back_or_raise(impl, exc)
    reference.scatter_blocks(buffer, layer_caches, block_ids, layout)


def _fall_back_or_raise(impl: str, exc: Exception) -> None:
    """A Triton kernel failed before touching the caches? ``"auto"``: use the torch reference
    from now on (and say why, once). Bad arguments (``ValueError``) and a forced ``"triton"``
    raise; so do a CUDA error, which the reference would meet too, and running out of device
    memory, which may pass."""
    global _triton_failed
    transient = isinstance(exc, torch.cuda.OutOfMemoryError) or "CUDA error" in str(exc)
    if impl != "auto" or isinstance(exc, ValueError) or transient:
        raise exc
    if _triton_failed is None:
        logger.warning(
            "Triton gather/scatter kernels cannot run here (%s: %s); using the torch reference",
            type(exc).__name__,
            exc,
        )
    _triton_failed = f"{type(exc).__name__}: {exc}"
