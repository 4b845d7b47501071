"""What the vLLM connector asks of its store: the :class:`StoreClient` protocol.

The connector's halves take any object with these calls, not a :class:`~kvstore.KVStoreClient`
by name, and call them without probing: a stand-in (the tests' ``FakeStore``) implements every
one, answering ``None`` from :meth:`StoreClient.lease` and :meth:`StoreClient.reserve` as a
client that does not reach the store over shared memory does. :class:`~kvstore.KVStoreClient`
satisfies it (mypy checks that where the connector opens one), and so do the tests' stand-ins
(mypy checks ``tests/harness/store_stand_in.py`` and the connector tests that pass them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kvstore.client.arena_registration import Registrar
from kvstore.client.device_fill import DeviceFill
from kvstore.client.shm import ShmLease, ShmReservation
from kvstore.key_scheme import KeyScheme
from kvstore.keys import Namespace
from kvstore.retention import KEEP, Retention
from kvstore.types import LookupResult, PutResult

__all__ = ["StoreClient"]


class StoreClient(Protocol):
    """The calls of :class:`~kvstore.KVStoreClient` the connector uses."""

    @property
    def data_plane(self) -> str:
        """``"shm"``, ``"ucx"`` or ``"grpc"``: the path data calls take now."""
        ...

    def lookup(self, keys: Sequence[bytes], *, timeout: float | None = None) -> int:
        """How many leading ``keys`` the store holds."""
        ...

    def lookup_tiers(self, keys: Sequence[bytes], *, timeout: float | None = None) -> LookupResult:
        """The leading hits and the tier holding each key."""
        ...

    def get_into(
        self, keys: Sequence[bytes], buffers: Sequence[Any], *, timeout: float | None = None
    ) -> list[bool]:
        """Fill ``buffers`` with the blocks; per key, whether it was found."""
        ...

    def get_into_device(
        self,
        keys: Sequence[bytes],
        tensors: Sequence[Any],
        *,
        staging: Sequence[Any] | None = None,
        timeout: float | None = None,
    ) -> DeviceFill:
        """Fill device ``tensors`` with the blocks (over UCX straight into device memory)."""
        ...

    def lease(self, keys: Sequence[bytes], *, timeout: float | None = None) -> ShmLease | None:
        """The blocks' pages in the shared arena, held; ``None`` off shared memory."""
        ...

    def reserve(
        self,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        *,
        timeout: float | None = None,
        retention: Retention = KEEP,
    ) -> ShmReservation | None:
        """Arena pages to write new blocks into; ``None`` off shared memory."""
        ...

    def put(
        self,
        keys: Sequence[bytes],
        values: Sequence[Any],
        *,
        timeout: float | None = None,
        retention: Retention = KEEP,
    ) -> PutResult:
        """Store blocks."""
        ...

    def prefetch(self, keys: Sequence[bytes], *, timeout: float | None = None) -> int:
        """Ask the store to bring ``keys`` up into dram in the background; the prefetch's id."""
        ...

    def stats(self, *, timeout: float | None = None) -> dict[str, Any]:
        """The server's stats."""
        ...

    def key_scheme(
        self, namespace: Namespace, secret_check: str, *, timeout: float | None = None
    ) -> KeyScheme:
        """Declare the engine's base namespace and secret fingerprint; the scheme to use."""
        ...

    def open_data_plane(self, *, timeout: float | None = None) -> str:
        """Connect the fastest data plane now; which one."""
        ...

    def when_reconnected(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the store answers again after a loss."""
        ...

    def register_arena_with(self, registrar: Registrar | None = None) -> None:
        """Page-lock the arena mapping for device DMA (in the background)."""
        ...

    def close(self) -> None:
        """Release the connection."""
        ...
