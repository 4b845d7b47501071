"""Argument checks shared by every implementation, so each raises the same ``ValueError``s."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import TypeAlias

import torch

from .layout import CacheLayout

BlockIds: TypeAlias = Sequence[int] | torch.Tensor
"""Block ids: a sequence of Python ints or a 1-D integer tensor (on any device)."""

_INT_DTYPES = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})


def check_caches(layer_caches: Sequence[torch.Tensor], layout: CacheLayout) -> torch.Tensor:
    """Check that all layer caches agree on shape, dtype and device; return the first one."""
    # A bare tensor is a Sequence too: iterating one layer's cache would silently treat its
    # first dimension as layers.
    if isinstance(layer_caches, torch.Tensor):
        raise ValueError(
            "layer_caches must be a sequence of per-layer tensors, not one tensor "
            "(wrap a single layer as [cache], or use list(stacked.unbind(0)))"
        )
    if len(layer_caches) == 0:
        raise ValueError("layer_caches is empty")
    first = layer_caches[0]
    for i, cache in enumerate(layer_caches):
        if not isinstance(cache, torch.Tensor):
            raise ValueError(f"layer_caches[{i}] is {type(cache).__name__}, not a torch.Tensor")
        if cache.shape != first.shape or cache.dtype != first.dtype or cache.device != first.device:
            raise ValueError(
                f"layer_caches[{i}] is {tuple(cache.shape)} {cache.dtype} on {cache.device}, "
                f"but layer 0 is {tuple(first.shape)} {first.dtype} on {first.device}"
            )
    layout.check_shape(first.shape)
    return first


def check_block_ids(block_ids: BlockIds, num_blocks: int, *, unique: bool) -> torch.Tensor:
    """Validate block ids against ``num_blocks``; return them as a 1-D int64 CPU tensor.

    ``unique`` forbids repeats: scattering two buffer slots into one block has no defined
    winner. Ids given as a CUDA tensor are copied to the host to be checked (a sync).
    """
    if isinstance(block_ids, torch.Tensor):
        if block_ids.ndim != 1 or block_ids.dtype not in _INT_DTYPES:
            raise ValueError(
                f"block_ids tensor must be 1-D with an integer dtype, "
                f"got shape {tuple(block_ids.shape)} {block_ids.dtype}"
            )
        ids = block_ids.to("cpu", torch.int64)
        bad = ids[(ids < 0) | (ids >= num_blocks)][:8].tolist()
    else:
        try:
            values = [operator.index(b) for b in block_ids]
        except TypeError as exc:
            raise ValueError(f"block_ids must be integers: {exc}") from exc
        # Range-checked before building the tensor: an id past int64 would fail there obscurely.
        bad = [b for b in values if not 0 <= b < num_blocks][:8]
        ids = torch.tensor([] if bad else values, dtype=torch.int64)
    if bad:
        raise ValueError(f"block ids {bad} out of range [0, {num_blocks})")
    if unique and len(set(ids.tolist())) != ids.numel():
        raise ValueError("block_ids repeat an id; a scatter target must be listed once")
    return ids


def check_buffer(
    buffer: torch.Tensor, shape: tuple[int, ...], like: torch.Tensor, *, name: str
) -> None:
    """Check that a chunk buffer has the expected shape and the caches' dtype and device."""
    if not isinstance(buffer, torch.Tensor):
        raise ValueError(f"{name} is {type(buffer).__name__}, not a torch.Tensor")
    if tuple(buffer.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(buffer.shape)}, expected {shape}")
    if buffer.dtype != like.dtype or buffer.device != like.device:
        raise ValueError(
            f"{name} is {buffer.dtype} on {buffer.device}, "
            f"but the layer caches are {like.dtype} on {like.device}"
        )


def output_buffer(
    out: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor
) -> torch.Tensor:
    """Return ``out`` after checking it (it must be contiguous), or a fresh buffer."""
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    check_buffer(out, shape, like, name="out")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    return out


def to_device_async(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor (block ids, cache addresses) on ``device`` without stalling the host.

    A plain ``.to(cuda)`` of pageable memory synchronizes the current stream: a loader thread
    launching a scatter would then wait for every copy queued before it (the layer's DMA), and
    could not issue the next layer's copies meanwhile. From page-locked memory the copy is
    queued like a kernel; torch's host allocator keeps those pages until it has run.
    """
    if device.type != "cuda":
        return values.to(device)
    return values.pin_memory().to(device, non_blocking=True)
