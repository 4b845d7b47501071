"""kvstore as SGLang's HiCache storage backend (``--hicache-storage-backend dynamic``).

SGLang loads :class:`~kvstore.integrations.sglang.backend.KVStoreHiCacheStorage` from here
(``"module_path": "kvstore.integrations.sglang", "class_name": "KVStoreHiCacheStorage"``); see
``docs/sglang.md``. Only that class imports SGLang, and only when it is asked for (this module's
``__getattr__``): the logic under it (:mod:`.settings`, :mod:`.identity`, :mod:`.pages`,
:mod:`.scheme`, :mod:`.transfer`, :mod:`.metrics`) loads and is tested without SGLang. Nothing
here imports vLLM (the layering test says so).
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVStoreHiCacheStorage"]


def __getattr__(name: str) -> Any:
    if name == "KVStoreHiCacheStorage":
        from kvstore.integrations.sglang.backend import KVStoreHiCacheStorage

        return KVStoreHiCacheStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
