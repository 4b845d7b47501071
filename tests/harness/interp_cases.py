"""Triton-vs-reference cases for the CPU interpreter; run in a subprocess by the tests.

``TRITON_INTERPRET`` must be set before triton is imported and would leak into every later
test, so ``tests/kernels/test_kernels_triton_interp.py`` runs this module in its own process::

    TRITON_INTERPRET=1 PYTHONPATH=$PWD:tests .venv/bin/python -m harness.interp_cases

It prints one JSON object, ``{case name: "ok" or the failure's traceback}``. The interpreter
pays ~1.3 ms per program instance (one program per layer x block x outer row x tile), so the
caches are tiny.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable, Sequence

import torch
from kvstore_kernels import CPU_LAYOUT, CUDA_LAYOUT, CacheLayout, reference

from harness.kernel_cases import block, make_caches, patterned, same_bytes

CASES: dict[str, Callable[[], None]] = {}


def _case(fn: Callable[[], None]) -> Callable[[], None]:
    CASES[fn.__name__] = fn
    return fn


def _compare(
    layout: CacheLayout,
    caches: Sequence[torch.Tensor],
    gather_ids: Sequence[int],
    scatter_ids: Sequence[int],
    *,
    out: torch.Tensor | None = None,
    tile_bytes: int | None = None,
) -> None:
    """Triton and reference agree byte for byte on a gather and on a scatter."""
    from kvstore_kernels import triton_kernels

    kwargs = {} if tile_bytes is None else {"tile_bytes": tile_bytes}
    want = reference.gather_blocks(caches, gather_ids, layout)
    got = triton_kernels.gather_blocks(caches, gather_ids, layout, out, **kwargs)
    assert out is None or got is out
    assert same_bytes(got, want), "gather differs"

    buffer = patterned((*want.shape[:1], len(scatter_ids), *want.shape[2:]), want.dtype, 77)
    mine = [c.clone() for c in caches]
    theirs = [c.clone() for c in caches]
    triton_kernels.scatter_blocks(buffer, mine, scatter_ids, layout, **kwargs)
    reference.scatter_blocks(buffer, theirs, scatter_ids, layout)
    for layer, (a, b) in enumerate(zip(mine, theirs, strict=True)):
        assert same_bytes(a, b), f"scatter differs in layer {layer}"


@_case
def cuda_layout_fp16() -> None:
    _compare(
        CUDA_LAYOUT, make_caches(3, (2, 6, 4, 2, 8), torch.float16, 1), [5, 0, 3, 5], [1, 4, 2]
    )


@_case
def cuda_layout_bf16() -> None:
    _compare(CUDA_LAYOUT, make_caches(3, (2, 6, 4, 2, 8), torch.bfloat16, 2), [2, 5], [0, 3])


@_case
def cuda_layout_fp32() -> None:
    _compare(CUDA_LAYOUT, make_caches(2, (2, 6, 4, 2, 8), torch.float32, 3), [1, 4, 1], [5, 2])


@_case
def cpu_layout_bf16() -> None:
    _compare(CPU_LAYOUT, make_caches(3, (6, 2, 4, 16), torch.bfloat16, 4), [3, 0, 5], [4, 1])


@_case
def middle_block_dim() -> None:
    layout = CacheLayout("test-mid", block_dim=2)
    _compare(layout, make_caches(2, (3, 2, 5, 4, 4), torch.float16, 5), [4, 0], [2, 3])


@_case
def kv_split_block_major_allocation() -> None:
    # [num_blocks, 2, ...] storage viewed as [2, num_blocks, ...]: strided but viewable.
    raws = make_caches(2, (6, 2, 4, 2, 8), torch.float16, 6)
    _compare(CUDA_LAYOUT, [r.transpose(0, 1) for r in raws], [5, 1], [0, 2, 4])


@_case
def caches_sliced_from_larger_tensor() -> None:
    raws = make_caches(2, (2, 10, 4, 2, 8), torch.bfloat16, 7)
    _compare(CUDA_LAYOUT, [r[:, 2:8] for r in raws], [0, 5], [3])


@_case
def misaligned_out_uses_narrow_words() -> None:
    caches = make_caches(2, (2, 6, 4, 2, 8), torch.float16, 8)
    n = 2 * 2 * 2 * 4 * 2 * 8
    out = torch.empty(n + 1, dtype=torch.float16)[1:].view(2, 2, 2, 4, 2, 8)
    _compare(CUDA_LAYOUT, caches, [3, 4], [1], out=out)


@_case
def odd_rows_several_partial_tiles() -> None:
    # 15 fp16 = 30-byte rows -> 2-byte words; 8-byte tiles -> 4 tiles per row, the last partial.
    _compare(
        CPU_LAYOUT, make_caches(2, (6, 1, 3, 5), torch.float16, 9), [2, 5], [0, 4], tile_bytes=8
    )


@_case
def empty_block_list() -> None:
    from kvstore_kernels import triton_kernels

    caches = make_caches(2, (6, 2, 4, 16), torch.float32, 10)
    out = triton_kernels.gather_blocks(caches, [], CPU_LAYOUT)
    assert out.shape == (2, 0, 2, 4, 16)
    triton_kernels.scatter_blocks(out, caches, [], CPU_LAYOUT)


@_case
def round_trip_into_fresh_cache() -> None:
    from kvstore_kernels import triton_kernels

    source = make_caches(3, (2, 6, 4, 2, 8), torch.bfloat16, 11)
    ids = [4, 1, 3]
    fresh = [torch.zeros_like(c) for c in source]
    triton_kernels.scatter_blocks(
        triton_kernels.gather_blocks(source, ids, CUDA_LAYOUT), fresh, ids, CUDA_LAYOUT
    )
    for src, dst in zip(source, fresh, strict=True):
        for b in range(6):
            want = (
                block(src, CUDA_LAYOUT, b)
                if b in ids
                else torch.zeros_like(block(src, CUDA_LAYOUT, b))
            )
            assert same_bytes(block(dst, CUDA_LAYOUT, b), want), b


@_case
def unviewable_caches_are_refused() -> None:
    import kvstore_kernels
    from kvstore_kernels import triton_kernels

    # Heads and tokens swapped in storage: a block is no longer one run of memory per K/V half.
    raws = make_caches(2, (2, 6, 2, 4, 8), torch.float16, 12)
    caches = [r.transpose(2, 3) for r in raws]
    assert not triton_kernels.supports(caches, CUDA_LAYOUT)
    try:
        kvstore_kernels.gather_blocks(caches, [0], CUDA_LAYOUT, impl="triton")
    except ValueError as exc:
        assert "impl='torch'" in str(exc)
    else:
        raise AssertionError("expected ValueError")


@_case
def same_validation_as_reference() -> None:
    from kvstore_kernels import triton_kernels

    caches = make_caches(2, (6, 2, 4, 16), torch.float16, 13)
    calls: list[Callable[[], object]] = [
        lambda: triton_kernels.gather_blocks(caches, [6], CPU_LAYOUT),
        lambda: triton_kernels.scatter_blocks(
            torch.empty(2, 2, 2, 4, 16, dtype=torch.float16), caches, [3, 3], CPU_LAYOUT
        ),
    ]
    for call in calls:
        try:
            call()
        except ValueError:
            continue
        raise AssertionError("expected ValueError")


def main() -> int:
    """Run every case; print ``{name: "ok" | traceback}`` as JSON."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1 (the cases run triton on CPU tensors)", file=sys.stderr)
        return 2
    results: dict[str, str] = {}
    for name, fn in CASES.items():
        try:
            fn()
        except Exception:
            results[name] = traceback.format_exc()
        else:
            results[name] = "ok"
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
