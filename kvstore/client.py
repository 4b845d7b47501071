"""Python clients of a kvstore server: :class:`KVStoreClient` and :class:`AsyncKVStoreClient`.

Both have the same methods (``close`` / ``aclose`` aside), take the namespace once at construction,
put a deadline on every call (``timeout`` seconds, overridable per call), and raise only
:class:`kvstore.errors.KVStoreError` subclasses: a dead server is ``StoreUnavailableError``, a
slow one ``DeadlineExceededError``.

Values are any bytes-like buffer: bytes, memoryview, numpy arrays, contiguous CPU tensors.

>>> client = KVStoreClient("127.0.0.1:50051", namespace=Namespace(model="m"))  # doctest: +SKIP
>>> client.put(keys, blocks); client.lookup(keys); client.get(keys)            # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType
from typing import Any

import grpc

from kvstore import _wire
from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore._proto.kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.keys import Namespace
from kvstore.store import LookupResult, PutResult

__all__ = ["AsyncKVStoreClient", "KVStoreClient"]


class KVStoreClient:
    """A blocking client. Thread-safe: one channel, many concurrent calls."""

    def __init__(
        self,
        target: str,
        *,
        namespace: Namespace | bytes | None = None,
        timeout: float = 5.0,
    ) -> None:
        self.target = target
        self.timeout = timeout
        # Fingerprinting hashes JSON; do it once, not on every call.
        self._namespace = None if namespace is None else _wire.namespace_bytes(namespace)
        self._channel = grpc.insecure_channel(target, options=_wire.CHANNEL_OPTIONS)
        self._stub = pb_grpc.KVStoreStub(self._channel)

    def _deadline(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else timeout

    def lookup(self, keys: Sequence[bytes], *, timeout: float | None = None) -> int:
        """How many leading ``keys`` the store holds."""
        return self.lookup_tiers(keys, timeout=timeout).hits

    def lookup_tiers(self, keys: Sequence[bytes], *, timeout: float | None = None) -> LookupResult:
        """The leading hit count and the tier of every key."""
        request = _wire.lookup_request(_wire.namespace_bytes(self._namespace), keys)
        try:
            response = self._stub.Lookup(request, timeout=self._deadline(timeout))
        except grpc.RpcError as exc:
            raise _wire.map_rpc_error(exc) from exc
        return _wire.lookup_result(response)

    def put(
        self, keys: Sequence[bytes], values: Sequence[Any], *, timeout: float | None = None
    ) -> PutResult:
        """Store ``values`` under ``keys`` (one streamed call for the whole batch)."""
        requests = list(_wire.put_requests(_wire.namespace_bytes(self._namespace), keys, values))
        try:
            response = self._stub.Put(iter(requests), timeout=self._deadline(timeout))
        except grpc.RpcError as exc:
            raise _wire.map_rpc_error(exc) from exc
        return _wire.put_result(response)

    def get(self, keys: Sequence[bytes], *, timeout: float | None = None) -> list[bytes | None]:
        """The payload of each key, ``None`` where missing."""
        request = _wire.get_request(_wire.namespace_bytes(self._namespace), keys)
        try:
            stream = self._stub.Get(request, timeout=self._deadline(timeout))
            return _wire.collect_get(stream, len(keys))
        except grpc.RpcError as exc:
            raise _wire.map_rpc_error(exc) from exc

    def get_into(
        self, keys: Sequence[bytes], buffers: Sequence[Any], *, timeout: float | None = None
    ) -> list[bool]:
        """Fill caller-provided buffers; False where the key is missing or its size differs."""
        return _wire.fill_buffers(self.get(keys, timeout=timeout), buffers)

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

    def stats(self, *, timeout: float | None = None) -> dict[str, Any]:
        """Tier usage and counters."""
        try:
            response = self._stub.Stats(pb.StatsRequest(), timeout=self._deadline(timeout))
        except grpc.RpcError as exc:
            raise _wire.map_rpc_error(exc) from exc
        return _wire.stats_dict(response)

    def close(self) -> None:
        """Close the channel."""
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
    ) -> None:
        self.target = target
        self.timeout = timeout
        # Fingerprinting hashes JSON; do it once, not on every call.
        self._namespace = None if namespace is None else _wire.namespace_bytes(namespace)
        self._channel = grpc.aio.insecure_channel(target, options=_wire.CHANNEL_OPTIONS)
        self._stub = pb_grpc.KVStoreStub(self._channel)

    def _deadline(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else timeout

    async def lookup(self, keys: Sequence[bytes], *, timeout: float | None = None) -> int:
        """How many leading ``keys`` the store holds."""
        return (await self.lookup_tiers(keys, timeout=timeout)).hits

    async def lookup_tiers(
        self, keys: Sequence[bytes], *, timeout: float | None = None
    ) -> LookupResult:
        """The leading hit count and the tier of every key."""
        request = _wire.lookup_request(_wire.namespace_bytes(self._namespace), keys)
        try:
            response = await self._stub.Lookup(request, timeout=self._deadline(timeout))
        except grpc.RpcError as exc:
            raise _wire.map_rpc_error(exc) from exc
        return _wire.lookup_result(response)

    async def put(
        self, keys: Sequence[bytes], values: Sequence[Any], *, timeout: float | None = None
    ) -> PutResult:
        """Store ``values`` under ``keys`` (one streamed call for the whole batch)."""
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
        """Fill caller-provided buffers; False where the key is missing or its size differs."""
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

    async def stats(self, *, timeout: float | None = None) -> dict[str, Any]:
        """Tier usage and counters."""
        try:
            response = await self._stub.Stats(pb.StatsRequest(), timeout=self._deadline(timeout))
        except grpc.RpcError as exc:
            raise _wire.map_rpc_error(exc) from exc
        return _wire.stats_dict(response)

    async def aclose(self) -> None:
        """Close the channel."""
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
