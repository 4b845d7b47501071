"""What a stored SGLang page is: its shape, its namespace, and its kvstore key.

SGLang names a page by a chained SHA-256 of its tokens (seeded with the request's ``extra_key``
and cache salt) and nothing else: two models, two TP ranks or two dtypes name the same prompt's
pages alike. So a page is stored under ``H(root ‖ page hash)``, where ``root`` is the kvstore
chain root of a :class:`~kvstore.keys.Namespace` that fingerprints everything that decides the
page's bytes and the key secret (:class:`PageKeys`): model and revision, dtype, layers (and the
pipeline stage's range of them), KV heads, head size, page size, the stored page layout, TP rank
and size (MLA: neither, its KV is the same on every rank and stored once), the deployment's
cache salt and the tenant.

The stored page layout is not SGLang's host layout. Each page is stored in one canonical order,
whatever the host pool's layout (:attr:`PoolShape.page_shape`): ``[2, layers, page, heads,
head_dim]`` for MHA (K then V), ``[layers, page, 1, kv_dim]`` for MLA. That is already the order
of a page in ``layer_first`` and ``page_first_direct`` pools; ``page_first`` pools are transposed
on the copy. So engines with different host layouts but the same model, dtype and shape share
pages (their bytes are provably the same), and the namespace names the canonical order instead.

Nothing here imports SGLang: the host pool and SGLang's ``HiCacheStorageConfig`` are read by
attribute, and what is not supported is refused with one line (:func:`pool_shape`,
:func:`check_parallelism`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import xxhash

from kvstore.integrations.sglang.settings import BackendSettings, refuse
from kvstore.keys import ChunkHasher, HashAlgorithm, Namespace

__all__ = [
    "LAYOUTS",
    "STORED_LAYOUT",
    "PageKeys",
    "PoolShape",
    "check_parallelism",
    "namespace_for",
    "pool_shape",
]

#: SGLang host layouts the backend copies pages of (``--hicache-mem-layout``).
LAYOUTS = ("layer_first", "page_first", "page_first_direct")
#: The stored order of one page, by attention kind (see the module docstring).
STORED_LAYOUT = {"mha": "kv-layer-token-head-dim", "mla": "layer-token-1-dim"}

_PAGE_TAG = b"kvstore-sglang-page-v1\x00"
_HASHES: dict[str, Callable[[bytes], bytes]] = {
    "xxh3_128": xxhash.xxh3_128_digest,
    "sha256": lambda data: hashlib.sha256(data).digest()[:16],
}


@dataclass(frozen=True, slots=True)
class PoolShape:
    """The geometry of one SGLang host pool, as far as a stored page depends on it.

    ``kind`` is ``"mha"`` (``heads`` KV heads of ``head_dim``) or ``"mla"`` (one latent row of
    ``head_dim`` = kv_lora_rank + rope dim per token and layer; ``heads`` is 1).
    """

    kind: Literal["mha", "mla"]
    layout: str
    layers: int
    first_layer: int
    page_size: int
    heads: int
    head_dim: int
    dtype: str
    itemsize: int

    @property
    def page_shape(self) -> tuple[int, ...]:
        """The stored (canonical) shape of one page."""
        if self.kind == "mha":
            return (2, self.layers, self.page_size, self.heads, self.head_dim)
        return (self.layers, self.page_size, 1, self.head_dim)

    @property
    def page_nbytes(self) -> int:
        """Bytes of one stored page."""
        count = 1
        for size in self.page_shape:
            count *= size
        return count * self.itemsize


def pool_shape(pool: Any) -> PoolShape:
    """The :class:`PoolShape` of SGLang's host pool ``pool`` (an ``MHATokenToKVPoolHost`` or an
    ``MLATokenToKVPoolHost``); :func:`~kvstore.integrations.sglang.settings.refuse` for pools and
    layouts whose pages it cannot store whole."""
    kind_name = type(pool).__name__
    layout = str(getattr(pool, "layout", ""))
    if layout not in LAYOUTS:
        refuse(
            f"kvstore HiCache backend: --hicache-mem-layout {layout} is not supported; "
            f"use one of {', '.join(LAYOUTS)}"
        )
    if getattr(pool, "kv_buffer", None) is None:
        refuse(f"kvstore HiCache backend: the host pool {kind_name} holds no KV buffer")
    if int(getattr(pool, "dcp_size", 1)) != 1:
        refuse(
            f"kvstore HiCache backend: decode context parallelism (dcp_size "
            f"{pool.dcp_size}) is not supported; run with a DCP size of 1"
        )
    dtype = pool.dtype

    def shape(kind: Literal["mha", "mla"], heads: int, head_dim: int) -> PoolShape:
        return PoolShape(
            kind,
            layout,
            layers=int(pool.layer_num),
            first_layer=int(getattr(pool, "start_layer", 0) or 0),
            page_size=int(pool.page_size),
            heads=heads,
            head_dim=head_dim,
            dtype=str(dtype).removeprefix("torch."),
            itemsize=int(dtype.itemsize),
        )

    if hasattr(pool, "kv_lora_rank"):  # MLA: one latent row per token and layer
        return shape("mla", 1, int(pool.kv_cache_dim))
    if not hasattr(pool, "head_num"):
        refuse(f"kvstore HiCache backend: cannot store pages of a {kind_name} host pool")
    if int(pool.v_head_dim) != int(pool.head_dim):
        refuse(
            f"kvstore HiCache backend: K and V head sizes differ ({pool.head_dim} and "
            f"{pool.v_head_dim}); only equal sizes are supported"
        )
    return shape("mha", int(pool.head_num), int(pool.head_dim))


def check_parallelism(config: Any) -> None:
    """Refuse SGLang parallel set-ups whose pages this backend cannot name apart: attention
    context parallelism (each rank holds a slice of every page) and split heads."""
    if int(getattr(config, "attn_cp_size", 1)) != 1:
        refuse(
            f"kvstore HiCache backend: attention context parallelism (attn_cp_size "
            f"{config.attn_cp_size}) is not supported; run with a CP size of 1"
        )
    if getattr(config, "should_split_heads", False):
        refuse(
            "kvstore HiCache backend: split heads (tp_lcm_size, page_head layout) is not "
            "supported; leave tp_lcm_size out of the extra config"
        )


def namespace_for(shape: PoolShape, config: Any, settings: BackendSettings) -> Namespace:
    """The namespace of this rank's pages: ``config`` is SGLang's ``HiCacheStorageConfig``.

    MLA KV is the same on every TP rank: it is named as rank 0 of 1, so that every rank (and
    every TP size) reads the one copy rank 0 stored.
    """
    mla = shape.kind == "mla"
    tp_rank, tp_size = (0, 1) if mla else (int(config.tp_rank), int(config.tp_size))
    # A pipeline stage holds a range of the layers: the stage and its first layer say which.
    pp = f"pp{int(config.pp_rank)}of{int(config.pp_size)}/from{shape.first_layer}"
    layout = f"sglang/{shape.kind}/{STORED_LAYOUT[shape.kind]}/page{shape.page_size}/{pp}"
    return Namespace(
        model=str(config.model_name or "unnamed"),
        revision=settings.revision,
        num_layers=shape.layers,
        num_kv_heads=shape.heads,
        head_size=shape.head_dim,
        dtype=shape.dtype,
        cache_layout=layout,
        tp_rank=tp_rank,
        tp_size=tp_size,
        tenant=settings.tenant,
        cache_salt=settings.cache_salt,
    )


class PageKeys:
    """SGLang page hashes -> kvstore keys under one namespace, secret and hash algorithm.

    >>> from kvstore.keys import Namespace
    >>> keys = PageKeys(Namespace(model="demo"), 16, b"secret", "xxh3_128")
    >>> len(keys.of(["ab" * 32])[0])
    16
    """

    def __init__(
        self, namespace: Namespace, page_size: int, secret: bytes, algorithm: HashAlgorithm
    ) -> None:
        self.namespace = namespace
        self.algorithm: HashAlgorithm = algorithm
        # The chain root of kvstore's own keys: the namespace's fingerprint keyed by the secret.
        root = ChunkHasher(page_size, namespace, secret=secret, algorithm=algorithm).root
        self._prefix = _PAGE_TAG + root
        self._hash = _HASHES[algorithm]

    def of(self, page_hashes: Sequence[str]) -> list[bytes]:
        """The key of each page hash (SGLang's hex digests; any other string is taken as is)."""
        prefix, digest = self._prefix, self._hash
        return [digest(prefix + _hash_bytes(text)) for text in page_hashes]


def _hash_bytes(text: str) -> bytes:
    # Tagged by kind, so that no other string ever names the bytes a hex digest does.
    try:
        return b"\x01" + bytes.fromhex(text)
    except ValueError:
        return b"\x02" + text.encode()
