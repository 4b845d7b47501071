"""Triton kernels vs the torch reference on CUDA caches of realistic size.

Skipped only where CUDA is unavailable; on a CUDA machine triton must be installed (it is in
the 'test' extra), so a missing triton fails here instead of hiding behind a skip.
"""

from __future__ import annotations

import random

import kvstore_kernels
import pytest
import torch
from harness.kernel_cases import block, make_caches, patterned, same_bytes
from kvstore_kernels import CPU_LAYOUT, CUDA_LAYOUT, CacheLayout, reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# Llama-8B-like per-layer caches: block_size 16, 8 KV heads of 128; 64 blocks per layer.
SHAPES = [
    pytest.param(CUDA_LAYOUT, (2, 64, 16, 8, 128), id="cuda-layout"),
    pytest.param(CPU_LAYOUT, (64, 8, 16, 256), id="cpu-layout"),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("layout", "shape"), SHAPES)
def test_triton_matches_reference_on_cuda(
    layout: CacheLayout, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    from kvstore_kernels import triton_kernels

    caches = make_caches(4, shape, dtype, seed=1, device="cuda")
    ids = random.Random(0).sample(range(64), 16)
    assert triton_kernels.supports(caches, layout)

    got = kvstore_kernels.gather_blocks(caches, ids, layout, impl="triton")
    assert same_bytes(got, reference.gather_blocks(caches, ids, layout))

    buffer = patterned(got.shape, dtype, seed=2).cuda()
    mine = [c.clone() for c in caches]
    theirs = [c.clone() for c in caches]
    kvstore_kernels.scatter_blocks(buffer, mine, ids, layout, impl="triton")
    reference.scatter_blocks(buffer, theirs, ids, layout)
    torch.cuda.synchronize()
    assert all(same_bytes(a, b) for a, b in zip(mine, theirs, strict=True))


def test_auto_picks_triton_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object) -> None:
        raise AssertionError("the torch reference ran")

    monkeypatch.setattr(reference, "gather_blocks", fail)
    caches = make_caches(2, (2, 8, 16, 8, 128), torch.bfloat16, seed=3, device="cuda")
    out = kvstore_kernels.gather_blocks(caches, [7, 0], CUDA_LAYOUT)
    assert same_bytes(out[1, 0], block(caches[1], CUDA_LAYOUT, 7))


def test_strided_caches_and_long_rows_on_cuda() -> None:
    from kvstore_kernels import triton_kernels

    # K/V split from a block-major allocation, and rows longer than one tile.
    raws = make_caches(3, (32, 2, 16, 8, 128), torch.float16, seed=4, device="cuda")
    caches = [r.transpose(0, 1) for r in raws]
    ids = [31, 0, 17, 5]
    got = triton_kernels.gather_blocks(caches, ids, CUDA_LAYOUT, tile_bytes=1024)
    assert same_bytes(got, reference.gather_blocks(caches, ids, CUDA_LAYOUT))

    fresh = [torch.zeros_like(c) for c in caches]
    triton_kernels.scatter_blocks(got, fresh, ids, CUDA_LAYOUT, tile_bytes=1024)
    torch.cuda.synchronize()
    for src, dst in zip(caches, fresh, strict=True):
        for b in range(32):
            want = (
                block(src, CUDA_LAYOUT, b)
                if b in ids
                else torch.zeros_like(block(src, CUDA_LAYOUT, b))
            )
            assert same_bytes(block(dst, CUDA_LAYOUT, b), want)
