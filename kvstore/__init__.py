"""kvstore: a distributed, tiered KV-cache store service for LLM inference.

The public surface::

    Namespace, ChunkHasher, BlockKey    name KV blocks by chained prefix-chunk keys
    KeyScheme                           how a deployment names chunks (``key_scheme()``)
    KVStoreClient, AsyncKVStoreClient   talk to a ``kvstore serve`` process
    MockTransport                       a client's transport answered by a function, for
                                        tests (with the in-memory store: :mod:`kvstore.testing`)
    TieredStore                         the store core, for embedding (loaded on first use: a
                                        client process never pays for LMDB or Redis)
    LookupResult, PutResult             results of client and store calls
    PrefetchProgress, PrefetchState     where a prefetch stands (``prefetch_status()``)
    ShmLease, ShmReservation            blocks lent or reserved in the shared-memory arena
                                        (``lease()``, ``reserve()``)
    DeviceFill                          a copy into device memory under way
                                        (``get_into_device()``)
    Retention                           what a put asks: keep N seconds, memory only, not at all
    Config, load_config                 configuration (loaded on first use)
    KVStoreError and subclasses         the one exception tree (see :mod:`kvstore.errors`)

Every type a client's public method returns is here (but its settings, which
:mod:`kvstore.client` offers as ``ClientSettings``), and every error it raises.
"""

import importlib
from typing import TYPE_CHECKING, Any

from kvstore import deprecation
from kvstore.client import AsyncKVStoreClient, KVStoreClient, MockTransport
from kvstore.client.device_fill import DeviceFill
from kvstore.client.shm import ShmLease, ShmReservation
from kvstore.errors import (
    AuthenticationError,
    CapacityError,
    ConfigError,
    DeadlineExceededError,
    InternalStoreError,
    InvalidRequestError,
    KVStoreError,
    NamespaceMismatchError,
    PermissionDeniedError,
    StoreUnavailableError,
    UnknownPrefetchError,
)
from kvstore.key_scheme import KeyScheme
from kvstore.keys import BlockKey, ChunkHasher, Namespace
from kvstore.protocol.shm_frames import ProtocolError
from kvstore.retention import Retention
from kvstore.types import LookupResult, PrefetchProgress, PrefetchState, PutResult

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
    "DeviceFill",
    "InternalStoreError",
    "InvalidRequestError",
    "KVStoreClient",
    "KVStoreError",
    "KeyScheme",
    "LookupResult",
    "MockTransport",
    "Namespace",
    "NamespaceMismatchError",
    "PermissionDeniedError",
    "PrefetchProgress",
    "PrefetchState",
    "ProtocolError",
    "PutResult",
    "Retention",
    "ShmLease",
    "ShmReservation",
    "StoreUnavailableError",
    "TieredStore",
    "UnknownPrefetchError",
    "__version__",
    "load_config",
]
