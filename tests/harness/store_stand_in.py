"""A base for the connector tests' stand-ins of :class:`kvstore.KVStoreClient`.

The connector calls its store through :class:`kvstore.integrations.store_client.StoreClient`
without probing for methods, so a stand-in answers every call: this base answers each as a
client off shared memory and UCX would (``lease``/``reserve`` ``None``, data over ``grpc``), with
nothing stored; a test's stand-in overrides what it plays. Its ``key_scheme`` plays a store that
cannot be reached (the connector goes on with its configured chunk size) unless a test sets
``scheme`` (then it answers that scheme's chunk size and hash algorithm).

Its calls take the protocol's own parameters (keyword-only ``timeout``, ``retention``), not
``**kwargs``: mypy checks ``tests/harness`` and ``tests/integrations``, so a stand-in that drifts
from the protocol is reported, and the connector passing a keyword the real client does not take
fails against the stand-in as it would against the client.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvstore.client.arena_registration import Registrar
from kvstore.client.device_fill import DeviceFill
from kvstore.client.shm import ShmLease, ShmReservation
from kvstore.errors import StoreUnavailableError
from kvstore.integrations.store_client import StoreClient
from kvstore.key_scheme import KeyScheme, engine_base
from kvstore.keys import Namespace
from kvstore.retention import KEEP, Retention
from kvstore.types import LookupResult, PutResult

__all__ = ["StoreStandIn"]


class StoreStandIn:
    """Every call of the connector's store: an empty store reached over gRPC."""

    #: The path its data calls take.
    data_plane = "grpc"
    #: What ``key_scheme`` answers (``None``: the store cannot be reached).
    scheme: KeyScheme | None = None

    def lookup(self, keys: Sequence[bytes], *, timeout: float | None = None) -> int:
        return 0

    def lookup_tiers(self, keys: Sequence[bytes], *, timeout: float | None = None) -> LookupResult:
        hits = self.lookup(keys, timeout=timeout)
        return LookupResult(hits, ["dram"] * hits + [""] * (len(keys) - hits))

    def get_into(
        self, keys: Sequence[bytes], buffers: Sequence[Any], *, timeout: float | None = None
    ) -> list[bool]:
        return [False] * len(keys)

    def get_into_device(
        self,
        keys: Sequence[bytes],
        tensors: Sequence[Any],
        *,
        staging: Sequence[Any] | None = None,
        timeout: float | None = None,
    ) -> DeviceFill:
        raise AssertionError("get_into_device is only asked of a store reached over UCX")

    def lease(self, keys: Sequence[bytes], *, timeout: float | None = None) -> ShmLease | None:
        return None  # not over shared memory

    def reserve(
        self,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        *,
        timeout: float | None = None,
        retention: Retention = KEEP,
    ) -> ShmReservation | None:
        return None  # not over shared memory

    def put(
        self,
        keys: Sequence[bytes],
        values: Sequence[Any],
        *,
        timeout: float | None = None,
        retention: Retention = KEEP,
    ) -> PutResult:
        return PutResult(stored=len(keys), already_present=0, dropped=0)

    def prefetch(self, keys: Sequence[bytes], *, timeout: float | None = None) -> int:
        return 0

    def stats(self, *, timeout: float | None = None) -> dict[str, Any]:
        return {}

    def key_scheme(
        self, namespace: Namespace, secret_check: str, *, timeout: float | None = None
    ) -> KeyScheme:
        if self.scheme is None:
            raise StoreUnavailableError("the stand-in plays a store that cannot be reached")
        base = engine_base(namespace)
        return dataclasses.replace(self.scheme, namespace=base)

    def open_data_plane(self, *, timeout: float | None = None) -> str:
        return self.data_plane

    def when_reconnected(self, callback: Callable[[], None]) -> None:
        pass

    def register_arena_with(self, registrar: Registrar | None = None) -> None:
        pass

    def close(self) -> None:
        pass


if TYPE_CHECKING:
    # Where mypy runs: a drift from the protocol is reported here, at the stand-in, as well as
    # at each test that hands one to the connector.
    _IS_A_STORE_CLIENT: StoreClient = StoreStandIn()
