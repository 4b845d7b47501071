"""The public surface of the package is exactly what the README documents."""

from __future__ import annotations

import kvstore
import kvstore.errors

EXPECTED = {
    "AuthenticationError",
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
}


def test_exported_names() -> None:
    assert set(kvstore.__all__) == EXPECTED
    for name in kvstore.__all__:
        assert hasattr(kvstore, name), name


def test_every_exported_error_is_a_kvstore_error() -> None:
    for name in kvstore.errors.__all__:
        value = getattr(kvstore.errors, name)
        if isinstance(value, type) and issubclass(value, Exception):
            assert issubclass(value, kvstore.KVStoreError), name


def test_public_names_have_docstrings() -> None:
    for name in kvstore.__all__:
        value = getattr(kvstore, name)
        if callable(value) and not isinstance(value, str):
            assert value.__doc__, f"{name} has no docstring"
