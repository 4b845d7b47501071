"""Host-side copies of KV blocks through numpy: same-width integer views of any torch dtype.

numpy has no bfloat16 or float8, and a copy moves bits: each tensor is viewed as integers of its
element's width, and numpy copies those (releasing the GIL, and never entering OpenMP, which a
torch ``copy_`` off the main thread of vLLM's CPU worker would; see ``kernels/reference.py``).
Used by :mod:`kvstore.integrations.paged.device_pipeline` for CPU loads.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from kvstore_kernels.reference import SAME_WIDTH  # type: ignore[import-not-found, unused-ignore]

from kvstore.integrations.paged.plan import CopyRun

__all__ = [
    "SAME_WIDTH",
    "arena_chunk",
    "as_torch",
    "copy_slices",
    "copyable",
    "stage_views",
    "strided_groups",
    "width_of",
]


def copyable(tensor: torch.Tensor) -> Any:
    """A CPU tensor as a numpy view of the same bytes (same strides), else the tensor itself."""
    width = SAME_WIDTH.get(tensor.element_size())
    return tensor if width is None else tensor.view(width).numpy()


def as_torch(array: Any) -> torch.Tensor:
    """A :func:`copyable` back as a torch tensor (numpy views share the memory)."""
    return torch.from_numpy(array) if isinstance(array, np.ndarray) else array


def strided_groups(runs: list[CopyRun], sources: Any) -> list[tuple[Any, int, int, int, int]]:
    """Runs merged where one strided copy does: ``(source, row, block, n, count)``.

    Runs of the same rows of ``n`` chunks that land back to back in the cache, whose sources
    lie at equal distances in memory (chunks stored one after the other in the store's arena,
    or the rows of the staging buffer), become one ``[n, layers, rows, *block]`` view over
    those chunks: one copy per layer instead of one per chunk and layer (Python's cost per
    call is a good part of an 8K-token load). Only addresses checked here are read.
    """
    groups: list[tuple[Any, int, int, int, int]] = []
    at = 0
    while at < len(runs):
        chunk, row, block, count = runs[at]
        src, n, step = sources[chunk], 1, 0
        if isinstance(src, np.ndarray):
            base = src.ctypes.data
            while at + n < len(runs):
                other_chunk, other_row, other_block, other_count = runs[at + n]
                other = sources[other_chunk]
                if not (
                    isinstance(other, np.ndarray)
                    and (other_row, other_count) == (row, count)
                    and other_block == block + n * count
                    and other.shape == src.shape
                    and other.strides == src.strides
                ):
                    break
                gap = other.ctypes.data - base
                if n == 1:
                    if gap <= 0 or gap % src.itemsize:
                        break
                    step = gap
                elif gap != step * n:
                    break
                n += 1
            view = np.lib.stride_tricks.as_strided(
                src, shape=(n, *src.shape), strides=(step, *src.strides), writeable=False
            )
        else:
            view = src.unsqueeze(0)
        groups.append((view, row, block, n, count))
        at += n
    return groups


def arena_chunk(view: Any, shape: Sequence[int], dtype: torch.dtype) -> Any:
    """A leased chunk (``uint8`` bytes in the store's arena) as a :func:`copyable` of
    ``shape`` holding ``dtype``; ``None`` if it is not that size (a failed chunk)."""
    width = width_of(dtype)
    assert width is not None, "in_place() said no"
    if view.nbytes != math.prod(shape) * width.itemsize:
        return None
    return view.view(width).reshape(tuple(shape))


def width_of(dtype: torch.dtype) -> np.dtype[Any] | None:
    """numpy's integer dtype of ``dtype``'s width, if any."""
    width = SAME_WIDTH.get(torch.empty(0, dtype=dtype).element_size())
    return None if width is None else torch.empty(0, dtype=width).numpy().dtype


def copy_slices(dst: Any, src: Any) -> None:
    """``dst[...] = src`` for two :func:`copyable` slices (numpy releases the GIL)."""
    if isinstance(dst, np.ndarray):
        np.copyto(dst, src)
    else:
        dst.copy_(src)


def stage_views(views: Sequence[Any], host: torch.Tensor) -> list[bool]:
    """Copy each leased block (``uint8`` views, ``None``: missing) into row ``i`` of ``host``
    (``[chunks, ...]``, contiguous); False where missing or not a row's size."""
    rows = host.view(torch.uint8).reshape(host.shape[0], -1).numpy()
    copied = []
    for row, view in zip(rows, views, strict=True):
        whole = view is not None and view.nbytes == row.nbytes
        if whole:
            np.copyto(row, view)
        copied.append(whole)
    return copied
