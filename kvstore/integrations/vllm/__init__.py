"""The vLLM KV connector (:class:`KVStoreConnector`), loaded by vLLM from this module path.

``kv_connector_module_path: "kvstore.integrations.vllm"`` names this package; vLLM then reads
``KVStoreConnector`` from it. The connector class is imported lazily, on that first attribute
access, because it subclasses vLLM's base class: the connector's logic (:mod:`.scheduler`,
:mod:`.worker`, :mod:`.common` and the rest) stays importable, and tested, without vLLM.
See :mod:`.connector` for the settings and how it works.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["ConnectorSettings", "KVStoreConnector", "KVStoreConnectorMetadata"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("kvstore.integrations.vllm.connector"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
