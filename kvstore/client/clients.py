"""Python clients of a kvstore server: :class:`KVStoreClient` and :class:`AsyncKVStoreClient`.

Both have the same methods (``close`` / ``aclose`` aside), take the namespace once at construction,
put a deadline on every call (``timeout`` seconds, overridable per call), and raise only
:class:`kvstore.errors.KVStoreError` subclasses: a dead server is ``StoreUnavailableError``, a
slow one ``DeadlineExceededError``.

Values are any bytes-like buffer: bytes, memoryview, numpy arrays, contiguous CPU tensors.

Data calls (``lookup``, ``put``, ``get``, ``get_into``) go through the server's shared-memory data
plane when the client runs on the same host, and through gRPC otherwise; ``data_plane="grpc"``
turns that off, ``"shm"`` makes its absence an error (see :mod:`kvstore.client.shm_link`).

>>> client = KVStoreClient("127.0.0.1:50051", namespace=Namespace(model="m"))  # doctest: +SKIP
>>> client.put(keys, blocks); client.lookup(keys); client.get(keys)            # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, TypeVar

import grpc

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore._proto.kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.client.shm import ShmDataPlane, ShmUnavailableError
from kvstore.client.shm_link import ShmLink
from kvstore.client.ucx import UcxDataClient
from kvstore.errors import KVStoreError
from kvstore.keys import Namespace
from kvstore.protocol import messages as _wire
from kvstore.protocol.ucx import ucx_unavailable_reason
from kvstore.types import LookupResult, PrefetchProgress, PutResult

__all__ = ["AsyncKVStoreClient", "KVStoreClient"]

T = TypeVar("T")


class _Fallback:
    """Returned by ``_over_shm`` when the call must go through gRPC instead."""


_FALLBACK = _Fallback()

#: Seconds after which a client whose UCX path is unusable asks the server for it again.
UCX_RECHECK_S = 30.0


class KVStoreClient:
    """A blocking client. Thread-safe: one channel, many concurrent calls."""

    def __init__(
        self,
        target: str,
        *,
        namespace: Namespace | bytes | None = None,
        timeout: float = 5.0,
        data_plane: str | None = None,
    ) -> None:
        self.target = target
        self.timeout = timeout
        # Fingerprinting hashes JSON; do it once, not on every call.
        self._namespace = None if namespace is None else _wire.namespace_bytes(namespace)
        self._channel = grpc.insecure_channel(target, options=_wire.CHANNEL_OPTIONS)
        self._stub = pb_grpc.KVStoreStub(self._channel)
        self._shm = ShmLink(data_plane, self._namespace, timeout)
        self._ucx: UcxDataClient | None = None
        self._ucx_checked_at: float | None = None
        self._ucx_lock = threading.Lock()

    def _deadline(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else timeout

    def _ucx_client(self) -> UcxDataClient | None:
        """The UCX path, when shared memory is out and the server advertises a UCX listener."""
        if self._shm.mode not in ("auto", "ucx") or self._namespace is None:
            return None
        with self._ucx_lock:
            now = time.monotonic()
            # Ask again after a while: a restarted server may listen on another port.
            if self._ucx_checked_at is None or (
                now - self._ucx_checked_at > UCX_RECHECK_S
                and (self._ucx is None or not self._ucx.usable)
            ):
                self._ucx_checked_at = now
                try:
                    endpoints = self._stub.DataPlane(pb.DataPlaneRequest(), timeout=self.timeout)
                except grpc.RpcError:
                    return None  # an older server, or none: the gRPC call will say which
                address = endpoints.ucx_address
                if self._ucx is not None and self._ucx.address != address:
                    self._ucx.close()
                    self._ucx = None
                if self._ucx is None and address and ucx_unavailable_reason() is None:
                    self._ucx = UcxDataClient(
                        self._channel, address, self._namespace, timeout=self.timeout
                    )
        return self._ucx if self._ucx is not None and self._ucx.usable else None

    @property
    def data_plane(self) -> str:
        """``"shm"``, ``"ucx"`` or ``"grpc"``: the path data calls take now."""
        if self._shm.plane is not None:
            return "shm"
        return "ucx" if self._ucx is not None and self._ucx.usable else "grpc"

    def _shm_plane(self) -> ShmDataPlane | None:
        if not self._shm.wanted():
            return None
        if self._shm.plane is not None:
            return self._shm.plane
        try:
            endpoints = self._stub.DataPlane(pb.DataPlaneRequest(), timeout=self.timeout)
        except grpc.RpcError as exc:  # an older server, or none: gRPC calls will say which
            self._shm.failed(exc)
            return None
        return self._shm.connect(endpoints)

    def _over_shm(self, keys: Sequence[bytes], call: Callable[[ShmDataPlane], T]) -> T | _Fallback:
        """``call`` on the shared-memory path, or ``_FALLBACK`` if the call must use gRPC."""
        plane = self._shm_plane()
        if plane is None or not plane.usable_for(keys):
            return _FALLBACK
        try:
            return call(plane)
        except ShmUnavailableError as exc:
            self._shm.failed(exc)
            return _FALLBACK

    def lookup(self, keys: Sequence[bytes], *, timeout: float | None = None) -> int:
        """How many leading ``keys`` the store holds."""
        return self.lookup_tiers(keys, timeout=timeout).hits

    def lookup_tiers(self, keys: Sequence[bytes], *, timeout: float | None = None) -> LookupResult:
        """The leading hit count and the tier of every key."""
        fast = self._over_shm(keys, lambda plane: plane.lookup(keys, self._deadline(timeout)))
        if not isinstance(fast, _Fallback):
            return fast
        request = _wire.lookup_request(_wire.namespace_bytes(self._namespace), keys)
        try:
            response = self._stub.Lookup(request, timeout=self._deadline(timeout))
        except grpc.RpcError as exc:
            raise _wire.map_rpc_error(exc) from exc
        return _wire.lookup_result(response)

    def put(
        self, keys: Sequence[bytes], values: Sequence[Any], *, timeout: float | None = None
    ) -> PutResult:
        """Store ``values`` under ``keys`` (one round trip, or one streamed call, per batch)."""
        fast = self._over_shm(keys, lambda plane: plane.put(keys, values, self._deadline(timeout)))
        if isinstance(fast, _Fallback):
            ucx = self._ucx_client()
            remote = None if ucx is None else ucx.put(keys, values, timeout=self._deadline(timeout))
            return remote if remote is not None else self._put_grpc(keys, values, timeout)
        result, no_room = fast
        if not no_room:
            return result
        rest = self._put_grpc([keys[i] for i in no_room], [values[i] for i in no_room], timeout)
        return _wire.combine_put_results(result, rest)

    def _put_grpc(
        self, keys: Sequence[bytes], values: Sequence[Any], timeout: float | None
    ) -> PutResult:
        requests = list(_wire.put_requests(_wire.namespace_bytes(self._namespace), keys, values))
        try:
            response = self._stub.Put(iter(requests), timeout=self._deadline(timeout))
        except grpc.RpcError as exc:
            raise _wire.map_rpc_error(exc) from exc
        return _wire.put_result(response)

    def get(self, keys: Sequence[bytes], *, timeout: float | None = None) -> list[bytes | None]:
        """The payload of each key, ``None`` where missing."""
        fast = self._over_shm(keys, lambda plane: plane.get(keys, self._deadline(timeout)))
        if not isinstance(fast, _Fallback):
            return fast
        ucx = self._ucx_client()
        remote = None if ucx is None else ucx.get(keys, timeout=self._deadline(timeout))
        if remote is not None:
            return remote
        return self._get_grpc(keys, timeout)

    def _get_grpc(self, keys: Sequence[bytes], timeout: float | None) -> list[bytes | None]:
        request = _wire.get_request(_wire.namespace_bytes(self._namespace), keys)
        try:
            stream = self._stub.Get(request, timeout=self._deadline(timeout))
            return _wire.collect_get(stream, len(keys))
        except grpc.RpcError as exc:
            raise _wire.map_rpc_error(exc) from exc

    def get_into(
        self, keys: Sequence[bytes], buffers: Sequence[Any], *, timeout: float | None = None
    ) -> list[bool]:
        """Fill caller-provided buffers; False where the key is missing or its size differs.

        Over shared memory each block is copied once, from the store's arena into its buffer.
        """
        fast = self._over_shm(
            keys, lambda plane: plane.get_into(keys, buffers, self._deadline(timeout))
        )
        if not isinstance(fast, _Fallback):
            return fast
        ucx = self._ucx_client()
        filled = (
            None if ucx is None else ucx.get_into(keys, buffers, timeout=self._deadline(timeout))
        )
        if filled is not None:
            return filled
        return _wire.fill_buffers(self._get_grpc(keys, timeout), buffers)

    def delete(self, keys: Sequence[bytes], *, timeout: float | None = None) -> int:
        """Remove ``keys`` from every tier; returns how many were present."""
        try:
            response = self._stub.Delete(
                pb.DeleteRequest(keys=list(keys), namespace=_wire.namespace_bytes(self._namespace)),
                timeout=self._deadline(timeout),
            )
        except grpc.RpcError as exc:
            raise _wire.map_rpc_error(exc) from exc
        return int(response.deleted)

    def prefetch(self, keys: Sequence[bytes], *, timeout: float | None = None) -> int:
        """Ask the server to move ``keys`` into dram in the background; returns the prefetch id."""
        request = pb.PrefetchRequest(
            namespace=_wire.namespace_bytes(self._namespace), keys=list(keys)
        )
        try:
            response = self._stub.Prefetch(request, timeout=self._deadline(timeout))
        except grpc.RpcError as exc:
            raise _wire.map_rpc_error(exc) from exc
        return int(response.prefetch_id)

    def prefetch_status(
        self, prefetch_id: int, *, timeout: float | None = None
    ) -> PrefetchProgress:
        """State and key counts of a prefetch; UnknownPrefetchError for an unknown id."""
        try:
            response = self._stub.PrefetchStatus(
                pb.PrefetchStatusRequest(prefetch_id=prefetch_id), timeout=self._deadline(timeout)
            )
        except grpc.RpcError as exc:
            raise _wire.map_rpc_error(exc) from exc
        return _wire.prefetch_progress(response)

    def cancel_prefetch(self, prefetch_id: int, *, timeout: float | None = None) -> bool:
        """Stop a prefetch (blocks already moved stay); False if it had already finished."""
        try:
            response = self._stub.CancelPrefetch(
                pb.CancelPrefetchRequest(prefetch_id=prefetch_id), timeout=self._deadline(timeout)
            )
        except grpc.RpcError as exc:
            raise _wire.map_rpc_error(exc) from exc
        return bool(response.cancelled)

    def wait_prefetch(self, prefetch_id: int, timeout: float = 30.0) -> PrefetchProgress:
        """Poll until the prefetch is DONE or CANCELLED; DeadlineExceededError after ``timeout``
        seconds."""
        return _wire.wait_prefetch(
            lambda deadline: self.prefetch_status(prefetch_id, timeout=deadline),
            timeout,
            self.timeout,
        )

    def stats(self, *, timeout: float | None = None) -> dict[str, Any]:
        """Tier usage and counters (including every read this client made before the call)."""
        remaining = _flush_reads(self._shm.plane, self._deadline(timeout))
        try:
            response = self._stub.Stats(pb.StatsRequest(), timeout=remaining)
        except grpc.RpcError as exc:
            raise _wire.map_rpc_error(exc) from exc
        return _wire.stats_dict(response)

    def close(self) -> None:
        """Close the shared-memory and UCX paths and the channel."""
        self._shm.close()
        if self._ucx is not None:
            self._ucx.close()
        self._channel.close()

    def __enter__(self) -> KVStoreClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class AsyncKVStoreClient:
    """The asyncio twin of :class:`KVStoreClient`."""

    def __init__(
        self,
        target: str,
        *,
        namespace: Namespace | bytes | None = None,
        timeout: float = 5.0,
        data_plane: str | None = None,
    ) -> None:
        self.target = target
        self.timeout = timeout
        # Fingerprinting hashes JSON; do it once, not on every call.
        self._namespace = None if namespace is None else _wire.namespace_bytes(namespace)
        self._channel = grpc.aio.insecure_channel(target, options=_wire.CHANNEL_OPTIONS)
        self._stub = pb_grpc.KVStoreStub(self._channel)
        self._shm = ShmLink(data_plane, self._namespace, timeout)

    def _deadline(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else timeout

    @property
    def data_plane(self) -> str:
        """``"shm"`` while calls go through shared memory, else ``"grpc"``."""
        return "shm" if self._shm.plane is not None else "grpc"

    async def _shm_plane(self) -> ShmDataPlane | None:
        if not self._shm.wanted():
            return None
        if self._shm.plane is not None:
            return self._shm.plane
        try:
            endpoints = await self._stub.DataPlane(pb.DataPlaneRequest(), timeout=self.timeout)
        except grpc.RpcError as exc:  # an older server, or none: gRPC calls will say which
            self._shm.failed(exc)
            return None
        return await asyncio.to_thread(self._shm.connect, endpoints)

    async def _over_shm(
        self, keys: Sequence[bytes], call: Callable[[ShmDataPlane], T]
    ) -> T | _Fallback:
        """``call`` in a worker thread on the shared-memory path, or ``_FALLBACK``."""
        plane = await self._shm_plane()
        if plane is None or not plane.usable_for(keys):
            return _FALLBACK
        try:
            # The copies release the GIL, so a thread keeps the event loop responsive.
            return await asyncio.to_thread(call, plane)
        except ShmUnavailableError as exc:
            self._shm.failed(exc)
            return _FALLBACK

    async def lookup(self, keys: Sequence[bytes], *, timeout: float | None = None) -> int:
        """How many leading ``keys`` the store holds."""
        return (await self.lookup_tiers(keys, timeout=timeout)).hits

    async def lookup_tiers(
        self, keys: Sequence[bytes], *, timeout: float | None = None
    ) -> LookupResult:
        """The leading hit count and the tier of every key."""
        fast = await self._over_shm(keys, lambda plane: plane.lookup(keys, self._deadline(timeout)))
        if not isinstance(fast, _Fallback):
            return fast
        request = _wire.lookup_request(_wire.namespace_bytes(self._namespace), keys)
        try:
            response = await self._stub.Lookup(request, timeout=self._deadline(timeout))
        except grpc.RpcError as exc:
            raise _wire.map_rpc_error(exc) from exc
        return _wire.lookup_result(response)

    async def put(
        self, keys: Sequence[bytes], values: Sequence[Any], *, timeout: float | None = None
    ) -> PutResult:
        """Store ``values`` under ``keys`` (one round trip, or one streamed call, per batch)."""
        fast = await self._over_shm(
            keys, lambda plane: plane.put(keys, values, self._deadline(timeout))
        )
        if isinstance(fast, _Fallback):
            return await self._put_grpc(keys, values, timeout)
        result, no_room = fast
        if not no_room:
            return result
        rest = await self._put_grpc(
            [keys[i] for i in no_room], [values[i] for i in no_room], timeout
        )
        return _wire.combine_put_results(result, rest)

    async def _put_grpc(
        self, keys: Sequence[bytes], values: Sequence[Any], timeout: float | None
    ) -> PutResult:
        requests = list(_wire.put_requests(_wire.namespace_bytes(self._namespace), keys, values))
        try:
            response = await self._stub.Put(iter(requests), timeout=self._deadline(timeout))
        except grpc.RpcError as exc:
            raise _wire.map_rpc_error(exc) from exc
        return _wire.put_result(response)

    async def get(
        self, keys: Sequence[bytes], *, timeout: float | None = None
    ) -> list[bytes | None]:
        """The payload of each key, ``None`` where missing."""
        fast = await self._over_shm(keys, lambda plane: plane.get(keys, self._deadline(timeout)))
        if not isinstance(fast, _Fallback):
            return fast
        request = _wire.get_request(_wire.namespace_bytes(self._namespace), keys)
        values: list[bytes | None] = [None] * len(keys)
        try:
            async for response in self._stub.Get(request, timeout=self._deadline(timeout)):
                _wire.add_get_response(values, response)
        except grpc.RpcError as exc:
            raise _wire.map_rpc_error(exc) from exc
        return values

    async def get_into(
        self, keys: Sequence[bytes], buffers: Sequence[Any], *, timeout: float | None = None
    ) -> list[bool]:
        """Fill caller-provided buffers; False where the key is missing or its size differs.

        Over shared memory each block is copied once, from the store's arena into its buffer.
        """
        fast = await self._over_shm(
            keys, lambda plane: plane.get_into(keys, buffers, self._deadline(timeout))
        )
        if not isinstance(fast, _Fallback):
            return fast
        return _wire.fill_buffers(await self.get(keys, timeout=timeout), buffers)

    async def delete(self, keys: Sequence[bytes], *, timeout: float | None = None) -> int:
        """Remove ``keys`` from every tier; returns how many were present."""
        try:
            response = await self._stub.Delete(
                pb.DeleteRequest(keys=list(keys), namespace=_wire.namespace_bytes(self._namespace)),
                timeout=self._deadline(timeout),
            )
        except grpc.RpcError as exc:
            raise _wire.map_rpc_error(exc) from exc
        return int(response.deleted)

    async def prefetch(self, keys: Sequence[bytes], *, timeout: float | None = None) -> int:
        """Ask the server to move ``keys`` into dram in the background; returns the prefetch id."""
        request = pb.PrefetchRequest(
            namespace=_wire.namespace_bytes(self._namespace), keys=list(keys)
        )
        try:
            response = await self._stub.Prefetch(request, timeout=self._deadline(timeout))
        except grpc.RpcError as exc:
            raise _wire.map_rpc_error(exc) from exc
        return int(response.prefetch_id)

    async def prefetch_status(
        self, prefetch_id: int, *, timeout: float | None = None
    ) -> PrefetchProgress:
        """State and key counts of a prefetch; UnknownPrefetchError for an unknown id."""
        try:
            response = await self._stub.PrefetchStatus(
                pb.PrefetchStatusRequest(prefetch_id=prefetch_id), timeout=self._deadline(timeout)
            )
        except grpc.RpcError as exc:
            raise _wire.map_rpc_error(exc) from exc
        return _wire.prefetch_progress(response)

    async def cancel_prefetch(self, prefetch_id: int, *, timeout: float | None = None) -> bool:
        """Stop a prefetch (blocks already moved stay); False if it had already finished."""
        try:
            response = await self._stub.CancelPrefetch(
                pb.CancelPrefetchRequest(prefetch_id=prefetch_id), timeout=self._deadline(timeout)
            )
        except grpc.RpcError as exc:
            raise _wire.map_rpc_error(exc) from exc
        return bool(response.cancelled)

    async def wait_prefetch(self, prefetch_id: int, timeout: float = 30.0) -> PrefetchProgress:
        """Poll until the prefetch is DONE or CANCELLED; DeadlineExceededError after ``timeout``
        seconds."""
        return await _wire.wait_prefetch_async(
            lambda deadline: self.prefetch_status(prefetch_id, timeout=deadline),
            timeout,
            self.timeout,
        )

    async def stats(self, *, timeout: float | None = None) -> dict[str, Any]:
        """Tier usage and counters (including every read this client made before the call)."""
        remaining = await asyncio.to_thread(_flush_reads, self._shm.plane, self._deadline(timeout))
        try:
            response = await self._stub.Stats(pb.StatsRequest(), timeout=remaining)
        except grpc.RpcError as exc:
            raise _wire.map_rpc_error(exc) from exc
        return _wire.stats_dict(response)

    async def aclose(self) -> None:
        """Close the shared-memory path and the channel."""
        self._shm.close()
        await self._channel.close(grace=None)

    async def __aenter__(self) -> AsyncKVStoreClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


def _flush_reads(plane: ShmDataPlane | None, timeout: float) -> float:
    """Let the server count the reads ``plane`` served itself, before its counters are read;
    what is left of ``timeout`` (seconds) for the Stats call.

    Best effort: a server that cannot be reached now is what the Stats call will report.
    """
    started = time.monotonic()
    if plane is not None:
        with contextlib.suppress(ShmUnavailableError, KVStoreError):
            plane.flush_reads(timeout)
    return max(timeout - (time.monotonic() - started), 0.0)
