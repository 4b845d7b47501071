"""kvstore: a distributed, tiered KV-cache store service for LLM inference.

The public surface::

    Namespace, ChunkHasher          name KV blocks by chained prefix-chunk keys
    KVStoreClient, AsyncKVStoreClient   talk to a ``kvstore serve`` process
    MockTransport                   a client's transport answered by a function, for tests
    TieredStore                     the store core, for embedding (loaded on first use: a
                                    client process never pays for LMDB or Redis)
    LookupResult, PutResult         results of client and store calls
    Retention                       what a put asks: keep N seconds, memory only, not at all
    Config, load_config             configuration
    KVStoreError and subclasses     the one exception tree (see :mod:`kvstore.errors`)
"""

import importlib
from typing import TYPE_CHECKING, Any

from kvstore import deprecation
from kvstore.client import AsyncKVStoreClient, KVStoreClient, MockTransport
from kvstore.errors import (
    AuthenticationError,
    CapacityError,
    ConfigError,
    DeadlineExceededError,
    InternalStoreError,
    InvalidRequestError,
    KVStoreError,
    NamespaceMismatchError,
    StoreUnavailableError,
    UnknownPrefetchError,
)
from kvstore.keys import BlockKey, ChunkHasher, Namespace
from kvstore.retention import Retention
from kvstore.types import LookupResult, PutResult

if TYPE_CHECKING:
    from kvstore.config import Config, load_config
    from kvstore.store import TieredStore

__version__ = "0.1.0"

# The old import paths of moved modules (kvstore.store_config, ...) still work, with a warning.
deprecation.install()


#: Names loaded on first use: the store (and with it LMDB, Redis and every tier) only when
#: someone embeds it, the configuration sections only when someone loads a configuration.
_LAZY = {
    "TieredStore": "kvstore.store",
    "Config": "kvstore.config",
    "load_config": "kvstore.config",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if f"kvstore.{name}" in deprecation.MOVED_MODULES:  # ``kvstore.sizes`` as an attribute
        return importlib.import_module(f"kvstore.{name}")
    raise AttributeError(f"module 'kvstore' has no attribute {name!r}")


__all__ = [
    "AsyncKVStoreClient",
    "AuthenticationError",
    "BlockKey",
    "CapacityError",
    "ChunkHasher",
    "Config",
    "ConfigError",
    "DeadlineExceededError",
    "InternalStoreError",
    "InvalidRequestError",
    "KVStoreClient",
    "KVStoreError",
    "LookupResult",
    "MockTransport",
    "Namespace",
    "NamespaceMismatchError",
    "PutResult",
    "Retention",
    "StoreUnavailableError",
    "TieredStore",
    "UnknownPrefetchError",
    "__version__",
    "load_config",
]
