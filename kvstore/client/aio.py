"""The asyncio client, :class:`AsyncKVStoreClient`: the shared plans (:mod:`kvstore.client.core`)
awaited on the caller's event loop.

gRPC calls go over a ``grpc.aio`` channel (or the ``transport`` given); blocking work (copies
through shared memory, UCX transfers, which run on the UCX client's own loop thread and make their
control calls on a blocking channel of their own) goes to a worker thread, so the event loop never
waits on it. Same methods, paths, deadlines and errors as
:class:`~kvstore.client.sync.KVStoreClient`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, TypeVar, cast

import grpc

from kvstore.client.base import (
    ClientBase,
    client_settings,
    no_control_channel,
    transport_settings,
)
from kvstore.client.channel import ChannelSecurity, Pem
from kvstore.client.core import Blocking, Plan, Rpc, Step
from kvstore.client.device_fill import DeviceFill
from kvstore.client.settings import ClientSettings
from kvstore.client.shm import ShmLease, ShmReservation
from kvstore.client.transport import AsyncGrpcTransport, AsyncTransport
from kvstore.key_scheme import KeyScheme
from kvstore.keys import Namespace
from kvstore.retention import KEEP, Retention
from kvstore.types import LookupResult, PrefetchProgress, PutResult

__all__ = ["AsyncKVStoreClient"]

T = TypeVar("T")


class AsyncKVStoreClient(ClientBase):
    """The asyncio twin of :class:`~kvstore.KVStoreClient` (``aclose`` instead of ``close``).

    ``transport`` is an :class:`~kvstore.client.transport.AsyncTransport` (``acall`` and
    ``aclose``; :class:`~kvstore.client.MockTransport` is one), under the same rules as the
    blocking client's ``transport``.
    """

    def __init__(
        self,
        target: str,
        *,
        namespace: Namespace | bytes | None = None,
        timeout: float = 5.0,
        data_plane: str | None = None,
        settings: ClientSettings | None = None,
        token: str | None = None,
        tls_ca: Pem = None,
        tls_cert: Pem = None,
        tls_key: Pem = None,
        transport: AsyncTransport | None = None,
    ) -> None:
        resolved = client_settings(settings, data_plane)  # bad settings: fail before connecting
        control: Callable[[], grpc.Channel] = no_control_channel
        if transport is None:
            security = ChannelSecurity.for_client(resolved, token, tls_ca, tls_cert, tls_key)
            default = AsyncGrpcTransport(target, security)
            transport, control = default, default.control_channel
        else:
            channel = {"token": token, "tls_ca": tls_ca, "tls_cert": tls_cert, "tls_key": tls_key}
            resolved = transport_settings(resolved, data_plane, channel)
        self._transport: AsyncTransport = transport
        super().__init__(target, namespace, timeout, resolved, control)

    async def _run(self, plan: Plan[T]) -> T:
        """Drive ``plan`` to its end: await each step, send or throw back its outcome."""
        try:
            step = next(plan)
            while True:
                try:
                    outcome = await self._step(step)
                except Exception as exc:
                    step = plan.throw(exc)
                else:
                    step = plan.send(outcome)
        except StopIteration as stop:
            return cast(T, stop.value)

    async def _step(self, step: Step) -> Any:
        if isinstance(step, Rpc):
            return await self._transport.acall(step.method, step.request, step.timeout, step.each)
        if isinstance(step, Blocking):
            # The copies and transfers release the GIL: a thread keeps the loop responsive.
            return await asyncio.to_thread(step.call)
        await asyncio.sleep(step.seconds)
        return None

    async def lookup(self, keys: Sequence[bytes], *, timeout: float | None = None) -> int:
        """How many leading ``keys`` the store holds."""
        return (await self.lookup_tiers(keys, timeout=timeout)).hits

    async def lookup_tiers(
        self, keys: Sequence[bytes], *, timeout: float | None = None
    ) -> LookupResult:
        """The leading hit count and the tier of every key."""
        return await self._run(self._core.lookup_tiers(keys, timeout))

    async def put(
        self,
        keys: Sequence[bytes],
        values: Sequence[Any],
        *,
        timeout: float | None = None,
        retention: Retention = KEEP,
    ) -> PutResult:
        """Store ``values`` under ``keys`` (one round trip, or one streamed call, per batch).

        ``retention``: keep them at least ``Retention(seconds)``, in memory tiers only
        (``tiers="fast"``) or not at all (``tiers="none"``); see :mod:`kvstore.retention`.
        """
        return await self._run(self._core.put(keys, values, timeout, retention))

    async def get(
        self, keys: Sequence[bytes], *, timeout: float | None = None
    ) -> list[bytes | None]:
        """The payload of each key, ``None`` where missing."""
        return await self._run(self._core.get(keys, timeout))

    async def get_into(
        self, keys: Sequence[bytes], buffers: Sequence[Any], *, timeout: float | None = None
    ) -> list[bool]:
        """Fill caller-provided buffers; False where the key is missing or its size differs.

        Over shared memory each block is copied once, from the store's arena into its buffer.
        """
        return await self._run(self._core.get_into(keys, buffers, timeout))

    async def lease(
        self, keys: Sequence[bytes], *, timeout: float | None = None
    ) -> ShmLease | None:
        """Hold the blocks of ``keys`` in the store's shared-memory arena and read them in place.

        ``None`` when the client does not reach the store over shared memory (then use
        :meth:`get_into`). The lease's ``views`` (read-only bytes, ``None`` where missing) stay
        valid until its ``release()``; the store keeps those blocks meanwhile, so release soon.
        """
        return await self._run(self._core.lease(keys, timeout))

    async def get_into_device(
        self,
        keys: Sequence[bytes],
        tensors: Sequence[Any],
        *,
        staging: Sequence[Any] | None = None,
        timeout: float | None = None,
    ) -> DeviceFill:
        """Fill torch tensors on any device (a GPU's too); the result says which path it took.

        Device tensors are received straight into device memory over UCX where the store is on
        another host and UCX reaches device memory here; otherwise through ``staging`` (host
        buffers of the tensors' sizes, page-locked for speed; made per call if ``None``) and one
        host-to-device copy each. See :mod:`kvstore.client.device_fill`.
        """
        return await self._run(self._core.get_into_device(keys, tensors, staging, timeout))

    async def reserve(
        self,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        *,
        timeout: float | None = None,
        retention: Retention = KEEP,
    ) -> ShmReservation | None:
        """Reserve arena pages for blocks of ``sizes`` bytes, written in place, then committed.

        Returns ``None`` when the client does not reach the store over shared memory (then use
        :meth:`put`). Fill each ``"reserved"`` key's ``views[i]`` (or ``write(i, value)``), then
        ``commit()``; keys ``"present"`` are stored already, keys with ``"no_room"`` go by
        :meth:`put` (with the same ``retention``). See :mod:`kvstore.client.shm_reserve`.
        ``retention`` as for :meth:`put` (``tiers="none"``: ``None``, nothing reserved).
        """
        return await self._run(self._core.reserve(keys, sizes, timeout, retention))

    async def delete(self, keys: Sequence[bytes], *, timeout: float | None = None) -> int:
        """Remove ``keys`` from every tier; returns how many were present."""
        return await self._run(self._core.delete(keys, timeout))

    async def prefetch(self, keys: Sequence[bytes], *, timeout: float | None = None) -> int:
        """Ask the server to move ``keys`` into dram in the background; returns the prefetch id."""
        return await self._run(self._core.prefetch(keys, timeout))

    async def prefetch_status(
        self, prefetch_id: int, *, timeout: float | None = None
    ) -> PrefetchProgress:
        """State and key counts of a prefetch; UnknownPrefetchError for an unknown id."""
        return await self._run(self._core.prefetch_status(prefetch_id, timeout))

    async def cancel_prefetch(self, prefetch_id: int, *, timeout: float | None = None) -> bool:
        """Stop a prefetch (blocks already moved stay); False if it had already finished."""
        return await self._run(self._core.cancel_prefetch(prefetch_id, timeout))

    async def wait_prefetch(self, prefetch_id: int, timeout: float = 30.0) -> PrefetchProgress:
        """Poll until the prefetch is DONE or CANCELLED; DeadlineExceededError after ``timeout``
        seconds."""
        return await self._run(self._core.wait_prefetch(prefetch_id, timeout))

    async def stats(self, *, timeout: float | None = None) -> dict[str, Any]:
        """Tier usage and counters (including every read this client made before the call)."""
        return await self._run(self._core.stats(timeout))

    async def key_scheme(
        self, namespace: Namespace, secret_check: str, *, timeout: float | None = None
    ) -> KeyScheme:
        """Declare an engine's base ``namespace`` and the fingerprint of its key secret
        (:func:`kvstore.key_scheme.secret_fingerprint`, "" to skip the comparison); the scheme
        the server says to name chunks with (its chunk size and hash algorithm). A secret that
        differs from the server's is :class:`~kvstore.errors.NamespaceMismatchError`, a
        namespace of another tenant :class:`~kvstore.errors.PermissionDeniedError`."""
        return await self._run(self._core.key_scheme(namespace, secret_check, timeout))

    async def open_data_plane(self, *, timeout: float | None = None) -> str:
        """Decide the data path now rather than on the first data call: shared memory is
        connected; a UCX path found (it connects on its first transfer). Returns ``"shm"``,
        ``"ucx"`` or ``"grpc"``: the one data calls will take."""
        return await self._run(self._core.open_data_plane(timeout))

    def when_reconnected(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once, on this event loop (call it from a coroutine), when the channel
        connects to the server afresh after a loss (within about half a second of the server
        answering again); for a caller that stopped calling a server it saw fail. The channel
        keeps trying meanwhile; :meth:`aclose` drops a callback still waiting. (With a
        ``transport`` given, the transport says when.) The twin of
        :meth:`KVStoreClient.when_reconnected <kvstore.KVStoreClient.when_reconnected>`."""
        self._transport.when_reconnected(callback)

    async def aclose(self) -> None:
        """Close the shared-memory and UCX paths and the channels (or the given transport)."""
        await asyncio.to_thread(self._core.close)
        await self._transport.aclose()

    async def __aenter__(self) -> AsyncKVStoreClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
