"""The put half of the UCX data path's server (:class:`UcxPuts`, which
:class:`~kvstore.server.ucx.UcxDataServer` extends with gets), and :class:`UcxScope`.

A put's client sends at once, as the messages of its own plan (``UcxPutRequest.messages``,
:mod:`kvstore.protocol.ucx_plan`), over the lanes it names. With a dram arena, blocks are received
straight into reserved pages (:meth:`TieredStore.reserve`) and then committed: a message that lies
in one run of them lands there, one that spans pages not next to each other lands in a buffer of
its own and is copied out (counted in ``bounced_messages``). A block the arena has no room for is
received into a buffer of its own and stored like a ``Put``. A lane that fails stores nothing of
the batch (the reservations are given back): the client sends it again over its other lanes, or
over gRPC. Runs on the server's event loop, like the rest of it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import grpc
import numpy as np

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore._proto.kvstore.v1 import ucx_pb2 as ucx_pb
from kvstore.errors import InvalidRequestError, KVStoreError
from kvstore.protocol.checks import check_pairs
from kvstore.protocol.ucx import MAX_BATCH, UcxTransportError
from kvstore.protocol.ucx_plan import StreamLayout, assign_lanes, check_plan, lane_loads
from kvstore.server.sessions import ArenaSession, ArenaSessions, Reserved
from kvstore.server.ucx_endpoints import ClientEndpoint, UcxEndpoints
from kvstore.store import TieredStore
from kvstore.tiers.dram import DramTier

__all__ = ["UcxPuts", "UcxScope", "check_batch"]


@dataclass(frozen=True)
class UcxScope:
    """What one caller's transfers may touch: its tenant (``owner``), store and arena sessions."""

    owner: str
    store: TieredStore
    sessions: ArenaSessions


class UcxPuts(UcxEndpoints):
    """``UcxPut``: receive a batch over the caller's lanes, then store it."""

    #: The scope of the calling tenant (set by the server).
    _scope: Callable[[], UcxScope]

    # -- put -------------------------------------------------------------------------------

    async def put(
        self, request: ucx_pb.UcxPutRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.PutResponse:
        """The ``UcxPut`` gRPC call: :meth:`serve_put` as the calling tenant, by its deadline."""
        return await self.serve_put(self._scope(), request, self._deadline_of(context))

    async def serve_put(
        self,
        scope: UcxScope,
        request: ucx_pb.UcxPutRequest,
        deadline: float,
        *,
        drop_refused: bool = True,
    ) -> pb.PutResponse:
        """Receive the batch's payloads over UCX, then store them as ``Put`` does.

        With a dram arena, blocks are received straight into reserved pages
        (:meth:`TieredStore.reserve`) and then committed; a block the arena has no room for is
        received into a buffer of its own and stored like a ``Put``. ``deadline``: as
        :meth:`~kvstore.server.ucx.UcxDataServer.serve_get`. A batch refused before anything
        is received drops the caller's endpoints (ending its sends at once), unless
        ``drop_refused`` is false: a control message's refusal must still travel over them (the
        client drops them on reading it).
        """
        clients = self._lanes(request.client_id, request.lanes, scope.owner)
        keys = list(request.keys)
        lengths = list(request.lengths)
        try:
            _check_put(scope.store, keys, lengths)
            messages = list(request.messages) or [n for n in lengths if n]
            try:
                check_plan(messages, sum(lengths), [], longest=max(lengths, default=0))
            except ValueError as exc:
                raise InvalidRequestError(f"UcxPut plan: {exc}") from exc
        except KVStoreError:
            # The client is already sending; dropping its endpoints fails those sends at once.
            for client in clients if drop_refused else ():
                self._drop(client, "refused a put")
            raise
        arena = scope.store.arena
        if arena is None:
            return await self._put_copies(
                scope, clients, request, keys, lengths, messages, deadline
            )
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
                    scope, clients, request, arena, session, reserved, messages, deadline
                )
        finally:
            # Committed reservations are closed, so this gives back only what was not committed.
            scope.sessions.close(session)
        return await self._put_copies(scope, clients, request, keys, lengths, messages, deadline)

    async def _put_reserved(
        self,
        scope: UcxScope,
        clients: list[ClientEndpoint],
        request: ucx_pb.UcxPutRequest,
        arena: DramTier,
        session: ArenaSession,
        reserved: list[Reserved | Literal["present"] | None],
        messages: list[int],
        deadline: float,
    ) -> pb.PutResponse:
        """Receive into ``session``'s reservations (and buffers for the rest), then commit."""
        keys, lengths = list(request.keys), list(request.lengths)
        present = [
            length for item, length in zip(reserved, lengths, strict=True) if item == "present"
        ]
        # Blocks already stored still arrive (the client sends every value): they land here and
        # are dropped. Concurrent writes into one scratch buffer are harmless, nobody reads it.
        scratch = np.empty(max(present, default=0), dtype=np.uint8)
        pieces: list[list[Any]] = []
        fallback: dict[int, np.ndarray[Any, np.dtype[np.uint8]]] = {}
        for index, (item, length) in enumerate(zip(reserved, lengths, strict=True)):
            if isinstance(item, Reserved):
                pieces.append([arena.range_view(*run) for run in item.reservation.ranges])
            elif item == "present":
                pieces.append([scratch[:length]])
            else:  # no room in the arena for it
                fallback[index] = np.empty(length, dtype=np.uint8)
                pieces.append([fallback[index]])
        await self._receive(
            scope, clients, request.transfer_id, StreamLayout(pieces), messages, deadline
        )
        written = [item.id for item in reserved if isinstance(item, Reserved)]
        result = await session.commit(written, request.namespace)
        stored = result.stored
        already = result.already_present + len(present)
        dropped = result.dropped
        if fallback:
            rest = await scope.store.put(
                [keys[i] for i in fallback], list(fallback.values()), request.namespace
            )
            stored += rest.stored
            already += rest.already_present
            dropped += rest.dropped
        return pb.PutResponse(stored=stored, already_present=already, dropped=dropped)

    async def _put_copies(
        self,
        scope: UcxScope,
        clients: list[ClientEndpoint],
        request: ucx_pb.UcxPutRequest,
        keys: list[bytes],
        lengths: list[int],
        messages: list[int],
        deadline: float,
    ) -> pb.PutResponse:
        """Receive into one buffer, then ``store.put`` its slices (it copies them in)."""
        # np.empty: no zeroing, every byte is about to be overwritten.
        stream = np.empty(sum(lengths), dtype=np.uint8)
        starts: list[int] = [0] * len(lengths)
        for index in range(1, len(lengths)):
            starts[index] = starts[index - 1] + lengths[index - 1]
        buffers = [stream[start : start + n] for start, n in zip(starts, lengths, strict=True)]
        await self._receive(
            scope,
            clients,
            request.transfer_id,
            StreamLayout([[b] for b in buffers]),
            messages,
            deadline,
        )
        result = await scope.store.put(keys, buffers, request.namespace)
        return pb.PutResponse(
            stored=result.stored, already_present=result.already_present, dropped=result.dropped
        )

    async def _receive(
        self,
        scope: UcxScope,
        clients: list[ClientEndpoint],
        transfer_id: int,
        layout: StreamLayout,
        messages: list[int],
        deadline: float,
    ) -> None:
        """Receive the plan's messages into ``layout``; UcxTransportError on failure.

        A message that crosses a break of ``layout`` lands in a buffer of its own, copied out
        after. A failed, late or cancelled receive drops its lane first (which cancels the
        receives still posted and waits for that), so nothing writes into the pages afterwards;
        then nothing is committed (the client sends the batch again, or over gRPC).
        """
        views: list[Any] = []
        bounced: list[tuple[int, np.ndarray[Any, np.dtype[np.uint8]]]] = []
        offset = 0
        for length in messages:
            if layout.crosses_break(offset, length):
                buffer = np.empty(length, dtype=np.uint8)
                bounced.append((offset, buffer))
                views.append(buffer)
            else:
                views.append(layout.view(offset, length))
            offset += length
        lane_of = assign_lanes(messages, len(clients))
        loads = lane_loads(messages, lane_of, len(clients))
        timeout = self._left(deadline)
        try:
            await self.inflight.admit(scope.owner, clients, loads, timeout)
        except UcxTransportError:
            for client in clients:  # the client is sending: end its sends now, not at its deadline
                self._drop(client, "no room for its bytes in flight")
            raise
        try:
            ok = await self._transfer(clients, "recv", transfer_id, views, lane_of, timeout)
        finally:
            self.inflight.release(scope.owner, clients, loads)
        if not ok:
            raise UcxTransportError("UCX receive failed or timed out")
        for start, buffer in bounced:
            layout.scatter(start, buffer)
        self.counters["put_transfers"] += 1
        self.counters["blocks_received"] += len(layout.block_starts)
        self.counters["messages_received"] += len(messages)
        self.counters["bounced_messages"] += len(bounced)
        self.counters["bytes_received"] += layout.total


def _check_put(store: TieredStore, keys: Sequence[bytes], lengths: Sequence[int]) -> None:
    """Refuse, before receiving anything, a batch the store would refuse or cannot hold."""
    check_batch(len(keys))
    check_pairs(keys, lengths, "lengths")
    # Receive buffers are allocated up front: never more than every tier could hold.
    store.check_sizes(lengths)


def check_batch(count: int) -> None:
    """Refuse a transfer of more keys than the tags can number."""
    if count > MAX_BATCH:
        raise InvalidRequestError(f"{count} keys in one UCX transfer; the limit is {MAX_BATCH}")
