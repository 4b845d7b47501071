"""The server side of the UCX data path: a UCX listener and the ``kvstore.v1.UcxTransfer`` service.

Everything here runs on the server's one asyncio event loop (the grpc.aio loop), the only thread
allowed to touch the :class:`~kvstore.store.TieredStore`. ucxx binds its context to that loop the
first time it is used, so a process serves UCX from one loop only.

A client's life: it connects to the listener and sends its client id; :meth:`UcxDataServer._accept`
registers the endpoint under that id and answers one byte. From then on ``UcxGet`` and ``UcxPut``
name the id, and the payloads of a call move over that endpoint, tagged by (transfer id, index).
Every transfer is bounded by the call's gRPC deadline (capped by ``transfer_timeout_s``); a transfer
that fails or runs late drops the client's endpoint, which cancels whatever else it had in flight,
and the client reconnects on its next call.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import numpy as np

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore._proto.kvstore.v1 import ucx_pb2 as ucx_pb
from kvstore._proto.kvstore.v1 import ucx_pb2_grpc as ucx_pb_grpc
from kvstore.errors import CapacityError, InvalidRequestError, KVStoreError, status_of
from kvstore.store import TieredStore
from kvstore.transport.ucx import (
    CLIENT_ID_BYTES,
    HELLO_TAG,
    MAX_BATCH,
    UcxTransportError,
    load_ucxx,
    parse_address,
    transfer_tag,
)

__all__ = ["UCX_SERVICE_NAME", "UcxDataServer", "add_ucx_to_server"]

logger = logging.getLogger(__name__)

UCX_SERVICE_NAME = "kvstore.v1.UcxTransfer"

#: How long a new endpoint may take to say who it is.
HELLO_TIMEOUT_S = 5.0

T = TypeVar("T")


@dataclass
class _Client:
    """A registered client endpoint."""

    endpoint: Any  # ucxx Endpoint
    client_id: bytes


class UcxDataServer:
    """A UCX listener serving one store's blocks to remote clients, plus its gRPC control service.

    Create it with :func:`add_ucx_to_server`, which also registers the service on the gRPC server.
    """

    def __init__(
        self,
        store: TieredStore,
        listen: str = "0.0.0.0:0",
        *,
        transfer_timeout_s: float = 30.0,
    ) -> None:
        self.store = store
        self._host, self._port = parse_address(listen)
        self.transfer_timeout_s = transfer_timeout_s
        self._listener: Any = None
        self._clients: dict[bytes, _Client] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        #: Counters for logs and tests: transfers, blocks and bytes each way, failures.
        self.counters: Counter[str] = Counter()
        #: ``HOST:PORT`` clients connect to; set by :meth:`start`.
        self.address = ""

    async def start(self) -> None:
        """Start listening (port 0 picks a free one); ``UcxTransportError`` if ucxx is unusable."""
        ucxx = load_ucxx()
        self._loop = asyncio.get_running_loop()
        try:
            self._listener = ucxx.create_listener(
                self._accept, port=self._port, endpoint_error_handling=True
            )
        except Exception as exc:
            raise UcxTransportError(f"cannot listen for UCX on port {self._port}: {exc}") from exc
        host = self._host
        if host in ("", "0.0.0.0", "::"):
            # The listener takes every interface; advertise one a remote client can reach.
            host = ucxx.get_address()
        self.address = f"{host}:{self._listener.port}"
        logger.info("UCX data path listening on %s", self.address)

    async def close(self) -> None:
        """Stop listening, drop every client endpoint and cancel transfers still in flight."""
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for client in list(self._clients.values()):
            self._drop(client, "server closing")
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    # -- endpoints -------------------------------------------------------------------------

    async def _accept(self, endpoint: Any) -> None:
        """Listener callback: read the client's id, register its endpoint, answer one byte."""
        client_id = bytearray(CLIENT_ID_BYTES)
        try:
            await asyncio.wait_for(endpoint.recv(client_id, tag=HELLO_TAG), HELLO_TIMEOUT_S)
        except Exception as exc:
            logger.warning("UCX client did not introduce itself: %s", exc)
            endpoint.abort()
            return
        client = _Client(endpoint, bytes(client_id))
        old = self._clients.pop(client.client_id, None)
        if old is not None:
            self._drop(old, "replaced by a new connection")
        self._clients[client.client_id] = client
        loop = self._loop
        assert loop is not None
        # UCX calls this from its progress thread when the peer goes away.
        endpoint.set_close_callback(lambda: loop.call_soon_threadsafe(self._forget, client))
        try:
            await asyncio.wait_for(
                endpoint.send(np.ones(1, dtype=np.uint8), tag=HELLO_TAG), HELLO_TIMEOUT_S
            )
        except Exception as exc:
            self._drop(client, f"hello answer failed: {exc}")
            return
        self.counters["clients_connected"] += 1
        logger.debug("UCX client %s connected", client.client_id.hex())

    def _forget(self, client: _Client) -> None:
        if self._clients.get(client.client_id) is client:
            del self._clients[client.client_id]

    def _drop(self, client: _Client, reason: str) -> None:
        """Abort a client's endpoint: its transfers in flight fail, it must reconnect."""
        self._forget(client)
        self.counters["clients_dropped"] += 1
        logger.info("dropping UCX client %s: %s", client.client_id.hex(), reason)
        try:
            client.endpoint.abort()
        except Exception:  # already closed by the peer's failure
            logger.debug("abort of a UCX endpoint failed", exc_info=True)

    def _client(self, client_id: bytes) -> _Client:
        client = self._clients.get(client_id)
        if client is None:
            raise UcxTransportError("unknown UCX client id; reconnect")
        return client

    def _timeout(self, context: grpc.aio.ServicerContext[Any, Any]) -> float:
        remaining = context.time_remaining()
        return (
            self.transfer_timeout_s
            if remaining is None
            else min(remaining, self.transfer_timeout_s)
        )

    # -- get -------------------------------------------------------------------------------

    async def get(
        self, request: ucx_pb.UcxGetRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> ucx_pb.UcxGetResponse:
        """Look the keys up and answer; the found payloads then follow over UCX."""
        client = self._client(request.client_id)
        keys = list(request.keys)
        _check_batch(len(keys))
        sizes = list(request.sizes)
        if sizes and len(sizes) != len(keys):
            raise InvalidRequestError(f"{len(keys)} keys but {len(sizes)} buffer sizes")
        results = await self.store.get(keys, request.namespace)
        lengths = [0 if r.payload is None else len(r.payload) for r in results]
        sent = [n > 0 and (not sizes or sizes[i] == n) for i, n in enumerate(lengths)]
        payloads = [(i, r.payload) for i, r in enumerate(results) if sent[i]]
        if payloads:
            # The answer goes first: the client posts its receives only after reading the lengths.
            # The store's payloads are copies, so nothing needs pinning while they travel.
            self._spawn(self._send(client, request.transfer_id, payloads, self._timeout(context)))
        return ucx_pb.UcxGetResponse(lengths=lengths, sent=sent, tiers=[r.tier for r in results])

    async def _send(
        self,
        client: _Client,
        transfer_id: int,
        payloads: Sequence[tuple[int, Any]],
        timeout: float,
    ) -> None:
        sends = [
            client.endpoint.send(payload, tag=transfer_tag(transfer_id, index))
            for index, payload in payloads
        ]
        ok = await self._transfer(client, sends, timeout, "send")
        if ok:
            self.counters["get_transfers"] += 1
            self.counters["blocks_sent"] += len(payloads)
            self.counters["bytes_sent"] += sum(len(p) for _, p in payloads)

    # -- put -------------------------------------------------------------------------------

    async def put(
        self, request: ucx_pb.UcxPutRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.PutResponse:
        """Receive the batch's payloads over UCX, then store them as ``Put`` does."""
        client = self._client(request.client_id)
        keys = list(request.keys)
        lengths = list(request.lengths)
        try:
            self._check_put(keys, lengths)
        except KVStoreError:
            # The client is already sending; dropping its endpoint fails those sends at once.
            self._drop(client, "refused a put")
            raise
        # np.empty: no zeroing, every byte is about to be overwritten.
        buffers = [np.empty(length, dtype=np.uint8) for length in lengths]
        receives = [
            client.endpoint.recv(buffer, tag=transfer_tag(request.transfer_id, index))
            for index, buffer in enumerate(buffers)
        ]
        if not await self._transfer(client, receives, self._timeout(context), "receive"):
            raise UcxTransportError("UCX receive failed or timed out")
        self.counters["put_transfers"] += 1
        self.counters["blocks_received"] += len(buffers)
        self.counters["bytes_received"] += sum(lengths)
        result = await self.store.put(keys, buffers, request.namespace)
        return pb.PutResponse(
            stored=result.stored, already_present=result.already_present, dropped=result.dropped
        )

    def _check_put(self, keys: Sequence[bytes], lengths: Sequence[int]) -> None:
        """Refuse, before receiving anything, a batch the store would refuse or cannot hold."""
        _check_batch(len(keys))
        if len(lengths) != len(keys):
            raise InvalidRequestError(f"{len(keys)} keys but {len(lengths)} lengths")
        for index, length in enumerate(lengths):
            if length == 0:
                raise InvalidRequestError(f"value {index} is empty")
            if length > self.store.max_block_bytes:
                raise CapacityError(
                    f"value {index} is {length} bytes; the block limit is "
                    f"{self.store.max_block_bytes} bytes"
                )
        # Receive buffers are allocated up front: never more than every tier could hold.
        capacity = sum(tier.capacity for tier in self.store.tiers if not tier.shared)
        if sum(lengths) > capacity:
            raise CapacityError(
                f"the request holds {sum(lengths)} bytes; all tiers together hold {capacity} bytes"
            )

    # -- transfers -------------------------------------------------------------------------

    async def _transfer(
        self, client: _Client, operations: list[Awaitable[Any]], timeout: float, what: str
    ) -> bool:
        """Run a batch of sends or receives within ``timeout``; on failure drop the client."""
        started = time.monotonic()
        try:
            await asyncio.wait_for(asyncio.gather(*operations), timeout)
        except asyncio.CancelledError:
            # The gRPC call was cancelled (client gone or deadline): its transfer is abandoned.
            self._drop(client, f"{what} cancelled")
            raise
        except Exception as exc:
            self.counters["transfer_failures"] += 1
            self._drop(
                client,
                f"{what} failed after {time.monotonic() - started:.2f}s: "
                f"{type(exc).__name__}: {exc}",
            )
            return False
        return True

    def _spawn(self, coroutine: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _check_batch(count: int) -> None:
    if count > MAX_BATCH:
        raise InvalidRequestError(f"{count} keys in one UCX transfer; the limit is {MAX_BATCH}")


async def _guard(
    context: grpc.aio.ServicerContext[Any, Any], call: Callable[[], Awaitable[T]]
) -> T:
    """Run ``call``; map store errors to their status, transport failures to ABORTED."""
    try:
        return await call()
    except KVStoreError as exc:
        await context.abort(status_of(exc), str(exc))
    except UcxTransportError as exc:
        await context.abort(grpc.StatusCode.ABORTED, str(exc))
    except Exception as exc:
        logger.exception("unexpected failure serving a UCX request")
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")
    raise AssertionError("unreachable: context.abort raises")


class UcxTransferServicer(ucx_pb_grpc.UcxTransferServicer):  # type: ignore[misc]  # generated
    """Serves ``kvstore.v1.UcxTransfer`` for one :class:`UcxDataServer`."""

    def __init__(self, data_server: UcxDataServer) -> None:
        self.data_server = data_server

    async def UcxGet(
        self, request: ucx_pb.UcxGetRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> ucx_pb.UcxGetResponse:
        """See :meth:`UcxDataServer.get`."""
        return await _guard(context, lambda: self.data_server.get(request, context))

    async def UcxPut(
        self, request: ucx_pb.UcxPutRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.PutResponse:
        """See :meth:`UcxDataServer.put`."""
        return await _guard(context, lambda: self.data_server.put(request, context))


async def add_ucx_to_server(
    server: grpc.aio.Server,
    store: TieredStore,
    listen: str = "0.0.0.0:0",
    *,
    transfer_timeout_s: float = 30.0,
) -> UcxDataServer:
    """Start a :class:`UcxDataServer` for ``store`` and register its service on ``server``.

    Call on the server's event loop before ``server.start()``. Raises
    :class:`~kvstore.transport.ucx.UcxTransportError` (and registers nothing) when ucxx is missing
    or the listener cannot start; the caller then serves without the UCX path.
    """
    data_server = UcxDataServer(store, listen, transfer_timeout_s=transfer_timeout_s)
    await data_server.start()
    ucx_pb_grpc.add_UcxTransferServicer_to_server(UcxTransferServicer(data_server), server)
    return data_server
