"""kvstore as SGLang's HiCache storage backend: :class:`KVStoreHiCacheStorage`.

SGLang (0.5.23) loads it with ``--hicache-storage-backend dynamic`` and
``--hicache-storage-backend-extra-config '{"backend_name": "kvstore", "module_path":
"kvstore.integrations.sglang", "class_name": "KVStoreHiCacheStorage", "interface_v1": 1,
"target": "HOST:PORT"}'`` (the other keys: :mod:`kvstore.integrations.sglang.settings`), builds
it as ``cls(storage_config, kwargs)`` on every TP rank's scheduler, then registers its host pool
(:meth:`KVStoreHiCacheStorage.register_mem_pool_host`): only then is the page's shape known, so
that is where the namespace is made, the store's key scheme agreed and the client opened.

SGLang's calls and what they do here (the work is :class:`~kvstore.integrations.sglang.transfer.
PageStore`'s): ``batch_exists`` the leading stored pages; ``batch_get_v1`` / ``batch_set_v1``
(with ``"interface_v1": 1``) pages between the host pool and the store's arena, zero-copy on the
store's side; the legacy ``get`` / ``set`` / ``batch_get`` / ``batch_set`` / ``exists`` flat
pages in the host layout's order. The multi-pool ``*_v2`` calls (hybrid models) are not
supported: SGLang refuses such models with this backend by itself (they raise
``NotImplementedError``, SGLang's base behaviour).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageExtraInfo

from kvstore.integrations.sglang.identity import check_parallelism
from kvstore.integrations.sglang.metrics import Metrics
from kvstore.integrations.sglang.opening import open_pages
from kvstore.integrations.sglang.pages import flat_to_stored, stored_to_flat
from kvstore.integrations.sglang.scheme import SchemeAgreement
from kvstore.integrations.sglang.settings import BackendSettings
from kvstore.integrations.sglang.transfer import PageStore

__all__ = ["KVStoreHiCacheStorage"]

logger = logging.getLogger("kvstore.integrations.sglang")


class KVStoreHiCacheStorage(HiCacheStorage):  # type: ignore[misc]  # SGLang is untyped
    """SGLang's HiCache storage in kvstore (see the module docstring)."""

    def __init__(self, storage_config: Any, kwargs: dict[str, Any] | None = None) -> None:
        self.storage_config = storage_config
        self.settings = BackendSettings.from_extra_config(storage_config.extra_config)
        check_parallelism(storage_config)
        self.tp_rank = int(storage_config.tp_rank)
        self.metrics = Metrics(self.tp_rank)
        self._pages: PageStore | None = None
        self.scheme: SchemeAgreement | None = None

    # -- set-up ----------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Take SGLang's host pool: name this rank's pages, agree the key scheme, connect."""
        super().register_mem_pool_host(mem_pool_host)
        self._pages, self.scheme = open_pages(
            self.settings, self.storage_config, mem_pool_host, self.metrics
        )

    @property
    def pages(self) -> PageStore:
        """The rank's pages in the store (after :meth:`register_mem_pool_host`)."""
        if self._pages is None:
            raise RuntimeError("the kvstore HiCache backend has no host pool registered yet")
        return self._pages

    # -- zero-copy calls -------------------------------------------------------------------

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many leading pages of ``keys`` the store holds."""
        return self.pages.exists(keys)

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Copy the pages of ``keys`` into the host pool at ``host_indices``; which came."""
        return self.pages.load(keys, host_indices)

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Store the host pool's pages at ``host_indices`` under ``keys``; which it holds."""
        return self.pages.store(keys, host_indices)

    # -- legacy calls: flat pages in the host layout's order --------------------------------

    def get(
        self, key: str, target_location: Any | None = None, target_sizes: Any | None = None
    ) -> torch.Tensor | None:
        """The page of ``key`` written into ``target_location`` (a flat page), else ``None``."""
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self,
        keys: list[str],
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> list[torch.Tensor | None]:
        """Each page of ``keys`` written into its flat target page; ``None`` where missing."""
        pages = self.pages
        targets = list(target_locations or [None] * len(keys))
        out: list[torch.Tensor | None] = []
        for stored, target in zip(pages.get_pages(keys), targets, strict=True):
            if stored is None:
                out.append(None)
                continue
            if target is None:
                target = torch.empty(stored.numel(), dtype=stored.dtype)
            if target.numel() != stored.numel():
                out.append(None)
                continue
            stored_to_flat(stored, target, pages.shape)
            out.append(target)
        return out

    def set(
        self,
        key: str,
        value: Any | None = None,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        """Store one flat page (the host layout's order) under ``key``."""
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any | None = None,
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        """Store flat pages under ``keys``; whether the store holds them all."""
        pages = self.pages
        nbytes = pages.shape.page_nbytes
        values = list(values or [])
        if len(values) != len(keys) or any(v.numel() * v.element_size() != nbytes for v in values):
            logger.warning(
                "kvstore HiCache backend: batch_set got %d values of other sizes than %d keys "
                "of %d B pages; nothing stored",
                len(values),
                len(keys),
                nbytes,
            )
            return False
        return pages.put_pages(keys, [flat_to_stored(v, pages.shape) for v in values])

    def exists(self, key: str) -> bool:
        """Whether the store holds the page of ``key``."""
        return self.pages.exists([key]) == 1

    # -- the rest --------------------------------------------------------------------------

    def clear(self) -> None:
        """Nothing: the store is shared with other engines; it evicts by itself."""
        logger.info("kvstore HiCache backend: clear() leaves the shared store as it is")

    def close(self) -> None:
        """Close the connection to the store."""
        if self._pages is not None:
            self._pages.close()
