"""The torch reference against caches built block by block, plus validation and dispatch."""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import textwrap
import typing
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any, cast

import kvstore_kernels
import pytest
import torch
from harness.kernel_cases import block, make_caches, patterned, same_bytes
from kvstore_kernels import CPU_LAYOUT, CUDA_LAYOUT, CacheLayout, chunk_nbytes, reference

MID_LAYOUT = CacheLayout("test-mid", block_dim=2)

# (layout, shape of one block); the cache is those blocks stacked along layout.block_dim.
LAYOUTS = [
    pytest.param(CUDA_LAYOUT, (2, 4, 2, 8), id="cuda"),  # [2, bs, heads, head]
    pytest.param(CPU_LAYOUT, (2, 4, 16), id="cpu"),  # [heads, bs, 2*head]
    pytest.param(MID_LAYOUT, (3, 2, 4, 4), id="mid"),  # blocks in the middle dimension
]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
NUM_BLOCKS = 7
_BAD_IMPL = cast(Any, "cuda")  # deliberately outside the Impl literal


def _hand_built(
    layout: CacheLayout, block_shape: Sequence[int], dtype: torch.dtype, num_layers: int
) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Caches assembled from explicit per-block tensors, independently of index_select."""
    blocks = [
        [patterned(block_shape, dtype, seed=100 * layer + b) for b in range(NUM_BLOCKS)]
        for layer in range(num_layers)
    ]
    caches = [torch.stack(per_layer, dim=layout.block_dim) for per_layer in blocks]
    return caches, blocks


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("layout", "block_shape"), LAYOUTS)
def test_gather_matches_hand_built_blocks(
    layout: CacheLayout, block_shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    caches, blocks = _hand_built(layout, block_shape, dtype, num_layers=3)
    ids = [5, 0, 3, 5]  # a repeat is legal for a gather
    out = reference.gather_blocks(caches, ids, layout)
    assert out.shape == (3, len(ids), *block_shape)
    assert out.is_contiguous()
    expected = torch.stack([torch.stack([per_layer[b] for b in ids]) for per_layer in blocks])
    assert same_bytes(out, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("layout", "block_shape"), LAYOUTS)
def test_scatter_writes_only_targeted_blocks(
    layout: CacheLayout, block_shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    caches, blocks = _hand_built(layout, block_shape, dtype, num_layers=2)
    ids = [6, 1, 4]
    buffer = patterned((2, len(ids), *block_shape), dtype, seed=999)
    reference.scatter_blocks(buffer, caches, ids, layout)
    for layer, cache in enumerate(caches):
        for b in range(NUM_BLOCKS):
            want = buffer[layer, ids.index(b)] if b in ids else blocks[layer][b]
            assert same_bytes(block(cache, layout, b), want), (layer, b)


@pytest.mark.parametrize(("layout", "block_shape"), LAYOUTS)
def test_runs_of_consecutive_ids_copy_as_the_blocks_they_are(
    layout: CacheLayout, block_shape: tuple[int, ...]
) -> None:
    caches, blocks = _hand_built(layout, block_shape, torch.bfloat16, num_layers=2)
    ids = [2, 3, 4, 0, 6, 5]  # a run of three, then singles (5 after 6 is no run)
    buffer = patterned((2, len(ids), *block_shape), torch.bfloat16, seed=7)
    reference.scatter_blocks(buffer, caches, ids, layout)
    for layer, cache in enumerate(caches):
        for b in range(NUM_BLOCKS):
            want = buffer[layer, ids.index(b)] if b in ids else blocks[layer][b]
            assert same_bytes(block(cache, layout, b), want), (layer, b)
    gathered = reference.gather_blocks(caches, [1, 2, 3, 3, 4, 0], layout)
    for layer, cache in enumerate(caches):
        for at, b in enumerate([1, 2, 3, 3, 4, 0]):
            assert same_bytes(gathered[layer, at], block(cache, layout, b)), (layer, at)


def test_gather_into_given_out_and_tensor_ids() -> None:
    caches = make_caches(2, (2, 5, 4, 2, 8), torch.bfloat16, seed=1)
    out = torch.empty((2, 3, 2, 4, 2, 8), dtype=torch.bfloat16)
    ids = torch.tensor([4, 0, 2], dtype=torch.int32)
    result = kvstore_kernels.gather_blocks(caches, ids, CUDA_LAYOUT, out)
    assert result is out
    assert same_bytes(out, reference.gather_blocks(caches, [4, 0, 2], CUDA_LAYOUT))


def test_empty_block_list() -> None:
    caches = make_caches(2, (4, 2, 3, 8), torch.float16, seed=2)
    before = [c.clone() for c in caches]
    out = kvstore_kernels.gather_blocks(caches, [], CPU_LAYOUT)
    assert out.shape == (2, 0, 2, 3, 8)
    kvstore_kernels.scatter_blocks(out, caches, [], CPU_LAYOUT)
    assert all(same_bytes(a, b) for a, b in zip(caches, before, strict=True))


def test_non_contiguous_caches_and_buffer() -> None:
    # K/V halves allocated block-major and viewed as [2, num_blocks, ...], as some backends do.
    raws = make_caches(2, (5, 2, 4, 2, 8), torch.float16, seed=3)
    caches = [raw.transpose(0, 1) for raw in raws]
    out = reference.gather_blocks(caches, [3, 1], CUDA_LAYOUT)
    assert same_bytes(out[1, 0], raws[1][3])
    buffer = patterned((2, 2, 2, 4, 2, 8), torch.float16, seed=4)
    reference.scatter_blocks(
        buffer.transpose(2, 3).contiguous().transpose(2, 3), caches, [0, 4], CUDA_LAYOUT
    )
    assert same_bytes(raws[0][4], buffer[0, 1])


def _caches() -> list[torch.Tensor]:
    return make_caches(2, (2, 4, 4, 2, 8), torch.float16, seed=5)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda c: reference.gather_blocks(c, [4], CUDA_LAYOUT), r"out of range \[0, 4\)"),
        (lambda c: reference.gather_blocks(c, [-1], CUDA_LAYOUT), "out of range"),
        (lambda c: reference.gather_blocks(c, torch.tensor([0, 9]), CUDA_LAYOUT), "out of range"),
        (lambda c: reference.gather_blocks(c, cast(Any, [0.5]), CUDA_LAYOUT), "must be integers"),
        (lambda c: reference.gather_blocks(c, torch.tensor([0.0]), CUDA_LAYOUT), "integer dtype"),
        (
            lambda c: reference.gather_blocks(c, torch.zeros(1, 1, dtype=torch.int64), CUDA_LAYOUT),
            "1-D",
        ),
        (lambda c: reference.gather_blocks([], [0], CUDA_LAYOUT), "empty"),
        (lambda c: reference.gather_blocks(c[0], [0], CUDA_LAYOUT), "not one tensor"),
        (lambda c: reference.gather_blocks([c[0], c[1][:, :3]], [0], CUDA_LAYOUT), "layer_caches"),
        (lambda c: reference.gather_blocks([c[0], c[1].float()], [0], CUDA_LAYOUT), "layer_caches"),
        (lambda c: reference.gather_blocks(c, [0], CPU_LAYOUT), "4-D"),
        (lambda c: reference.gather_blocks(c, [0], CacheLayout("x", 5)), "only 5 dims"),
        (
            lambda c: reference.gather_blocks(c, [0], CUDA_LAYOUT, torch.empty(2, 2)),
            "out has shape",
        ),
        (
            lambda c: reference.gather_blocks(
                c, [0], CUDA_LAYOUT, torch.empty(2, 1, 2, 4, 2, 8, dtype=torch.float32)
            ),
            "out is torch.float32",
        ),
        (
            lambda c: reference.gather_blocks(
                c,
                [0],
                CUDA_LAYOUT,
                torch.empty(2, 1, 2, 4, 8, 2, dtype=torch.float16).transpose(4, 5),
            ),
            "contiguous",
        ),
        (
            lambda c: reference.scatter_blocks(
                torch.empty(2, 2, 2, 4, 2, 8, dtype=torch.float16), c, [1, 1], CUDA_LAYOUT
            ),
            "repeat",
        ),
        (
            lambda c: reference.scatter_blocks(
                torch.empty(2, 1, 2, 4, 2, 8, dtype=torch.float16), c, [0, 1], CUDA_LAYOUT
            ),
            "buffer has shape",
        ),
        (lambda c: kvstore_kernels.gather_blocks(c, [0], CUDA_LAYOUT, impl=_BAD_IMPL), "impl must"),
    ],
)
def test_invalid_arguments_raise_value_error(
    call: Callable[[list[torch.Tensor]], object], message: str
) -> None:
    caches = _caches()
    before = [c.clone() for c in caches]
    with pytest.raises(ValueError, match=message):
        call(caches)
    assert all(same_bytes(a, b) for a, b in zip(caches, before, strict=True))


def test_cache_layout_description() -> None:
    assert CUDA_LAYOUT.block_dim == 1
    assert CPU_LAYOUT.block_dim == 0
    shape = (2, 100, 16, 8, 128)
    assert CUDA_LAYOUT.num_blocks(shape) == 100
    assert CUDA_LAYOUT.block_shape(shape) == (2, 16, 8, 128)
    assert CPU_LAYOUT.block_shape((100, 8, 16, 256)) == (8, 16, 256)
    assert CUDA_LAYOUT.buffer_shape(shape, num_layers=32, num_ids=16) == (32, 16, 2, 16, 8, 128)
    for bad in [("", 0), ("x", -1)]:
        with pytest.raises(ValueError):
            CacheLayout(*bad)
    with pytest.raises(ValueError, match="ndim"):
        CacheLayout("x", block_dim=2, ndim=2)
    with pytest.raises(AttributeError):
        setattr(CUDA_LAYOUT, "block_dim", 0)  # noqa: B010 (frozen: must raise)


def test_chunk_nbytes_matches_gathered_buffer() -> None:
    # 256-token chunk of a 32-layer model, block_size 16, 8 KV heads of 128, fp16: 32 MiB.
    assert chunk_nbytes((2, 1000, 16, 8, 128), torch.float16, 32, 16, CUDA_LAYOUT) == 32 << 20
    caches = make_caches(3, (6, 2, 4, 16), torch.bfloat16, seed=6)
    out = reference.gather_blocks(caches, [0, 2, 5], CPU_LAYOUT)
    assert chunk_nbytes(caches[0].shape, torch.bfloat16, 3, 3, CPU_LAYOUT) == out.nbytes
    with pytest.raises(ValueError):
        chunk_nbytes((6, 2), torch.float16, -1, 1, CPU_LAYOUT)


def test_public_api() -> None:
    assert set(kvstore_kernels.__all__) == {
        "BlockIds",
        "CPU_LAYOUT",
        "CUDA_LAYOUT",
        "CacheLayout",
        "Impl",
        "chunk_nbytes",
        "gather_blocks",
        "scatter_blocks",
    }
    # A star import resolves every name of __all__ (AttributeError for one that is missing).
    star: dict[str, Any] = {}
    exec("from kvstore_kernels import *", star)
    assert set(star) - {"__builtins__"} == set(kvstore_kernels.__all__)
    # Each name is the object it stands for, not a leftover of another kind.
    assert star["CacheLayout"] is CacheLayout
    assert isinstance(star["CPU_LAYOUT"], CacheLayout) and star["CPU_LAYOUT"].block_dim == 0
    assert isinstance(star["CUDA_LAYOUT"], CacheLayout) and star["CUDA_LAYOUT"].block_dim == 1
    assert star["BlockIds"] is kvstore_kernels._checks.BlockIds
    assert typing.get_args(star["Impl"]) == ("auto", "torch", "triton")
    assert star["chunk_nbytes"] is kvstore_kernels.layout.chunk_nbytes
    for name in ("gather_blocks", "scatter_blocks"):
        assert star[name].__module__ == "kvstore_kernels", name  # the dispatching front door


def test_auto_uses_reference_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real_gather, real_scatter = reference.gather_blocks, reference.scatter_blocks

    def gather(*args: Any) -> torch.Tensor:
        calls.append("gather")
        return real_gather(*args)

    def scatter(*args: Any) -> None:
        calls.append("scatter")
        real_scatter(*args)

    monkeypatch.setattr(reference, "gather_blocks", gather)
    monkeypatch.setattr(reference, "scatter_blocks", scatter)
    caches = _caches()
    # Both calls on the default impl ("auto"): on CPU caches each must reach the reference.
    out = kvstore_kernels.gather_blocks(caches, [1], CUDA_LAYOUT)
    kvstore_kernels.scatter_blocks(out, caches, [2], CUDA_LAYOUT)
    assert calls == ["gather", "scatter"]
    for cache in caches:  # and the reference really ran: block 1 was copied onto block 2
        assert same_bytes(block(cache, CUDA_LAYOUT, 2), block(cache, CUDA_LAYOUT, 1))


def test_auto_falls_back_once_where_the_triton_kernels_cannot_be_built(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Triton builds a C launcher on first use; without a compiler that raises. "auto" must then
    use the reference (the store keeps loading and saving), say why once, and not retry. Triton
    is made to fail here (a stand-in: on CPU caches "auto" would not pick it at all)."""
    from kvstore_kernels import triton_kernels

    tried: list[str] = []

    def no_compiler(*_: object) -> None:
        tried.append("triton")
        raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable")

    # The caches pass for CUDA ones that Triton supports; the rest of the choice is real.
    on_cuda = SimpleNamespace(device=torch.device("cuda"))
    monkeypatch.setattr(kvstore_kernels, "check_caches", lambda *_: on_cuda)
    monkeypatch.setattr(triton_kernels, "supports", lambda *_: True)
    monkeypatch.setattr(kvstore_kernels, "_triton_failed", None)
    monkeypatch.setattr(triton_kernels, "gather_blocks", no_compiler)
    monkeypatch.setattr(triton_kernels, "scatter_blocks", no_compiler)
    caches = _caches()
    out = kvstore_kernels.gather_blocks(caches, [1], CUDA_LAYOUT)
    kvstore_kernels.scatter_blocks(out, caches, [2], CUDA_LAYOUT)
    for cache in caches:  # the reference ran both
        assert same_bytes(block(cache, CUDA_LAYOUT, 2), block(cache, CUDA_LAYOUT, 1))
    assert tried == ["triton"]  # the scatter did not try again
    assert caplog.text.count("Triton gather/scatter kernels cannot run here") == 1
    assert "Failed to find C compiler" in (kvstore_kernels._triton_failed or "")
    # A forced "triton" still says what is wrong; a CUDA error is not a reason to fall back.
    with pytest.raises(RuntimeError, match="C compiler"):
        kvstore_kernels.gather_blocks(caches, [1], CUDA_LAYOUT, impl="triton")

    def cuda_error(*_: object) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(kvstore_kernels, "_triton_failed", None)
    monkeypatch.setattr(triton_kernels, "gather_blocks", cuda_error)
    with pytest.raises(RuntimeError, match="CUDA error"):
        kvstore_kernels.gather_blocks(caches, [1], CUDA_LAYOUT)


def test_package_imports_and_runs_without_triton() -> None:
    script = textwrap.dedent(
        """
        import sys
        sys.modules["triton"] = None  # makes `import triton` raise ImportError
        import torch
        import kvstore_kernels as k
        caches = [torch.arange(24.0).reshape(4, 2, 3, 1)]
        out = k.gather_blocks(caches, [3, 1], k.CPU_LAYOUT)
        assert out[0, 0].eq(caches[0][3]).all()
        try:
            k.gather_blocks(caches, [0], k.CPU_LAYOUT, impl="triton")
        except ValueError as exc:
            assert "triton" in str(exc)
        else:
            raise AssertionError("impl='triton' should fail without triton")
        print("ok")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def _on_a_side_thread(work: Callable[[], Any]) -> Any:
    """Run ``work`` on a thread other than the main one (the connector's save and load threads)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(work).result(timeout=60)


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float8_e4m3fn, torch.int8, torch.float64])
@pytest.mark.parametrize(("layout", "block_shape"), LAYOUTS)
def test_side_thread_copies_match_the_main_thread(
    layout: CacheLayout, block_shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    """Off the main thread the CPU path copies through numpy; the bytes must be the same."""
    source = dtype if dtype.is_floating_point and dtype.itemsize > 1 else torch.float32
    caches, _ = _hand_built(layout, block_shape, source, num_layers=3)
    caches = [cache.to(dtype) for cache in caches]
    ids = [2, 3, 4, 0, 6, 6]  # a run, a single block and a repeat
    on_main = reference.gather_blocks(caches, ids, layout)
    on_side = _on_a_side_thread(lambda: reference.gather_blocks(caches, ids, layout))
    assert same_bytes(on_side, on_main)

    unique = [2, 3, 4, 0, 6]
    buffer = reference.gather_blocks([c.flip(0) for c in caches], unique, layout)
    main_caches = [c.clone() for c in caches]
    side_caches = [c.clone() for c in caches]
    reference.scatter_blocks(buffer, main_caches, unique, layout)
    _on_a_side_thread(lambda: reference.scatter_blocks(buffer, side_caches, unique, layout))
    for main, side in zip(main_caches, side_caches, strict=True):
        assert same_bytes(side, main)
    assert not all(same_bytes(a, b) for a, b in zip(main_caches, caches, strict=True))
