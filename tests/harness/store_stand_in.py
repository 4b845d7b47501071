"""A base for the connector tests' stand-ins of :class:`kvstore.KVStoreClient`.

The connector calls its store through :class:`kvstore.integrations.store_client.StoreClient`
without probing for methods, so a stand-in answers every call: this base answers each as a
client off shared memory and UCX would (``lease``/``reserve`` ``None``, data over ``grpc``), with
nothing stored; a test's stand-in overrides what it plays.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvstore.client.device_fill import DeviceFill
from kvstore.client.shm import ShmLease, ShmReservation
from kvstore.types import LookupResult, PutResult

__all__ = ["StoreStandIn"]


class StoreStandIn:
    """Every call of the connector's store: an empty store reached over gRPC."""

    #: The path its data calls take.
    data_plane = "grpc"

    def lookup(self, keys: Sequence[bytes], *, timeout: float | None = None) -> int:
        return 0

    def lookup_tiers(self, keys: Sequence[bytes], *, timeout: float | None = None) -> LookupResult:
        hits = self.lookup(keys, timeout=timeout)
        return LookupResult(hits, ["dram"] * hits + [""] * (len(keys) - hits))

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[Any], **_: Any) -> list[bool]:
        return [False] * len(keys)

    def get_into_device(
        self, keys: Sequence[bytes], tensors: Sequence[Any], **_: Any
    ) -> DeviceFill:
        raise AssertionError("get_into_device is only asked of a store reached over UCX")

    def lease(self, keys: Sequence[bytes], **_: Any) -> ShmLease | None:
        return None  # not over shared memory

    def reserve(
        self, keys: Sequence[bytes], sizes: Sequence[int], **_: Any
    ) -> ShmReservation | None:
        return None  # not over shared memory

    def put(self, keys: Sequence[bytes], values: Sequence[Any], **_: Any) -> PutResult:
        return PutResult(stored=len(keys), already_present=0, dropped=0)

    def prefetch(self, keys: Sequence[bytes], **_: Any) -> int:
        return 0

    def stats(self, **_: Any) -> dict[str, Any]:
        return {}

    def open_data_plane(self, **_: Any) -> str:
        return self.data_plane

    def when_reconnected(self, callback: Callable[[], None]) -> None:
        pass

    def register_arena_with(self, registrar: Any = None) -> None:
        pass

    def close(self) -> None:
        pass
