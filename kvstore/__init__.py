"""kvstore: a distributed, tiered KV-cache store service for LLM inference.

The public surface::

    Namespace, ChunkHasher          name KV blocks by chained prefix-chunk keys
    KVStoreClient, AsyncKVStoreClient   talk to a ``kvstore serve`` process
    TieredStore                     the store core, for embedding
    LookupResult, PutResult         results of client and store calls
    Config, load_config             configuration
    KVStoreError and subclasses     the one exception tree (see :mod:`kvstore.errors`)
"""

from kvstore.client import AsyncKVStoreClient, KVStoreClient
from kvstore.config import Config, load_config
from kvstore.errors import (
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
from kvstore.store import LookupResult, PutResult, TieredStore

__version__ = "0.1.0"

__all__ = [
    "AsyncKVStoreClient",
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
    "Namespace",
    "NamespaceMismatchError",
    "PutResult",
    "StoreUnavailableError",
    "TieredStore",
    "UnknownPrefetchError",
    "__version__",
    "load_config",
]
