"""Layout detection of vLLM's per-layer KV caches, on CPU tensors built the way vLLM builds them."""

from __future__ import annotations

import kvstore_kernels  # type: ignore[import-not-found, unused-ignore]
import pytest
import torch

from kvstore.errors import ConfigError
from kvstore.integrations.paged.kv_layout import CacheSpec, KVLayout, detect_layout

BLOCKS, BLOCK, HEADS, HEAD = 6, 4, 3, 8
SPEC = CacheSpec(BLOCKS, BLOCK, HEADS, HEAD, HEAD)
MLA = CacheSpec(BLOCKS, BLOCK, 1, 24, 0, mla=True)


def _cache(kind: str, order: str, spec: CacheSpec = SPEC, ratio: int = 1) -> torch.Tensor:
    """A cache as vLLM allocates it: physical memory in ``order``, viewed in the logical shape."""
    b, n, h, d = spec.num_blocks * ratio, spec.block_size // ratio, spec.num_kv_heads, HEAD
    if kind == "packed":  # vLLM >= 0.2x: LBHNC (HND) or LBNHC (NHD) memory, [B, H, N, C] view
        c = spec.head_size + spec.head_size_v
        if order == "HND":
            return torch.randn(b, h, n, c)
        return torch.randn(b, n, h, c).permute(0, 2, 1, 3)
    if kind == "mla":
        return torch.randn(b, n, spec.head_size)
    lead = (2, b) if kind == "kv_first" else (b, 2)
    if order == "NHD":
        return torch.randn(*lead, n, h, d)
    # get_kv_cache_stride_order puts heads before tokens in memory; the view stays logical.
    return torch.randn(*lead, h, n, d).permute(0, 1, 3, 2, 4)


def _detect(cache: torch.Tensor, backend: str | None, spec: CacheSpec = SPEC) -> KVLayout:
    return detect_layout(cache.shape, cache.stride(), spec, backend)


@pytest.mark.parametrize(
    ("backend", "kind", "order", "block_dim"),
    [
        ("CPU_ATTN", "packed", "HND", 0),
        ("FLASH_ATTN", "packed", "NHD", 0),
        ("FLASHINFER", "packed", "HND", 0),
        (None, "packed", "NHD", 0),
        ("FLASH_ATTN", "kv_first", "NHD", 1),
        ("FLASH_ATTN", "kv_first", "HND", 1),
        ("FLASHINFER", "blocks_kv", "NHD", 0),
        ("FLASHINFER", "blocks_kv", "HND", 0),
        ("TRITON_ATTN", "blocks_kv", "NHD", 0),
    ],
)
def test_each_layout_is_found_from_shape_strides_and_backend(
    backend: str | None, kind: str, order: str, block_dim: int
) -> None:
    layout = _detect(_cache(kind, order), backend)
    assert (layout.kind, layout.order, layout.ratio) == (kind, order, 1)
    assert layout.kernel.block_dim == block_dim
    assert layout.name == f"{kind}/{order}"


def test_mla_latent_caches_old_and_packed() -> None:
    old = _detect(_cache("mla", "-", MLA), "FLASHMLA", MLA)
    assert (old.kind, old.order, old.kernel.ndim) == ("mla", "-", 3)
    packed = _detect(torch.randn(BLOCKS, 1, BLOCK, 24), "FLASHMLA", MLA)
    assert (packed.kind, packed.kernel.ndim) == ("packed", 4)


def test_kernel_blocks_smaller_than_engine_blocks_give_the_ratio() -> None:
    layout = _detect(_cache("packed", "HND", ratio=2), "CPU_ATTN")
    assert layout.ratio == 2
    layout = _detect(_cache("kv_first", "NHD", ratio=4), "FLASH_ATTN")
    assert (layout.kind, layout.ratio) == ("kv_first", 4)


def test_a_5d_cache_of_a_backend_not_known_is_refused_naming_shape_and_backend() -> None:
    cache = _cache("kv_first", "NHD")
    with pytest.raises(ConfigError, match=r"\(2, 6, 4, 3, 8\).*some_new_backend.*known"):
        _detect(cache, "some_new_backend")
    with pytest.raises(ConfigError, match="backend unknown"):
        _detect(cache, None)


def test_a_layout_the_backend_does_not_use_is_refused() -> None:
    # FlashInfer's earlier layout is blocks-first: a kv-first tensor from it is not guessed at.
    with pytest.raises(ConfigError, match="FLASHINFER matches no layout"):
        _detect(_cache("kv_first", "NHD"), "FLASHINFER")


def test_a_shape_that_disagrees_with_the_spec_is_refused() -> None:
    wrong_heads = CacheSpec(BLOCKS, BLOCK, HEADS + 1, HEAD, HEAD)
    with pytest.raises(ConfigError, match="matches no layout"):
        _detect(_cache("packed", "HND"), "CPU_ATTN", wrong_heads)
    more_blocks = CacheSpec(BLOCKS + 1, BLOCK, HEADS, HEAD, HEAD)
    with pytest.raises(ConfigError, match="matches no layout"):
        _detect(_cache("blocks_kv", "NHD"), "FLASHINFER", more_blocks)


@pytest.mark.parametrize(
    ("backend", "kind"),
    [("CPU_ATTN", "packed"), ("FLASH_ATTN", "kv_first"), ("FLASHINFER", "blocks_kv")],
)
def test_gathered_bytes_do_not_depend_on_the_physical_order(backend: str, kind: str) -> None:
    nhd = _cache(kind, "NHD")
    hnd = _cache(kind, "HND")
    hnd.copy_(nhd)  # the same logical values in the other memory order
    layout_n, layout_h = _detect(nhd, backend), _detect(hnd, backend)
    assert (layout_n.order, layout_h.order) == ("NHD", "HND")
    ids = [4, 0, 5]
    a = kvstore_kernels.gather_blocks([nhd], ids, layout_n.kernel)
    b = kvstore_kernels.gather_blocks([hnd], ids, layout_h.kernel)
    assert torch.equal(a, b)
    # ... and scattering them back into an HND cache restores exactly those blocks.
    target = torch.zeros_like(hnd)
    kvstore_kernels.scatter_blocks(a, [target], ids, layout_h.kernel)
    index = torch.tensor(ids)
    dim = layout_h.kernel.block_dim
    assert torch.equal(target.index_select(dim, index), hnd.index_select(dim, index))
