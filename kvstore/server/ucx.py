"""The server side of the UCX data path: a UCX listener that moves the payloads of
``kvstore.v1.UcxTransfer`` calls (the gRPC service itself: :mod:`kvstore.server.ucx_service`).

Everything here runs on the server's one asyncio event loop (the grpc.aio loop), the only thread
allowed to touch the :class:`~kvstore.store.TieredStore`. ucxx binds its context to that loop the
first time it is used, so a process serves UCX from one loop only.

A client's life: it connects to the listener and sends its client id; :meth:`UcxDataServer._accept`
registers the endpoint under that id and answers one byte. From then on ``UcxGet`` and ``UcxPut``
name the id, and the payloads of a call move over that endpoint, tagged by (transfer id, index).
Every transfer is bounded by the call's gRPC deadline (capped by ``transfer_timeout_s``); a transfer
that fails or runs late drops the client's endpoint, which cancels whatever else it had in flight,
and the client reconnects on its next call.

When the store's top tier is a dram arena, payloads do not get copied on the server: a get leases
the blocks (:meth:`~kvstore.store.TieredStore.acquire`) and UCX sends straight from their pages; a
put reserves pages (:meth:`~kvstore.store.TieredStore.reserve`), UCX receives into them and the
store commits them. What a transfer takes belongs to its own arena session
(:mod:`kvstore.server.sessions`), closed when the transfer ends, however it ends: a client that
dies fails its transfers, which gives everything back. (Not when the endpoint goes: UCX may still
be receiving into reserved pages until the transfer's operations end.) A block split across
several runs of pages still travels as one message (the client's wire format), so it goes through
a contiguous copy; a block the arena has no room for is received into a buffer of its own and
stored like a ``Put``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import grpc
import numpy as np

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore._proto.kvstore.v1 import ucx_pb2 as ucx_pb
from kvstore.errors import InvalidRequestError, KVStoreError, PermissionDeniedError
from kvstore.protocol.checks import check_pairs
from kvstore.protocol.ucx import (
    CLIENT_ID_BYTES,
    HELLO_TAG,
    MAX_BATCH,
    UcxTransportError,
    load_ucxx,
    parse_address,
    payload_checksums,
    transfer_tag,
)
from kvstore.server.sessions import ArenaSession, ArenaSessions, Leased, Reserved, gather, scatter
from kvstore.store import TieredStore
from kvstore.tiers.dram import DramTier

__all__ = ["UcxDataServer", "UcxScope"]

logger = logging.getLogger(__name__)

#: How long a new endpoint may take to say who it is.
HELLO_TIMEOUT_S = 5.0


@dataclass
class _Client:
    """A registered client endpoint; ``owner``: the tenant whose control call first used it."""

    endpoint: Any  # ucxx Endpoint
    client_id: bytes
    owner: str | None = None


@dataclass(frozen=True)
class UcxScope:
    """What one caller's transfers may touch: its tenant (``owner``), store and arena sessions."""

    owner: str
    store: TieredStore
    sessions: ArenaSessions


class UcxDataServer:
    """A UCX listener serving one store's blocks to remote clients, plus its gRPC control service.

    Create it with :func:`~kvstore.server.ucx_service.add_ucx_to_server`, which also registers
    the gRPC service on the server.
    """

    def __init__(
        self,
        store: TieredStore,
        listen: str = "0.0.0.0:0",
        *,
        transfer_timeout_s: float = 30.0,
        session_bytes: int | None = None,
        scopes: Callable[[], UcxScope] | None = None,
    ) -> None:
        self.store = store
        self._host, self._port = parse_address(listen)
        self.transfer_timeout_s = transfer_timeout_s
        self._listener: Any = None
        self._clients: dict[bytes, _Client] = {}
        # One transfer may hold at most ``session_bytes`` of the arena leased or reserved.
        only = UcxScope("", store, ArenaSessions(store, session_bytes))
        #: The scope of the calling tenant (a server with tenants passes its own rule).
        self._scope = scopes if scopes is not None else (lambda: only)
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        #: Counters for logs and tests: transfers, blocks and bytes each way, failures.
        self.counters: Counter[str] = Counter()
        #: ``HOST:PORT`` clients connect to; set by :meth:`start`.
        self.address = ""

    def tenant(self) -> str:
        """The calling tenant's name ("" where the caller has none): a metrics label."""
        try:
            return self._scope().owner
        except KVStoreError:
            return ""

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
        else:
            # ucxx's listener takes a port, no address: asking for one interface (say loopback)
            # does not keep other hosts out, and an operator must not believe it does.
            logger.warning(
                "the UCX listener on port %d takes every interface (ucxx cannot bind one "
                "address); %s is only the address advertised to clients: firewall the port "
                "where other hosts must not reach it",
                self._listener.port,
                host,
            )
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

    def _client(self, client_id: bytes, owner: str) -> _Client:
        """The endpoint ``client_id`` names, bound to ``owner`` by the first call that uses it.

        The endpoint's hello carries no credentials; the authenticated control call does. Binding
        the endpoint to the first caller's tenant means another tenant that learnt the id can
        neither receive this endpoint's blocks nor push blocks through it.
        """
        client = self._clients.get(client_id)
        if client is None:
            raise UcxTransportError("unknown UCX client id; reconnect")
        if client.owner is None:
            client.owner = owner
        elif client.owner != owner:
            raise PermissionDeniedError(
                "this UCX client id belongs to another caller; connect an endpoint of your own"
            )
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
        """Look the keys up and answer; the found payloads then follow over UCX.

        With a dram arena, blocks are leased (:meth:`TieredStore.acquire`) and sent straight from
        their pages; the leases are given back when the sends end, however they end.
        """
        scope = self._scope()
        client = self._client(request.client_id, scope.owner)
        keys = list(request.keys)
        _check_batch(len(keys))
        sizes = list(request.sizes)
        if sizes:
            check_pairs(keys, sizes, "buffer sizes")
        arena = scope.store.arena
        if arena is None:
            return await self._get_copies(scope, client, request, keys, sizes, context)
        tiers = _tiers_before_acquire(scope.store, arena, keys, request.namespace)
        session = scope.sessions.open()
        sending = False
        try:
            acquired = await session.acquire(keys, request.namespace)
            lengths = [_acquired_length(item) for item in acquired]
            sent = [n > 0 and (not sizes or sizes[i] == n) for i, n in enumerate(lengths)]
            payloads: list[tuple[int, Any]] = []
            travelling: set[int] = set()
            for index, item in enumerate(acquired):
                if item is None or not sent[index]:
                    continue
                if not isinstance(item, Leased):
                    payloads.append((index, item))  # bytes the store could not lease
                elif len(item.lease.ranges) == 1:
                    # Zero copy: UCX reads the leased pages themselves.
                    payloads.append((index, arena.range_view(*item.lease.ranges[0])))
                    travelling.add(item.id)
                else:
                    # The wire format is one message per block: gather its runs into a copy.
                    payloads.append((index, gather(arena, item.lease.ranges, lengths[index])))
            checksums = await _checksums(payloads, len(keys))
            # Only the leases UCX reads from travel with the sends; the others come back now.
            session.release([i for i in session.leases if i not in travelling])
            if payloads:
                # The answer goes first: the client posts its receives only after reading the
                # lengths. The task's done callback runs however it ends (even cancelled before
                # it started), so the leases it sends from always come back.
                task = self._spawn(
                    self._send(client, request.transfer_id, payloads, self._timeout(context))
                )
                task.add_done_callback(lambda _: scope.sessions.close(session))
                sending = True
        finally:
            if not sending:
                scope.sessions.close(session)
        for index, item in enumerate(acquired):
            if item is None:
                tiers[index] = ""
            elif isinstance(item, Leased) and not tiers[index]:
                tiers[index] = arena.name  # stored meanwhile: the arena served it
        return ucx_pb.UcxGetResponse(lengths=lengths, sent=sent, tiers=tiers, checksums=checksums)

    async def _get_copies(
        self,
        scope: UcxScope,
        client: _Client,
        request: ucx_pb.UcxGetRequest,
        keys: list[bytes],
        sizes: list[int],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> ucx_pb.UcxGetResponse:
        """The get of a store without a dram arena: send copies of the payloads."""
        results = await scope.store.get(keys, request.namespace)
        lengths = [0 if r.payload is None else len(r.payload) for r in results]
        sent = [n > 0 and (not sizes or sizes[i] == n) for i, n in enumerate(lengths)]
        payloads = [(i, r.payload) for i, r in enumerate(results) if sent[i]]
        checksums = await _checksums(payloads, len(keys))
        if payloads:
            # The store's payloads are copies, so nothing needs pinning while they travel.
            self._spawn(self._send(client, request.transfer_id, payloads, self._timeout(context)))
        tiers = [r.tier for r in results]
        return ucx_pb.UcxGetResponse(lengths=lengths, sent=sent, tiers=tiers, checksums=checksums)

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
        """Receive the batch's payloads over UCX, then store them as ``Put`` does.

        With a dram arena, blocks are received straight into reserved pages
        (:meth:`TieredStore.reserve`) and then committed; a block the arena has no room for is
        received into a buffer of its own and stored like a ``Put``.
        """
        scope = self._scope()
        client = self._client(request.client_id, scope.owner)
        keys = list(request.keys)
        lengths = list(request.lengths)
        try:
            _check_put(scope.store, keys, lengths)
        except KVStoreError:
            # The client is already sending; dropping its endpoint fails those sends at once.
            self._drop(client, "refused a put")
            raise
        arena = scope.store.arena
        if arena is None:
            return await self._put_copies(scope, client, request, keys, lengths, context)
        session = scope.sessions.open()
        try:
            try:
                reserved = await session.reserve(keys, lengths, request.namespace)
            except KVStoreError:
                # Refused (bad keys, another namespace's key): receive as before, and let the put
                # refuse it the same way once the bytes are in.
                reserved = None
            if reserved is not None:
                return await self._put_reserved(
                    scope, client, request, arena, session, keys, lengths, reserved, context
                )
        finally:
            # Committed reservations are closed, so this gives back only what was not committed.
            scope.sessions.close(session)
        return await self._put_copies(scope, client, request, keys, lengths, context)

    async def _put_reserved(
        self,
        scope: UcxScope,
        client: _Client,
        request: ucx_pb.UcxPutRequest,
        arena: DramTier,
        session: ArenaSession,
        keys: list[bytes],
        lengths: list[int],
        reserved: list[Reserved | Literal["present"] | None],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> pb.PutResponse:
        """Receive into ``session``'s reservations (and buffers for the rest), then commit."""
        present = [
            length for item, length in zip(reserved, lengths, strict=True) if item == "present"
        ]
        # Blocks already stored still arrive (the client sends every value): they land here and
        # are dropped. Concurrent writes into one scratch buffer are harmless, nobody reads it.
        scratch = np.empty(max(present, default=0), dtype=np.uint8)
        buffers: list[Any] = []
        gathered: list[tuple[np.ndarray[Any, np.dtype[np.uint8]], Reserved]] = []
        fallback: list[int] = []
        for index, (item, length) in enumerate(zip(reserved, lengths, strict=True)):
            if isinstance(item, Reserved):
                if len(item.reservation.ranges) == 1:
                    buffers.append(arena.range_view(*item.reservation.ranges[0]))  # zero copy
                else:
                    buffer = np.empty(length, dtype=np.uint8)
                    gathered.append((buffer, item))
                    buffers.append(buffer)
            elif item == "present":
                buffers.append(scratch[:length])
            else:  # no room in the arena for it
                buffers.append(np.empty(length, dtype=np.uint8))
                fallback.append(index)
        await self._receive(client, request.transfer_id, buffers, context)
        for buffer, item in gathered:
            scatter(arena, item.reservation.ranges, buffer)
        written = [item.id for item in reserved if isinstance(item, Reserved)]
        result = await session.commit(written, request.namespace)
        stored = result.stored
        already = result.already_present + len(present)
        dropped = result.dropped
        if fallback:
            rest = await scope.store.put(
                [keys[i] for i in fallback], [buffers[i] for i in fallback], request.namespace
            )
            stored += rest.stored
            already += rest.already_present
            dropped += rest.dropped
        return pb.PutResponse(stored=stored, already_present=already, dropped=dropped)

    async def _put_copies(
        self,
        scope: UcxScope,
        client: _Client,
        request: ucx_pb.UcxPutRequest,
        keys: list[bytes],
        lengths: list[int],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> pb.PutResponse:
        """Receive into buffers of their own, then ``store.put`` them (it copies them in)."""
        # np.empty: no zeroing, every byte is about to be overwritten.
        buffers = [np.empty(length, dtype=np.uint8) for length in lengths]
        await self._receive(client, request.transfer_id, buffers, context)
        result = await scope.store.put(keys, buffers, request.namespace)
        return pb.PutResponse(
            stored=result.stored, already_present=result.already_present, dropped=result.dropped
        )

    async def _receive(
        self,
        client: _Client,
        transfer_id: int,
        buffers: Sequence[Any],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> None:
        """Receive block ``i`` of the transfer into ``buffers[i]``; UcxTransportError on failure.

        A failed, late or cancelled receive drops the endpoint first (which cancels the receives
        still posted and waits for that), so nothing writes into the buffers afterwards.
        """
        receives = [
            client.endpoint.recv(buffer, tag=transfer_tag(transfer_id, index))
            for index, buffer in enumerate(buffers)
        ]
        if not await self._transfer(client, receives, self._timeout(context), "receive"):
            raise UcxTransportError("UCX receive failed or timed out")
        self.counters["put_transfers"] += 1
        self.counters["blocks_received"] += len(buffers)
        self.counters["bytes_received"] += sum(len(buffer) for buffer in buffers)

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

    def _spawn(self, coroutine: Awaitable[None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


def _acquired_length(item: Leased | bytes | memoryview | None) -> int:
    """Payload length of one :meth:`ArenaSession.acquire` answer (0 for a miss)."""
    if item is None:
        return 0
    if isinstance(item, Leased):
        return sum(length for _, length in item.lease.ranges)
    return len(item)


def _tiers_before_acquire(
    store: TieredStore, arena: DramTier, keys: Sequence[bytes], namespace: bytes
) -> list[str]:
    """Where each key is before :meth:`TieredStore.acquire` promotes it ("" if absent).

    Keys all resident in the arena (the common case) need no store lookup, which would count as
    an engine's lookup in the store's counters.
    """
    if all(key in arena for key in keys):
        return [arena.name] * len(keys)  # misses (another namespace) are cleared later
    return list(store.lookup(keys, namespace).tiers)


async def _checksums(payloads: list[tuple[int, Any]], count: int) -> list[int]:
    """A get answer's ``checksums``: hashed off the loop (tens of GB/s, but a batch may be
    large), and without a thread hop when nothing is sent (all misses)."""
    if not payloads:
        return [0] * count
    return await asyncio.to_thread(payload_checksums, payloads, count)


def _check_put(store: TieredStore, keys: Sequence[bytes], lengths: Sequence[int]) -> None:
    """Refuse, before receiving anything, a batch the store would refuse or cannot hold."""
    _check_batch(len(keys))
    check_pairs(keys, lengths, "lengths")
    # Receive buffers are allocated up front: never more than every tier could hold.
    store.check_sizes(lengths)


def _check_batch(count: int) -> None:
    if count > MAX_BATCH:
        raise InvalidRequestError(f"{count} keys in one UCX transfer; the limit is {MAX_BATCH}")
