"""The server side of the UCX data path: a UCX listener that moves the payloads of
``kvstore.v1.UcxTransfer`` calls (the gRPC service itself: :mod:`kvstore.server.ucx_service`).

The listener and the client endpoints it registers, over which the payloads move, are
:class:`~kvstore.server.ucx_endpoints.UcxEndpoints`, which :class:`UcxDataServer` extends with the
calls; like it, everything here runs on the server's one asyncio event loop, the only thread
allowed to touch the :class:`~kvstore.store.TieredStore`.

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

A *sealed* get (another node's peer fetch, ``UcxGetRequest.sealed``) is sent from the leased pages
too, each block with its packed wire header and keyed MAC beside it in the answer: the pages are
checked against the checksum recorded at put first (a block changed since is not sent: the reader
asks its next holder), and the seal is the one the store's keyring remembers for that block
(signed once, at write-through or first serve). A co-located client that writes the pages after
that check makes the reader's MAC check fail: the block is refused there, never installed, and
this node is suspect to that reader until it restarts (a client able to write the arena can
spoil the blocks it holds anyway; it cannot make a wrong byte be served).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import grpc
import numpy as np

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore._proto.kvstore.v1 import ucx_pb2 as ucx_pb
from kvstore.block import BlockHeader, CorruptBlockError, Keyring
from kvstore.errors import InvalidRequestError, KVStoreError
from kvstore.protocol.checks import check_pairs
from kvstore.protocol.ucx import MAX_BATCH, UcxTransportError, payload_checksums, transfer_tag
from kvstore.server.sessions import ArenaSession, ArenaSessions, Leased, Reserved, gather, scatter
from kvstore.server.ucx_endpoints import ClientEndpoint, UcxEndpoints
from kvstore.store import TieredStore
from kvstore.tiers.dram import DramTier

__all__ = ["UcxDataServer", "UcxScope"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class UcxScope:
    """What one caller's transfers may touch: its tenant (``owner``), store and arena sessions."""

    owner: str
    store: TieredStore
    sessions: ArenaSessions


class UcxDataServer(UcxEndpoints):
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
        super().__init__(listen, transfer_timeout_s=transfer_timeout_s)
        self.store = store
        # One transfer may hold at most ``session_bytes`` of the arena leased or reserved.
        only = UcxScope("", store, ArenaSessions(store, session_bytes))
        #: The scope of the calling tenant (a server with tenants passes its own rule).
        self._scope = scopes if scopes is not None else (lambda: only)

    def tenant(self) -> str:
        """The calling tenant's name ("" where the caller has none): a metrics label."""
        try:
            return self._scope().owner
        except KVStoreError:
            return ""

    # -- get -------------------------------------------------------------------------------

    async def get(
        self, request: ucx_pb.UcxGetRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> ucx_pb.UcxGetResponse:
        """Look the keys up and answer; the found payloads then follow over UCX.

        With a dram arena, blocks are leased (:meth:`TieredStore.acquire`) and sent straight from
        their pages; the leases are given back when the sends end, however they end. Sealed: each
        with its sealed header (:func:`_seal_payloads`).
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
            headers: list[bytes] = [b""] * len(keys) if request.sealed else []
            if request.sealed and payloads:
                # One thread hop for the seals and the transport checksums both.
                seals, checksums = await asyncio.to_thread(
                    _seal_payloads, keys, request.namespace, acquired, payloads, scope.store.keyring
                )
                for index, seal in seals.items():
                    if seal is None:  # changed since its put: never signed nor sent
                        sent[index] = False
                        item = acquired[index]
                        if isinstance(item, Leased):
                            travelling.discard(item.id)
                payloads = [(index, payload) for index, payload in payloads if sent[index]]
                headers = [
                    seals.get(index) or b"" if sent[index] else b"" for index in range(len(keys))
                ]
            else:
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
        return ucx_pb.UcxGetResponse(
            lengths=lengths, sent=sent, tiers=tiers, checksums=checksums, headers=headers
        )

    async def _get_copies(
        self,
        scope: UcxScope,
        client: ClientEndpoint,
        request: ucx_pb.UcxGetRequest,
        keys: list[bytes],
        sizes: list[int],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> ucx_pb.UcxGetResponse:
        """The get of a store without a dram arena: send copies of the payloads (sealed: with
        their sealed headers)."""
        results = await scope.store.get(keys, request.namespace, sealed=request.sealed)
        lengths = [0 if r.payload is None else len(r.payload) for r in results]
        sent = [n > 0 and (not sizes or sizes[i] == n) for i, n in enumerate(lengths)]
        payloads = [(i, r.payload) for i, r in enumerate(results) if sent[i]]
        checksums = await _checksums(payloads, len(keys))
        if payloads:
            # The store's payloads are copies, so nothing needs pinning while they travel.
            self._spawn(self._send(client, request.transfer_id, payloads, self._timeout(context)))
        tiers = [r.tier for r in results]
        headers = []
        if request.sealed:
            headers = [(r.sealed_header or b"") if sent[i] else b"" for i, r in enumerate(results)]
        return ucx_pb.UcxGetResponse(
            lengths=lengths, sent=sent, tiers=tiers, checksums=checksums, headers=headers
        )

    async def _send(
        self,
        client: ClientEndpoint,
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
        client: ClientEndpoint,
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
        client: ClientEndpoint,
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
        client: ClientEndpoint,
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


def _seal_payloads(
    keys: Sequence[bytes],
    namespace: bytes,
    acquired: Sequence[Leased | bytes | memoryview | None],
    payloads: Sequence[tuple[int, Any]],
    keyring: Keyring,
) -> tuple[dict[int, bytes | None], list[int]]:
    """Per sent index, the sealed header of its payload under ``keyring``, or ``None`` where the
    bytes no longer match the checksum they were stored with (logged); and the answer's
    ``checksums`` for the payloads sealed. A leased block is checked against its stored header,
    as its pages are now; a payload the store could not lease (read and verified from a lower
    tier, a copy) is sealed as it is. A MAC is computed only for a block the keyring does not
    remember."""
    seals: dict[int, bytes | None] = {}
    for index, payload in payloads:
        item = acquired[index]
        if isinstance(item, Leased):
            header = item.lease.header
        else:
            header = BlockHeader.for_payload(keys[index], namespace, payload)
        try:
            seals[index] = header.seal(payload, keyring)
        except CorruptBlockError:
            logger.error("not sending block %s: changed since its put", keys[index].hex())
            seals[index] = None
    sealed = [(index, payload) for index, payload in payloads if seals[index] is not None]
    return seals, payload_checksums(sealed, len(keys))


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
