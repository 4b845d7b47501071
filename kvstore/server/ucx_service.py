"""The ``kvstore.v1.UcxTransfer`` gRPC service: the control half of the UCX data path.

``UcxGet`` and ``UcxPut`` carry a transfer's metadata (keys, lengths, the client id, the transfer
id) over gRPC; :class:`~kvstore.server.ucx.UcxDataServer` moves the payloads over UCX.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore._proto.kvstore.v1 import ucx_pb2 as ucx_pb
from kvstore._proto.kvstore.v1 import ucx_pb2_grpc as ucx_pb_grpc
from kvstore.protocol.ucx import UcxTransportError
from kvstore.server.durations import timed
from kvstore.server.rpc import check_decoded, guard, service_handler
from kvstore.server.ucx import UcxDataServer, UcxScope
from kvstore.store import TieredStore

__all__ = ["UCX_SERVICE_NAME", "UcxTransferServicer", "add_ucx_to_server"]

UCX_SERVICE_NAME = "kvstore.v1.UcxTransfer"

# A transfer that failed is the client's cue to use gRPC instead, not a server bug.
_ABORTED: dict[type[Exception], grpc.StatusCode] = {UcxTransportError: grpc.StatusCode.ABORTED}


class UcxTransferServicer(ucx_pb_grpc.UcxTransferServicer):  # type: ignore[misc]  # generated
    """Serves ``kvstore.v1.UcxTransfer`` for one :class:`UcxDataServer`."""

    def __init__(self, data_server: UcxDataServer) -> None:
        self.data_server = data_server

    async def UcxGet(
        self, request: ucx_pb.UcxGetRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> ucx_pb.UcxGetResponse:
        """See :meth:`UcxDataServer.get`."""

        async def call() -> ucx_pb.UcxGetResponse:
            check_decoded(request)
            return await self.data_server.get(request, context)

        with timed("get", "ucx", self.data_server.tenant):
            return await guard(context, call, _ABORTED)

    async def UcxPut(
        self, request: ucx_pb.UcxPutRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.PutResponse:
        """See :meth:`UcxDataServer.put`."""

        async def call() -> pb.PutResponse:
            check_decoded(request)
            return await self.data_server.put(request, context)

        with timed("put", "ucx", self.data_server.tenant):
            return await guard(context, call, _ABORTED)

    async def UcxBind(
        self, request: ucx_pb.UcxBindRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> ucx_pb.UcxBindResponse:
        """See :meth:`UcxDataServer.bind`."""

        async def call() -> ucx_pb.UcxBindResponse:
            check_decoded(request)
            return self.data_server.bind(request)

        return await guard(context, call, _ABORTED)


async def add_ucx_to_server(
    server: grpc.aio.Server,
    store: TieredStore,
    listen: str = "0.0.0.0:0",
    *,
    transfer_timeout_s: float = 30.0,
    session_bytes: int | None = None,
    scopes: Callable[[], UcxScope] | None = None,
    max_lanes: int = 8,
    connection_bytes: int = 256 * 1024**2,
    tenant_bytes: int = 1024**3,
) -> UcxDataServer:
    """Start a :class:`UcxDataServer` for ``store`` and register its service on ``server``.

    Call on the server's event loop before ``server.start()``. Raises
    :class:`~kvstore.protocol.ucx.UcxTransportError` (and registers nothing) when ucxx is missing
    or the listener cannot start; the caller then serves without the UCX path. ``scopes`` picks
    the calling tenant's store (the default serves ``store`` to every caller); ``session_bytes``
    caps the arena bytes one transfer holds; ``max_lanes``, ``connection_bytes`` and
    ``tenant_bytes`` are ``ucx.max_lanes`` and the in-flight limits.
    """
    data_server = UcxDataServer(
        store,
        listen,
        transfer_timeout_s=transfer_timeout_s,
        session_bytes=session_bytes,
        scopes=scopes,
        max_lanes=max_lanes,
        connection_bytes=connection_bytes,
        tenant_bytes=tenant_bytes,
    )
    await data_server.start()
    servicer = UcxTransferServicer(data_server)
    service = ucx_pb.DESCRIPTOR.services_by_name["UcxTransfer"]
    handlers = {method.name: getattr(servicer, method.name) for method in service.methods}
    server.add_generic_rpc_handlers((service_handler(service, handlers),))
    return data_server
