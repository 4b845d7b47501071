"""Builders shared by the kernel tests and by the interpreter script (``interp_cases.py``).

Not a test module (no ``test_`` prefix); the tests import it by name because pytest puts this
directory on ``sys.path``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from kvstore_kernels import CacheLayout


def patterned(shape: Sequence[int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A CPU tensor of random bit patterns viewed as ``dtype``.

    Every byte is random, so a copy that drops, reorders or converts anything (even a NaN
    payload) shows up in :func:`same_bytes`, and two blocks never look alike by accident.
    """
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (*shape, dtype.itemsize), generator=gen, dtype=torch.uint8)
    return raw.view(dtype).reshape(tuple(shape))


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as raw bytes on the CPU (compares NaNs and -0.0 exactly)."""
    # A fresh tensor: .contiguous() may keep an odd stride on size-1 dims, which view() rejects.
    flat = torch.empty(t.numel(), dtype=t.dtype)
    flat.copy_(t.detach().reshape(-1))
    return flat.view(torch.uint8)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors have the same shape, dtype and bytes."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(as_bytes(a), as_bytes(b))


def make_caches(
    num_layers: int,
    cache_shape: Sequence[int],
    dtype: torch.dtype,
    seed: int,
    device: str | torch.device = "cpu",
) -> list[torch.Tensor]:
    """``num_layers`` patterned layer caches, each with different contents."""
    return [patterned(cache_shape, dtype, seed * 1000 + i).to(device) for i in range(num_layers)]


def block(cache: torch.Tensor, layout: CacheLayout, block_id: int) -> torch.Tensor:
    """Block ``block_id`` of one layer cache (a view)."""
    return cache.select(layout.block_dim, block_id)
