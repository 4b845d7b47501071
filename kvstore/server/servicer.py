"""The gRPC servicer: translation between protobuf messages and :class:`TieredStore` calls.

No store logic lives here. Each method turns a request into domain arguments, calls the store and
turns the result (or a :class:`~kvstore.errors.KVStoreError`) into a response (or a status code
with a message that says what was wrong).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from typing import Any, TypeVar

import grpc

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore._proto.kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.config import ServerConfig
from kvstore.errors import (
    CapacityError,
    DeadlineExceededError,
    InvalidRequestError,
    PermissionDeniedError,
)
from kvstore.key_scheme import KeyScheme
from kvstore.node.key_schemes import NodeKeySchemes
from kvstore.protocol.checks import (
    check_keys,
    check_streamed_block,
    check_streamed_keys,
)
from kvstore.protocol.messages import MESSAGE_TARGET_BYTES, put_retention
from kvstore.retention import KEEP
from kvstore.server.budget import InflightBudget
from kvstore.server.durations import DURATIONS, timed
from kvstore.server.key_scheme_rpc import declare
from kvstore.server.memory import memory_counters
from kvstore.server.rpc import check_decoded, guard, service_handler
from kvstore.server.tenancy import Tenant, Tenants
from kvstore.store import GetResult, TieredStore
from kvstore.store.prefetch import Prefetcher, PrefetchState
from kvstore.store.remote import REQUEST_DEADLINE

__all__ = ["KVStoreServicer", "add_to_server"]

logger = logging.getLogger(__name__)

SERVICE_NAME = "kvstore.v1.KVStore"
#: The budget of a servicer built without one (tests, embedding); ``kvstore serve`` passes its own.
DEFAULT_INFLIGHT_BYTES = ServerConfig.inflight_bytes

T = TypeVar("T")


def _server_counters(tenant: Tenant) -> dict[str, int]:
    """What the server adds to a tenant's store counters in ``Stats`` (the figures ``/metrics``
    shows too): the prefetch queue, the shared-memory server, the shared tier's backlog and
    keyring check."""
    shm = tenant.shm.stats() if tenant.shm is not None else {}
    record = tenant.keyring_record
    return {
        **tenant.prefetcher.stats(),
        # Nodes on the shared tier whose integrity keyring this one cannot verify (keyring_check).
        **({"keyring_mismatched_nodes": record.mismatched} if record is not None else {}),
        **{f"shm_{name}": count for name, count in shm.items()},
        "shared_write_backlog_bytes": tenant.store.shared_writer.backlog_bytes,
        "shared_write_queue_blocks": tenant.store.shared_writer.queued_blocks,
        "shared_write_queue_bytes": tenant.store.shared_writer.queued_bytes,
        # Copies on their way to the shared tier, by key (a delete waits for them).
        "shared_write_pending_keys": tenant.store.shared_writer.pending_keys,
        "background_tasks": tenant.store.background_tasks,
        # Bounded caches (kvstore.block.MEMO_ENTRIES, kvstore.store.counters._GONE_KEYS): they
        # fill as new keys come, and hold a few hundred bytes an entry.
        "seal_memo_entries": tenant.store.keyring.remembered_count,
        "evicted_keys_remembered": tenant.store.counters.evicted_keys_remembered,
        # Process-wide (every tenant sees the same): allocator figures, event-loop tasks.
        **memory_counters(),
        # Calls refused for their credentials belong to no tenant: the server's count.
        "miss_denied": DURATIONS.denied,
    }


class KVStoreServicer(pb_grpc.KVStoreServicer):  # type: ignore[misc]  # generated, untyped
    """Serves ``kvstore.v1.KVStore``: each call from its caller's tenant (:mod:`.tenancy`).

    Built from one ``store`` (with its ``prefetcher`` and in-flight ``budget``), every caller
    shares it; built from ``tenants``, each call gets the store, prefetch queue and budget of the
    tenant its credentials belong to, and nothing of any other.

    ``key_schemes`` answers ``KeyScheme`` calls: the node's configured chunk size and hash
    algorithm, and the namespaces its engines declared (default: the built-in defaults, for a
    node without ``[keys]`` settings and for tests).
    """

    def __init__(
        self,
        store: TieredStore | None = None,
        prefetcher: Prefetcher | None = None,
        budget: InflightBudget | None = None,
        *,
        tenants: Tenants | None = None,
        put_stream_timeout_s: float = ServerConfig.put_stream_timeout_s,
        key_schemes: NodeKeySchemes | None = None,
    ) -> None:
        if tenants is None:
            if store is None:
                raise ValueError("a servicer needs a store or tenants")
            tenants = Tenants.single(
                Tenant(
                    "",
                    store,
                    prefetcher if prefetcher is not None else Prefetcher(store),
                    budget if budget is not None else InflightBudget(DEFAULT_INFLIGHT_BYTES),
                )
            )
        self.tenants = tenants
        #: The longest one Put stream may take from its first message to its last: a client that
        #: stalls mid-stream must not keep its blocks charged to the budget for good.
        self.put_stream_timeout_s = put_stream_timeout_s
        #: Where the UCX listener is; the server fills it in once it is up.
        self.ucx_address = ""
        #: The schemes ``KeyScheme`` declares to and answers from.
        self.key_schemes = key_schemes if key_schemes is not None else NodeKeySchemes(KeyScheme())

    @staticmethod
    def _decoded(request: Any) -> None:
        check_decoded(request)

    def _tenant_name(self) -> str:
        try:
            return self.tenants.current().name
        except PermissionDeniedError:
            return ""

    def _timed(self, op: str) -> Any:
        """Time one call into ``kvstore_request_duration_seconds`` (plane ``grpc``)."""
        return timed(op, "grpc", self._tenant_name)

    async def Lookup(
        self, request: pb.LookupRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.LookupResponse:
        """Count the leading stored keys."""

        async def call() -> pb.LookupResponse:
            self._decoded(request)
            store = self.tenants.current().store
            result = await store.lookup_shared(list(request.keys), request.namespace)
            return pb.LookupResponse(hits=result.hits, tiers=result.tiers)

        with self._timed("lookup"):
            return await guard(context, call)

    async def Put(
        self,
        request_iterator: AsyncIterator[pb.PutRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> pb.PutResponse:
        """Collect the streamed batch, checking each block as it arrives, then store it whole.

        Every block is charged to the in-flight budget on arrival; the first one over a limit
        (block size, request size, keys per request, the budget) ends the call before anything of
        it is stored, and the charge is given back however the call ends.
        """
        charged = 0
        budget: InflightBudget | None = None

        async def call() -> pb.PutResponse:
            nonlocal charged, budget
            tenant = self.tenants.current()
            store, budget = tenant.store, tenant.budget
            namespace: bytes | None = None
            retention = KEEP
            keys: list[bytes] = []
            values: list[bytes] = []
            total = 0
            async for message in _within(request_iterator, self.put_stream_timeout_s):
                self._decoded(message)
                if namespace is None:
                    namespace = message.namespace
                    # Checked before any block is taken in: a refusal costs the caller nothing.
                    retention = put_retention(message)
                    store.check_retention(retention)
                elif message.namespace and message.namespace != namespace:
                    raise InvalidRequestError("one Put stream named two namespaces")
                check_streamed_keys(len(keys) + len(message.blocks), store.max_keys_per_request)
                for block in message.blocks:
                    value = block.value
                    total += len(value)
                    check_streamed_block(
                        len(keys),
                        len(value),
                        total,
                        store.max_block_bytes,
                        store.local_capacity,
                        budget.limit,
                    )
                    if not budget.try_take(len(value)):
                        raise CapacityError(
                            f"the server holds {budget.in_use} bytes of your requests in flight "
                            f"(limit {budget.limit}, server.inflight_bytes); retry later"
                        )
                    charged += len(value)
                    keys.append(block.key)
                    values.append(value)
            result = await store.put(keys, values, namespace or b"", retention)
            return pb.PutResponse(
                stored=result.stored, already_present=result.already_present, dropped=result.dropped
            )

        try:
            with self._timed("put"):
                return await guard(context, call)
        finally:
            if budget is not None:
                budget.give(charged)

    async def Get(
        self, request: pb.GetRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        """Stream results in request order, about :data:`MESSAGE_TARGET_BYTES` a message.

        Keys are read a window of about :data:`GET_WINDOW_BYTES` at a time (sized by the lengths
        the index knows), each window charged to the in-flight budget until its messages are
        sent: a request holds at most one window (plus one block) however many keys it names.
        Messages are written here, not yielded to grpc, so that a client cancelling mid-send ends
        the call quietly (:func:`_send`).
        """

        async def check() -> tuple[Tenant, list[bytes]]:
            self._decoded(request)
            tenant = self.tenants.current()
            keys = list(request.keys)
            check_keys(keys, request.namespace, tenant.store.max_keys_per_request)
            return tenant, keys

        with self._timed("get"):
            tenant, keys = await guard(context, check)
            await self._get(tenant, keys, request.namespace, context, sealed=request.sealed)

    async def _get(
        self,
        tenant: Tenant,
        keys: list[bytes],
        namespace: bytes,
        context: grpc.aio.ServicerContext[Any, Any],
        *,
        sealed: bool = False,
    ) -> None:
        """:meth:`Get`'s windows; keys not yet answered when the call is cancelled (its deadline,
        or the client gone) count as ``deadline`` misses. ``sealed``: hits carry their sealed
        header (a node reading another's blocks verifies them with it)."""
        store, budget = tenant.store, tenant.budget
        answered = 0
        left = context.time_remaining()
        # Reads this call makes on other nodes (peer fetch) end by its deadline.
        REQUEST_DEADLINE.set(None if left is None else time.monotonic() + left)
        try:
            # Closed at once on cancellation: the open window's budget goes back now, not when
            # the generator is collected.
            windows = self._windows(store, budget, keys, namespace, context, sealed)
            async with contextlib.aclosing(windows):
                async for start, response in windows:
                    answered = start
                    await _send(context, response)
        except asyncio.CancelledError:
            store.record_misses("deadline", len(keys) - answered)
            raise

    async def _windows(
        self,
        store: TieredStore,
        budget: InflightBudget,
        keys: list[bytes],
        namespace: bytes,
        context: grpc.aio.ServicerContext[Any, Any],
        sealed: bool,
    ) -> AsyncGenerator[tuple[int, pb.GetResponse], None]:
        for start, stop, estimate in _windows(store.stored_lengths(keys)):
            charged = await budget.take(estimate)
            try:
                # A key named again in the window is read once (clients may ask for one block
                # into two buffers); each naming still gets its result, within the window.
                window = list(dict.fromkeys(keys[start:stop]))

                async def read(window: list[bytes] = window) -> list[GetResult]:
                    return await store.get(window, namespace, sealed=sealed)

                read_once = dict(zip(window, await guard(context, read), strict=True))
                results = [read_once[key] for key in keys[start:stop]]
                del read_once
                for response in _responses(start, results):
                    yield start, response
                results = []  # let the window go before the next one is read
            finally:
                budget.give(charged)

    async def Delete(
        self, request: pb.DeleteRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.DeleteResponse:
        """Remove blocks from every tier."""

        async def call() -> pb.DeleteResponse:
            self._decoded(request)
            store = self.tenants.current().store
            deleted = await store.delete(list(request.keys), request.namespace)
            return pb.DeleteResponse(deleted=deleted)

        with self._timed("delete"):
            return await guard(context, call)

    async def Stats(
        self, request: pb.StatsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.StatsResponse:
        """Tier usage and counters of the caller's own store."""

        async def call() -> pb.StatsResponse:
            tenant = self.tenants.current()
            stats = tenant.store.stats()
            return pb.StatsResponse(
                tiers=[
                    pb.TierStats(name=name, values=values)
                    for name, values in stats["tiers"].items()
                ],
                counters={**stats["counters"], **_server_counters(tenant)},
                blocks=stats["blocks"],
            )

        return await guard(context, call)

    async def Prefetch(
        self, request: pb.PrefetchRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.PrefetchResponse:
        """Queue a background move of blocks into dram; answers with its id at once."""

        async def call() -> pb.PrefetchResponse:
            self._decoded(request)
            prefetcher = self.tenants.current().prefetcher
            prefetch_id = prefetcher.submit(list(request.keys), request.namespace)
            return pb.PrefetchResponse(prefetch_id=prefetch_id)

        with self._timed("prefetch"):
            return await guard(context, call)

    async def PrefetchStatus(
        self, request: pb.PrefetchStatusRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.PrefetchStatusResponse:
        """Progress of a prefetch (NOT_FOUND for an unknown id)."""

        async def call() -> pb.PrefetchStatusResponse:
            self._decoded(request)
            progress = self.tenants.current().prefetcher.status(request.prefetch_id)
            return pb.PrefetchStatusResponse(
                state=_PREFETCH_STATE[progress.state],
                total=progress.total,
                ready=progress.ready,
                missing=progress.missing,
                failed=progress.failed,
            )

        return await guard(context, call)

    async def CancelPrefetch(
        self, request: pb.CancelPrefetchRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.CancelPrefetchResponse:
        """Stop a prefetch; blocks already moved stay (NOT_FOUND for an unknown id)."""

        async def call() -> pb.CancelPrefetchResponse:
            self._decoded(request)
            prefetcher = self.tenants.current().prefetcher
            return pb.CancelPrefetchResponse(cancelled=prefetcher.cancel(request.prefetch_id))

        return await guard(context, call)

    async def close(self) -> None:
        """Cancel prefetches and wait for their moves in flight; call before closing the stores."""
        for tenant in self.tenants:
            await tenant.prefetcher.close()

    async def DataPlane(
        self, request: pb.DataPlaneRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.DataPlaneResponse:
        """Where the caller's shared-memory socket and the UCX listener are ("" where off)."""

        async def call() -> pb.DataPlaneResponse:
            self._decoded(request)
            tenant = self.tenants.current()
            return pb.DataPlaneResponse(
                shm_socket=tenant.shm_socket,
                ucx_address=self.ucx_address,
                instance_id=tenant.instance_id,
            )

        return await guard(context, call)

    async def KeyScheme(
        self, request: pb.KeySchemeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.KeySchemeResponse:
        """Record the caller's engine namespace; answer the chunk size and hash algorithm its
        connector must use (the node's ``[keys]`` settings)."""

        async def call() -> pb.KeySchemeResponse:
            self._decoded(request)
            return declare(self.key_schemes, self.tenants.current().name, request)

        return await guard(context, call)


async def _within(messages: AsyncIterator[T], seconds: float) -> AsyncIterator[T]:
    """``messages`` until they end; :class:`DeadlineExceededError` once ``seconds`` have passed."""
    try:
        async with asyncio.timeout(seconds):
            async for message in messages:
                yield message
    except TimeoutError:
        raise DeadlineExceededError(
            f"the Put stream did not end within {seconds:g}s (server.put_stream_timeout_s); "
            "none of it was stored"
        ) from None


async def _send(context: grpc.aio.ServicerContext[Any, Any], response: pb.GetResponse) -> None:
    """Write one message of a Get stream; a stream its client closed ends as cancelled.

    A client that cancels while a message is being sent fails that send in grpc's core
    (``ExecuteBatchError``). Raised out of the handler, grpc logs it with a traceback unless it
    has already seen the cancellation, which arrives separately: a race it loses about once in
    a few thousand cancelled streams. The call is over either way; ending it as cancelled is what
    grpc itself does when it sees the cancellation first, and it logs that at debug level.
    """
    try:
        await context.write(response)
    except grpc.aio.InternalError as exc:  # ExecuteBatchError: the stream closed under the send
        logger.debug("a Get stream closed while a message was sent: %s", exc)
        raise asyncio.CancelledError("the client closed the stream") from exc


#: The payload bytes one Get reads before sending them: a few messages' worth, so that tiers are
#: read in batches while a request's memory stays bounded.
GET_WINDOW_BYTES = 4 * MESSAGE_TARGET_BYTES
#: What a key this node does not index (the shared tier may hold it) counts for in a window.
UNINDEXED_ESTIMATE = MESSAGE_TARGET_BYTES // 4


def _windows(lengths: list[int | None]) -> Iterator[tuple[int, int, int]]:
    """``(start, stop, estimated bytes)`` of consecutive keys, each about GET_WINDOW_BYTES."""
    start, size = 0, 0
    for index, length in enumerate(lengths):
        size += UNINDEXED_ESTIMATE if length is None else length
        if size >= GET_WINDOW_BYTES:
            yield start, index + 1, size
            start, size = index + 1, 0
    if start < len(lengths):
        yield start, len(lengths), size


def _responses(offset: int, results: list[GetResult]) -> Iterator[pb.GetResponse]:
    """The messages of one window's results; ``offset``: the window's first index in the request."""
    batch: list[pb.GetResult] = []
    size = 0
    for index, result in enumerate(results, offset):
        if result.payload is None:
            batch.append(pb.GetResult(index=index, found=False))
        else:
            batch.append(
                pb.GetResult(
                    index=index,
                    found=True,
                    value=bytes(result.payload),
                    tier=result.tier,
                    header=result.sealed_header or b"",
                )
            )
            size += len(result.payload)
        if size >= MESSAGE_TARGET_BYTES:
            yield pb.GetResponse(results=batch)
            batch, size = [], 0
    if batch:
        yield pb.GetResponse(results=batch)


_PREFETCH_STATE = {
    PrefetchState.QUEUED: pb.PREFETCH_STATE_QUEUED,
    PrefetchState.RUNNING: pb.PREFETCH_STATE_RUNNING,
    PrefetchState.DONE: pb.PREFETCH_STATE_DONE,
    PrefetchState.CANCELLED: pb.PREFETCH_STATE_CANCELLED,
}


def add_to_server(servicer: KVStoreServicer, server: grpc.aio.Server) -> None:
    """Register ``servicer`` on ``server`` under ``kvstore.v1.KVStore`` with tolerant parsing."""
    service = pb.DESCRIPTOR.services_by_name["KVStore"]
    handlers = {method.name: getattr(servicer, method.name) for method in service.methods}
    server.add_generic_rpc_handlers((service_handler(service, handlers),))
