"""Pages between SGLang's host pool and kvstore's arena: one numpy copy per run of pages.

SGLang's zero-copy calls name pages by host-pool token indices, ``page_size`` per page
(:func:`host_pages`). Over shared memory each page's stored block lies in the store's arena
(leased for a load, reserved for a store), in no particular place; but blocks stored together
usually lie one after the other. :func:`coalesce` cuts a call's pages into *runs*: consecutive
host pages whose blocks lie at equal distances in the arena. Each run is one strided numpy copy
between a view of the arena and a view of the host pool (:func:`copy_runs`), so a batch of 128
pages costs a handful of Python calls, not 128 (numpy releases the GIL while it copies).

The host pool is viewed as ``[pages, *page_shape]`` in the stored, canonical order
(:func:`page_view`; see :mod:`kvstore.integrations.sglang.identity`): a view, never a copy, whose
strides do the transposition a ``page_first`` pool needs. SGLang's legacy calls hand over flat
pages in the host layout's own order; :func:`flat_to_stored` and :func:`stored_to_flat` convert.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvstore.integrations.paged.host_copies import copyable
from kvstore.integrations.sglang.identity import PoolShape

__all__ = [
    "Run",
    "coalesce",
    "copy_runs",
    "flat_to_stored",
    "host_pages",
    "page_view",
    "stored_to_flat",
]

# Per layout: (the host pool's flat page shape, the permutation of it into the stored order).
_FLAT = {
    ("mha", "layer_first"): (("kv", "L", "P", "H", "D"), (0, 1, 2, 3, 4)),
    ("mha", "page_first"): (("kv", "P", "L", "H", "D"), (0, 2, 1, 3, 4)),
    ("mha", "page_first_direct"): (("kv", "L", "P", "H", "D"), (0, 1, 2, 3, 4)),
    ("mla", "layer_first"): (("L", "P", "1", "D"), (0, 1, 2, 3)),
    ("mla", "page_first"): (("P", "L", "1", "D"), (1, 0, 2, 3)),
    ("mla", "page_first_direct"): (("L", "P", "1", "D"), (0, 1, 2, 3)),
}


def page_view(kv_buffer: torch.Tensor, shape: PoolShape) -> torch.Tensor:
    """SGLang's host ``kv_buffer`` as ``[pages, *shape.page_shape]`` (a view of the same memory)."""
    L, P, H, D = shape.layers, shape.page_size, shape.heads, shape.head_dim
    if shape.kind == "mha":
        if shape.layout == "page_first_direct":  # [2, pages, L, P, H, D]
            return kv_buffer.permute(1, 0, 2, 3, 4, 5)
        tokens = kv_buffer.shape[2 if shape.layout == "layer_first" else 1]
        pages = tokens // P
        if shape.layout == "layer_first":  # [2, L, tokens, H, D]
            split = kv_buffer.narrow(2, 0, pages * P).view(2, L, pages, P, H, D)
            return split.permute(2, 0, 1, 3, 4, 5)
        split = kv_buffer.narrow(1, 0, pages * P).view(2, pages, P, L, H, D)  # page_first
        return split.permute(1, 0, 3, 2, 4, 5)
    if shape.layout == "page_first_direct":  # [pages, L, P, 1, D]
        return kv_buffer
    tokens = kv_buffer.shape[1 if shape.layout == "layer_first" else 0]
    pages = tokens // P
    if shape.layout == "layer_first":  # [L, tokens, 1, D]
        split = kv_buffer.narrow(1, 0, pages * P).view(L, pages, P, 1, D)
        return split.permute(1, 0, 2, 3, 4)
    split = kv_buffer.narrow(0, 0, pages * P).view(pages, P, L, 1, D)  # page_first
    return split.permute(0, 2, 1, 3, 4)


def host_pages(host_indices: torch.Tensor, page_size: int, count: int) -> list[int] | None:
    """The host pages of ``count`` pages named by ``host_indices`` (``count * page_size`` token
    indices, whole pages in order); ``None`` if they are not that (then nothing is copied)."""
    if host_indices.numel() != count * page_size:
        return None
    if count == 0:
        return []
    tokens = host_indices.reshape(count, page_size).to("cpu", torch.int64)
    starts = tokens[:, 0]
    offsets = torch.arange(page_size, dtype=torch.int64)
    if bool((starts % page_size).any()) or not bool((tokens == starts[:, None] + offsets).all()):
        return None
    pages: list[int] = (starts // page_size).tolist()
    return pages


@dataclass(frozen=True, slots=True)
class Run:
    """Pages ``first .. first + count - 1`` of a call, in host pages ``page ..``, whose blocks
    lie ``step`` bytes apart from the block of page ``first`` on."""

    first: int
    count: int
    page: int
    step: int


def coalesce(pages: Sequence[int], addresses: Sequence[int | None], nbytes: int) -> list[Run]:
    """The runs of one call: ``pages[i]`` is page ``i``'s host page, ``addresses[i]`` the address
    of its block (``None``: no block; left out of every run). A run grows while the host pages
    are consecutive and the blocks equally spaced, at least ``nbytes`` apart (no overlap)."""
    runs: list[Run] = []
    i, total = 0, len(pages)
    while i < total:
        start = addresses[i]
        if start is None:
            i += 1
            continue
        count, step = 1, 0
        while i + count < total:
            address = addresses[i + count]
            if address is None or pages[i + count] != pages[i] + count:
                break
            gap = address - start
            if count == 1:
                if gap < nbytes:
                    break
                step = gap
            elif gap != step * count:
                break
            count += 1
        runs.append(Run(i, count, pages[i], step or nbytes))
        i += count
    return runs


def copy_runs(
    runs: Sequence[Run],
    blocks: Sequence[np.ndarray[Any, Any] | None],
    pool_pages: torch.Tensor,
    shape: PoolShape,
    *,
    into_pool: bool,
) -> None:
    """One copy per run between the blocks (``uint8`` views of ``shape.page_nbytes``; those of a
    run must be those :func:`coalesce` was given the addresses of) and ``pool_pages``
    (:func:`page_view`): into the pool for a load, out of it for a store."""
    for run in runs:
        arena = _strided(blocks[run.first], run, shape, writeable=not into_pool)
        pool = copyable(pool_pages[run.page : run.page + run.count])
        if into_pool:
            np.copyto(pool, arena)
        else:
            np.copyto(arena, pool)


def _strided(
    block: np.ndarray[Any, Any] | None, run: Run, shape: PoolShape, *, writeable: bool
) -> np.ndarray[Any, Any]:
    """The run's blocks as one ``[count, *page_shape]`` array over the first block's memory."""
    assert block is not None and block.nbytes == shape.page_nbytes
    width = copyable(torch.empty(0, dtype=_torch_dtype(shape))).dtype
    first = block.view(width).reshape(shape.page_shape)
    return np.lib.stride_tricks.as_strided(
        first,
        shape=(run.count, *shape.page_shape),
        strides=(run.step, *first.strides),
        writeable=writeable,
    )


def _torch_dtype(shape: PoolShape) -> torch.dtype:
    dtype = getattr(torch, shape.dtype)
    assert isinstance(dtype, torch.dtype)
    return dtype


def _flat(shape: PoolShape) -> tuple[tuple[int, ...], tuple[int, ...]]:
    names, order = _FLAT[(shape.kind, shape.layout)]
    sizes = {
        "kv": 2,
        "L": shape.layers,
        "P": shape.page_size,
        "H": shape.heads,
        "D": shape.head_dim,
        "1": 1,
    }
    return tuple(sizes[name] for name in names), order


def flat_to_stored(page: torch.Tensor, shape: PoolShape) -> torch.Tensor:
    """A legacy call's flat page (the host layout's order) as a contiguous stored page."""
    dims, order = _flat(shape)
    return page.reshape(dims).permute(order).contiguous()


def stored_to_flat(stored: torch.Tensor, target: torch.Tensor, shape: PoolShape) -> None:
    """Write a stored page (``shape.page_shape``) into a legacy call's flat ``target`` page."""
    dims, order = _flat(shape)
    target.view(dims).permute(order).copy_(stored.view(shape.page_shape))
