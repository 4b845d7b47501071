"""Round-trip property: scatter(gather(x)) into a fresh cache reproduces the chosen blocks."""

from __future__ import annotations

import kvstore_kernels
import pytest
import torch
from harness.kernel_cases import block, make_caches, same_bytes
from hypothesis import given, settings
from hypothesis import strategies as st
from kvstore_kernels import CacheLayout


@st.composite
def _problems(draw: st.DrawFn) -> tuple[CacheLayout, tuple[int, ...], list[int], int]:
    block_dim = draw(st.integers(0, 2))
    ndim = draw(st.integers(block_dim + 1, block_dim + 3))
    shape = tuple(draw(st.integers(1, 4)) for _ in range(ndim))
    num_blocks = draw(st.integers(1, 8))
    shape = (*shape[:block_dim], num_blocks, *shape[block_dim + 1 :])
    ids = draw(st.lists(st.integers(0, num_blocks - 1), unique=True, max_size=num_blocks))
    num_layers = draw(st.integers(1, 3))
    return CacheLayout(f"prop-{block_dim}", block_dim, ndim), shape, ids, num_layers


@settings(max_examples=60, deadline=None)
@given(
    problem=_problems(),
    dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.uint8]),
)
def test_round_trip_reproduces_selected_blocks(
    problem: tuple[CacheLayout, tuple[int, ...], list[int], int], dtype: torch.dtype
) -> None:
    layout, shape, ids, num_layers = problem
    source = make_caches(num_layers, shape, dtype, seed=len(ids))
    snapshot = [c.clone() for c in source]
    fresh = [torch.zeros_like(c) for c in source]

    buffer = kvstore_kernels.gather_blocks(source, ids, layout)
    kvstore_kernels.scatter_blocks(buffer, fresh, ids, layout)

    for src, before, dst in zip(source, snapshot, fresh, strict=True):
        assert same_bytes(src, before)  # a gather never writes its source
        for b in range(layout.num_blocks(shape)):
            want = block(src, layout, b) if b in ids else torch.zeros_like(block(src, layout, b))
            assert same_bytes(block(dst, layout, b), want)


@pytest.mark.parametrize("layout", [kvstore_kernels.CUDA_LAYOUT, kvstore_kernels.CPU_LAYOUT])
def test_gather_then_scatter_in_place_is_identity(layout: CacheLayout) -> None:
    shape = (2, 9, 4, 2, 8) if layout.block_dim == 1 else (9, 2, 4, 16)
    caches = make_caches(2, shape, torch.bfloat16, seed=42)
    before = [c.clone() for c in caches]
    ids = [8, 0, 4, 2]
    kvstore_kernels.scatter_blocks(
        kvstore_kernels.gather_blocks(caches, ids, layout), caches, ids, layout
    )
    assert all(same_bytes(a, b) for a, b in zip(caches, before, strict=True))
