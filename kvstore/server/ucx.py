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
be receiving into reserved pages until the transfer's operations end.) The payloads move as the
messages of the transfer's plan (:mod:`kvstore.protocol.ucx_plan`): a get plans them itself, from
its pages and the caller's ``joined`` buffers (blocks in consecutive pages as one message, a block
in several runs as one message per run, no copy); a put receives the client's plan straight into
its reserved pages where a message lies in one run of them, and into a buffer copied out after
where it does not. A block the arena has no room for is received into a buffer of its own and
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
import itertools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import numpy as np

from kvstore._proto.kvstore.v1 import ucx_pb2 as ucx_pb
from kvstore.block import BlockHeader, CorruptBlockError, Keyring
from kvstore.errors import InvalidRequestError, KVStoreError
from kvstore.protocol.checks import check_pairs
from kvstore.protocol.ucx import payload_checksums
from kvstore.protocol.ucx_plan import (
    StreamLayout,
    assign_lanes,
    check_plan,
    host_piece,
    lane_loads,
    plan_messages,
)
from kvstore.server.sessions import ArenaSessions, Leased, gather
from kvstore.server.ucx_control import UcxControl
from kvstore.server.ucx_endpoints import ClientEndpoint
from kvstore.server.ucx_put import UcxScope, check_batch
from kvstore.store import TieredStore
from kvstore.tiers.dram import DramTier

__all__ = ["UcxDataServer", "UcxScope"]

logger = logging.getLogger(__name__)


class UcxDataServer(UcxControl):
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
        max_lanes: int = 8,
        connection_bytes: int = 256 * 1024**2,
        tenant_bytes: int = 1024**3,
    ) -> None:
        super().__init__(
            listen,
            transfer_timeout_s=transfer_timeout_s,
            max_lanes=max_lanes,
            connection_bytes=connection_bytes,
            tenant_bytes=tenant_bytes,
        )
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
        """The ``UcxGet`` gRPC call: :meth:`serve_get` as the calling tenant, by its deadline."""
        return await self.serve_get(self._scope(), request, self._deadline_of(context))

    async def serve_get(
        self, scope: UcxScope, request: ucx_pb.UcxGetRequest, deadline: float
    ) -> ucx_pb.UcxGetResponse:
        """Look the keys up and answer; the found payloads then follow over UCX.

        With a dram arena, blocks are leased (:meth:`TieredStore.acquire`) and sent straight from
        their pages; the leases are given back when the sends end, however they end. Sealed: each
        with its sealed header (:func:`_seal_payloads`). ``deadline``: ``time.monotonic()`` by
        which the payloads must have moved (capped by ``transfer_timeout_s``).
        """
        clients = self._lanes(request.client_id, request.lanes, scope.owner)
        keys = list(request.keys)
        check_batch(len(keys))
        sizes = list(request.sizes)
        if sizes:
            check_pairs(keys, sizes, "buffer sizes")
        if request.joined:
            check_pairs(keys, request.joined, "joined flags")
        arena = scope.store.arena
        if arena is None:
            return await self._get_copies(scope, clients, request, keys, sizes, deadline)
        tiers = _tiers_before_acquire(scope.store, arena, keys, request.namespace)
        session = scope.sessions.open()
        sending = False
        try:
            acquired = await session.acquire(keys, request.namespace)
            got = _Leases(arena, acquired, sizes)
            await got.seal_or_hash(keys, request, scope.store.keyring)
            views, messages = got.plan(request, sizes)
            # Only the leases UCX reads from travel with the sends; the others come back now.
            session.release([i for i in session.leases if i not in got.travelling])
            if messages:
                # The sends are posted before the answer goes; an unsealed get's checksums are
                # hashed from the same leased pages while they travel (not before: that was a
                # tenth of the call, on its critical path). The session closes once the sends
                # and the hashing have both ended, however they end (the task's done callback
                # runs even if it was cancelled before it started; the hashing is shielded
                # from the call's cancellation), so no page comes back while either reads it.
                task = await self._send(
                    scope, clients, request.transfer_id, views, messages, deadline
                )
                hashing = got.hash_sent()
                _when_done(lambda: scope.sessions.close(session), task, hashing)
                sending = True
                if hashing is not None:
                    got.checksums = await asyncio.shield(hashing)
        finally:
            if not sending:
                scope.sessions.close(session)
        for index, item in enumerate(acquired):
            if item is None:
                tiers[index] = ""
            elif isinstance(item, Leased) and not tiers[index]:
                tiers[index] = arena.name  # stored meanwhile: the arena served it
        return ucx_pb.UcxGetResponse(
            lengths=got.lengths,
            sent=got.sent,
            tiers=tiers,
            checksums=got.checksums,
            headers=got.headers,
            messages=messages,
        )

    async def _get_copies(
        self,
        scope: UcxScope,
        clients: list[ClientEndpoint],
        request: ucx_pb.UcxGetRequest,
        keys: list[bytes],
        sizes: list[int],
        deadline: float,
    ) -> ucx_pb.UcxGetResponse:
        """The get of a store without a dram arena: send copies of the payloads (sealed: with
        their sealed headers)."""
        results = await scope.store.get(keys, request.namespace, sealed=request.sealed)
        lengths = [0 if r.payload is None else len(r.payload) for r in results]
        sent = [n > 0 and (not sizes or sizes[i] == n) for i, n in enumerate(lengths)]
        payloads = [(i, r.payload) for i, r in enumerate(results) if sent[i]]
        checksums = await _checksums(payloads, len(keys))
        messages = list(request.messages)
        # The store's payloads are copies, so nothing needs pinning while they travel.
        if messages:
            pieces = {i: [host_piece(p)] for i, p in payloads}
            views, voided = _posted_views(sizes, sent, pieces, messages)
            for index in voided:
                sent[index], checksums[index] = False, 0
        elif payloads:
            layout, messages = _get_plan(
                request, [i for i, _ in payloads], [[host_piece(p)] for _, p in payloads]
            )
            views = layout.views(messages)
        if messages:
            await self._send(scope, clients, request.transfer_id, views, messages, deadline)
        tiers = [r.tier for r in results]
        headers = []
        if request.sealed:
            headers = [(r.sealed_header or b"") if sent[i] else b"" for i, r in enumerate(results)]
        return ucx_pb.UcxGetResponse(
            lengths=lengths,
            sent=sent,
            tiers=tiers,
            checksums=checksums,
            headers=headers,
            messages=messages,
        )

    async def _send(
        self,
        scope: UcxScope,
        clients: list[ClientEndpoint],
        transfer_id: int,
        views: list[Any],
        messages: list[int],
        deadline: float,
    ) -> asyncio.Task[None]:
        """Once the bytes fit in flight: the task sending ``views`` over the lanes, message ``m``
        over the lane the plan ``messages`` gives it (a posted plan's empty messages too)."""
        lane_of = assign_lanes(messages, len(clients))
        loads = lane_loads([int(view.nbytes) for view in views], lane_of, len(clients))
        timeout = self._left(deadline)
        await self.inflight.admit(scope.owner, clients, loads, timeout)

        async def send() -> None:
            try:
                if await self._transfer(clients, "send", transfer_id, views, lane_of, timeout):
                    self.counters["get_transfers"] += 1
                    self.counters["messages_sent"] += len(messages)
                    self.counters["bytes_sent"] += sum(loads)
            finally:
                self.inflight.release(scope.owner, clients, loads)

        return self._spawn(send())


class _Leases:
    """What a get found in the arena and sends: per key its length and whether it is sent, the
    pieces it is sent from (leased pages, or the store's bytes), what is hashed and sealed, and
    the leases UCX reads from (``travelling``)."""

    def __init__(
        self,
        arena: DramTier,
        acquired: Sequence[Leased | bytes | memoryview | None],
        sizes: list[int],
    ) -> None:
        self.acquired = acquired
        self.lengths = [_acquired_length(item) for item in acquired]
        self.sent = [n > 0 and (not sizes or sizes[i] == n) for i, n in enumerate(self.lengths)]
        self.payloads: list[tuple[int, Any]] = []  # what is hashed and sealed, per block
        self.pieces: dict[int, list[Any]] = {}  # what is sent: UCX reads the leased pages
        self.travelling: set[int] = set()
        self.headers: list[bytes] = []
        self.checksums: list[int] = []
        self._hash_later = False  # seal_or_hash left the checksums to hash_sent
        for index, item in enumerate(acquired):
            if item is None or not self.sent[index]:
                continue
            if not isinstance(item, Leased):
                self.payloads.append((index, item))  # bytes the store could not lease
                self.pieces[index] = [host_piece(item)]
                continue
            self.pieces[index] = [arena.range_view(*run) for run in item.lease.ranges]
            self.travelling.add(item.id)
            if len(item.lease.ranges) == 1:
                self.payloads.append((index, self.pieces[index][0]))
            else:  # hashed (and sealed) as one payload; sent run by run from the pages
                self.payloads.append((index, gather(arena, item.lease.ranges, self.lengths[index])))

    def hash_sent(self) -> asyncio.Future[list[int]] | None:
        """An unsealed get's ``checksums`` of the blocks still sent, hashed off the loop from the
        pages being sent (the thread starts now); ``None`` where they are known already."""
        sent = [(index, payload) for index, payload in self.payloads if self.sent[index]]
        if not (self._hash_later and sent):
            return None
        loop = asyncio.get_running_loop()
        return loop.run_in_executor(None, payload_checksums, sent, len(self.acquired))

    def unsend(self, index: int) -> None:
        """Send block ``index`` after all (its lease, if any, comes back with the others)."""
        self.sent[index] = False
        item = self.acquired[index]
        if isinstance(item, Leased):
            self.travelling.discard(item.id)

    async def seal_or_hash(
        self, keys: list[bytes], request: ucx_pb.UcxGetRequest, keyring: Keyring
    ) -> None:
        """The answer's ``checksums`` (and, sealed, ``headers``); a block changed since its put
        is not sent."""
        count = len(keys)
        self.headers = [b""] * count if request.sealed else []
        if not request.sealed:  # hashed while the bytes travel (hash_sent)
            self.checksums = [0] * count
            self._hash_later = True
            return
        if not self.payloads:
            self.checksums = [0] * count
            return
        # One thread hop for the seals and the transport checksums both.
        seals, self.checksums = await asyncio.to_thread(
            _seal_payloads, keys, request.namespace, self.acquired, self.payloads, keyring
        )
        for index, seal in seals.items():
            if seal is None:  # changed since its put: never signed nor sent
                self.unsend(index)
        self.payloads = [(index, payload) for index, payload in self.payloads if self.sent[index]]
        self.headers = [seals.get(i) or b"" if self.sent[i] else b"" for i in range(count)]

    def plan(self, request: ucx_pb.UcxGetRequest, sizes: list[int]) -> tuple[list[Any], list[int]]:
        """What to send, message by message, and the plan: the caller's posted plan (each
        message whole or empty) or this side's."""
        messages = list(request.messages)
        if messages:  # the caller posted its receives: its plan, each message whole or empty
            views, voided = _posted_views(sizes, self.sent, self.pieces, messages)
            for index in voided:
                self.unsend(index)
                self.checksums[index] = 0
                if self.headers:
                    self.headers[index] = b""
            return views, messages
        if not self.payloads:
            return [], []
        sending = [self.pieces[index] for index, _ in self.payloads]
        layout, messages = _get_plan(request, [i for i, _ in self.payloads], sending)
        return layout.views(messages), messages


def _posted_views(
    sizes: list[int], sent: list[bool], pieces: dict[int, list[Any]], messages: list[int]
) -> tuple[list[Any], set[int]]:
    """What to send for a plan the caller posted its receives for (its buffers of ``sizes``, one
    after another): per message, its bytes from ``pieces`` of the blocks it covers (a copy only
    where those do not lie in one run here), or nothing where one of them is not sent; and the
    blocks found that go unsent for that (every message covering one is empty then)."""
    if not sizes:
        raise InvalidRequestError("a UcxGet with a posted plan must give every buffer's size")
    try:
        check_plan(messages, sum(sizes), [], longest=max(sizes))
    except ValueError as exc:
        raise InvalidRequestError(f"UcxGet plan: {exc}") from exc
    starts = [0] * len(sizes)
    for index in range(1, len(sizes)):
        starts[index] = starts[index - 1] + sizes[index - 1]
    # The blocks each message covers (one walk: messages and blocks are both in stream order).
    spans: list[tuple[int, int, list[int]]] = []
    block, offset = 0, 0
    for length in messages:
        end = offset + length
        while block < len(sizes) and starts[block] + sizes[block] <= offset:
            block += 1
        covered, after = [], block
        while after < len(sizes) and starts[after] < end:
            if sizes[after]:
                covered.append(after)
            after += 1
        spans.append((offset, length, covered))
        offset = end
    # Blocks that share a message form runs (cut where a message ends at a block's start); a
    # run with a block not sent sends none of its blocks.
    boundaries = set(itertools.accumulate(messages))
    runs: list[list[int]] = []
    for index in (i for i in range(len(sizes)) if sizes[i]):
        if not runs or starts[index] in boundaries:
            runs.append([])
        runs[-1].append(index)
    voided = {i for run in runs if not all(sent[j] for j in run) for i in run if sent[i]}
    views: list[Any] = []
    for offset, length, blocks in spans:
        if any(not sent[i] or i in voided for i in blocks):
            views.append(np.empty(0, dtype=np.uint8))
            continue
        local = StreamLayout([pieces[i] for i in blocks])
        inside = offset - starts[blocks[0]]
        if not local.crosses_break(inside, length):
            views.append(local.view(inside, length))
            continue
        copy = np.empty(length, dtype=np.uint8)  # pages not next to each other here
        cuts = [b for b in local.breaks if inside < b < inside + length]
        done = inside
        for cut in [*cuts, inside + length]:
            copy[done - inside : cut - inside] = local.view(done, cut - done)
            done = cut
        views.append(copy)
    return views, voided


def _get_plan(
    request: ucx_pb.UcxGetRequest, indices: list[int], pieces: list[list[Any]]
) -> tuple[StreamLayout, list[int]]:
    """The layout of a get's stream (blocks ``indices`` of the request, sent from ``pieces``)
    and its plan: cut where this side's memory breaks, and where the caller's buffers do."""
    layout = StreamLayout(pieces)
    theirs = []
    for position in range(1, len(indices)):
        index = indices[position]
        joined = (
            index == indices[position - 1] + 1 and bool(request.joined) and request.joined[index]
        )
        if not (request.receive_any or joined):
            theirs.append(layout.block_starts[position])
    return layout, plan_messages(layout.total, [*layout.breaks, *theirs])


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


def _when_done(callback: Callable[[], None], *futures: asyncio.Future[Any] | None) -> None:
    """Call ``callback`` once every future given (``None``: none) has ended, however."""
    pending = [future for future in futures if future is not None]
    left = len(pending)

    def one(_: asyncio.Future[Any]) -> None:
        nonlocal left
        left -= 1
        if left == 0:
            callback()

    for future in pending:
        future.add_done_callback(one)


async def _checksums(payloads: list[tuple[int, Any]], count: int) -> list[int]:
    """A get answer's ``checksums``: hashed off the loop (tens of GB/s, but a batch may be
    large), and without a thread hop when nothing is sent (all misses)."""
    if not payloads:
        return [0] * count
    return await asyncio.to_thread(payload_checksums, payloads, count)
