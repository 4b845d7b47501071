"""Which layout a vLLM per-layer paged KV cache has, found from its shape, strides and backend.

The connector copies whole blocks (see :mod:`kvstore_kernels`), so it needs to know which
dimension of a layer's cache indexes blocks and that the other dimensions are what the engine's
configuration says. vLLM has handed connectors these per-layer tensors:

``packed``     ``[num_blocks, heads, block_size, head_size + head_size_v]`` -- the logical view
               vLLM >= 0.2x builds for every backend (``create_kv_cache_views``), K and V packed
               in the last dimension; the CPU backend's cache, and FlashAttention's and
               FlashInfer's in that vLLM. MLA is the same view with one head and
               ``head_size_v == 0`` (the latent vector). The physical order (vLLM's
               ``KVCacheLayout``: LBHNC = HND, LBNHC = NHD, ...) only changes the strides.
``kv_first``   ``[2, num_blocks, block_size, heads, head_size]`` -- FlashAttention (and Flex,
               xFormers, torch SDPA) in earlier vLLM, from the backend's
               ``get_kv_cache_shape``; an ``HND`` ``get_kv_cache_stride_order`` makes it a
               permuted view of ``[2, num_blocks, heads, block_size, head_size]`` memory.
``blocks_kv``  ``[num_blocks, 2, block_size, heads, head_size]`` -- FlashInfer and the Triton
               backend in earlier vLLM, with the same ``HND`` variant.
``mla``        ``[num_blocks, block_size, latent]`` -- the MLA backends in earlier vLLM.

Nothing is guessed: a 4-D cache must match the ``packed`` view of the engine's spec exactly; a
5-D or 3-D cache is only read as the layout its attention backend is known to use; anything else
is refused with a :class:`~kvstore.errors.ConfigError` naming the shape and the backend. An
attention kernel may split an engine block into ``ratio`` kernel blocks of
``block_size / ratio`` tokens; the block dimension then counts kernel blocks.

Whatever the physical order, a gathered block is written in the *logical* order above
(``index_select`` along the block dimension), so the bytes stored for a chunk do not depend on
the strides; the order (``NHD`` / ``HND``) is still reported, as it decides whether the Triton
kernels can run (they need unit-stride rows) and is part of the engine's namespace.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import kvstore_kernels  # type: ignore[import-not-found, unused-ignore]

from kvstore.errors import ConfigError

__all__ = ["BACKEND_LAYOUTS", "CacheSpec", "KVLayout", "detect_layout"]

# How the kernels see each layout: the block dimension and the rank.
_KERNEL_LAYOUTS = {
    "packed": kvstore_kernels.CacheLayout("vllm-packed", block_dim=0, ndim=4),
    "kv_first": kvstore_kernels.CacheLayout("vllm-kv-first", block_dim=1, ndim=5),
    "blocks_kv": kvstore_kernels.CacheLayout("vllm-blocks-kv", block_dim=0, ndim=5),
    "mla": kvstore_kernels.CacheLayout("vllm-mla", block_dim=0, ndim=3),
}

BACKEND_LAYOUTS: dict[str, str] = {
    # get_kv_cache_shape -> (2, num_blocks, block_size, num_kv_heads, head_size)
    "FLASH_ATTN": "kv_first",
    "FLASH_ATTN_VLLM_V1": "kv_first",
    "FLEX_ATTENTION": "kv_first",
    "XFORMERS": "kv_first",
    "TORCH_SDPA": "kv_first",
    "TREE_ATTN": "kv_first",
    # get_kv_cache_shape -> (num_blocks, 2, block_size, num_kv_heads, head_size)
    "FLASHINFER": "blocks_kv",
    "FLASHINFER_VLLM_V1": "blocks_kv",
    "TRITON_ATTN": "blocks_kv",
    "TRITON_ATTN_VLLM_V1": "blocks_kv",
    # get_kv_cache_shape -> (num_blocks, block_size, head_size) (the latent vector)
    "FLASHMLA": "mla",
    "FLASHMLA_SPARSE": "mla",
    "CUTLASS_MLA": "mla",
    "TRITON_MLA": "mla",
    "FLASHINFER_MLA": "mla",
    "FLASH_ATTN_MLA": "mla",
    # Only the packed view (vLLM >= 0.2x hands it to every backend).
    "CPU_ATTN": "packed",
}
"""The earlier-vLLM (``get_kv_cache_shape``) layout of each attention backend by name."""


@dataclass(frozen=True, slots=True)
class CacheSpec:
    """What the engine's configuration says one layer's cache holds.

    Attributes:
        num_blocks: Engine blocks (``KVCacheConfig.num_blocks``).
        block_size: Tokens per engine block.
        num_kv_heads: KV heads of this rank (1 for MLA).
        head_size: K head size (the latent size for MLA).
        head_size_v: V head size (``head_size`` unless the model differs; 0 for MLA).
        mla: Whether the model uses multi-head latent attention.
    """

    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_size: int
    head_size_v: int
    mla: bool = False


@dataclass(frozen=True, slots=True)
class KVLayout:
    """A recognised layout of one layer's cache.

    Attributes:
        kind: ``packed``, ``kv_first``, ``blocks_kv`` or ``mla`` (see the module docstring).
        order: Physical order of heads and tokens inside a block: ``NHD`` or ``HND``
            (``-`` for MLA, which has no head dimension to order).
        kernel: How :mod:`kvstore_kernels` sees it (block dimension and rank).
        ratio: Kernel blocks per engine block.
    """

    kind: str
    order: str
    kernel: kvstore_kernels.CacheLayout
    ratio: int

    @property
    def name(self) -> str:
        """``kind/order``, e.g. ``kv_first/HND``."""
        return f"{self.kind}/{self.order}"


def _expected(kind: str, spec: CacheSpec, ratio: int) -> tuple[int, ...]:
    """The shape a ``kind`` cache of ``spec`` has when engine blocks are ``ratio`` kernel blocks."""
    blocks, tokens = spec.num_blocks * ratio, spec.block_size // ratio
    heads, head = spec.num_kv_heads, spec.head_size
    if kind == "packed":
        return (blocks, heads, tokens, spec.head_size + spec.head_size_v)
    if kind == "kv_first":
        return (2, blocks, tokens, heads, head)
    if kind == "blocks_kv":
        return (blocks, 2, tokens, heads, head)
    return (blocks, tokens, head)  # mla


# Where the heads and the tokens are in each kind's logical shape.
_HEAD_TOKEN_DIMS = {"packed": (1, 2), "kv_first": (3, 2), "blocks_kv": (3, 2)}


def _order(kind: str, shape: Sequence[int], strides: Sequence[int]) -> str:
    """``HND`` when heads are outside tokens in memory, else ``NHD``."""
    if kind not in _HEAD_TOKEN_DIMS:
        return "-"
    heads, tokens = _HEAD_TOKEN_DIMS[kind]
    # With one head (or one token) both orders are the same bytes; call it NHD.
    if shape[heads] > 1 and shape[tokens] > 1 and strides[heads] > strides[tokens]:
        return "HND"
    return "NHD"


def _ratio(kind: str, shape: Sequence[int], spec: CacheSpec) -> int | None:
    """The kernel-block ratio under which ``shape`` is a ``kind`` cache of ``spec``, if any."""
    layout = _KERNEL_LAYOUTS[kind]
    if len(shape) != layout.ndim or spec.num_blocks <= 0:
        return None
    blocks = int(shape[layout.block_dim])
    if blocks % spec.num_blocks:
        return None
    ratio = blocks // spec.num_blocks
    if ratio < 1 or spec.block_size % ratio:
        return None
    return ratio if tuple(int(d) for d in shape) == _expected(kind, spec, ratio) else None


def detect_layout(
    shape: Sequence[int], strides: Sequence[int], spec: CacheSpec, backend: str | None
) -> KVLayout:
    """The layout of a layer cache of ``shape``/``strides`` from attention backend ``backend``.

    ``backend`` is the backend's ``get_name()`` (``None`` when unknown); it is needed only for
    the earlier-vLLM 5-D and 3-D shapes, whose meaning depends on it.

    Raises:
        ConfigError: when the shape matches no layout the backend is known to use, naming the
            shape, the backend and the shapes that were expected.
    """
    name = (backend or "").upper()
    kinds = ["packed"]
    classic = BACKEND_LAYOUTS.get(name)
    if classic is not None and classic != "packed":
        kinds.append(classic)
    matches = [(kind, ratio) for kind in kinds if (ratio := _ratio(kind, shape, spec))]
    if len(matches) != 1:
        wanted = ", ".join(f"{kind} {_expected(kind, spec, 1)}" for kind in kinds)
        known = "" if classic is not None else f" (backends known: {sorted(BACKEND_LAYOUTS)})"
        raise ConfigError(
            f"KV cache of shape {tuple(int(d) for d in shape)} from attention backend "
            f"{backend or 'unknown'} matches {'several' if matches else 'no'} layout kvstore "
            f"knows for {spec}: expected {wanted}{known}"
        )
    kind, ratio = matches[0]
    return KVLayout(kind, _order(kind, shape, strides), _KERNEL_LAYOUTS[kind], ratio)
