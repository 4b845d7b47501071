"""A real store whose key scheme names chunks of the test's size, for connector tests.

The connector takes its chunk size from its store (``KeyScheme``,
:mod:`kvstore.integrations.vllm_scheme`) and refuses to start where its own setting differs. A
test's ``kvstore serve`` answers the node's ``keys.chunk_size``; where a test's server cannot be
given that setting, :func:`store_chunk_size` makes every :class:`~kvstore.KVStoreClient` built
while it lasts report the test's chunk size in the real server's answer (the call itself still
goes to the server: the namespace is declared, the secret compared).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

from kvstore import KVStoreClient
from kvstore.key_scheme import KeyScheme
from kvstore.keys import Namespace

__all__ = ["store_chunk_size"]


@contextlib.contextmanager
def store_chunk_size(chunk_size: int) -> Iterator[None]:
    """While it lasts, ``KVStoreClient.key_scheme`` answers the server's scheme with
    ``chunk_size`` tokens per chunk."""
    original = KVStoreClient.key_scheme

    def answer(
        self: KVStoreClient,
        namespace: Namespace,
        secret_check: str,
        *,
        timeout: float | None = None,
    ) -> KeyScheme:
        scheme = original(self, namespace, secret_check, timeout=timeout)
        return dataclasses.replace(scheme, chunk_size=chunk_size)

    KVStoreClient.key_scheme = answer  # type: ignore[method-assign]
    try:
        yield
    finally:
        KVStoreClient.key_scheme = original  # type: ignore[method-assign]
