"""The standard ``grpc.health.v1.Health`` service, registered with tolerant request parsing.

grpc's generated registration parses requests itself; bytes that are not a
``HealthCheckRequest`` then fail inside grpc, which logs an ERROR with a full traceback for every
such request and answers UNKNOWN. Registered here instead, an undecodable probe is answered
INVALID_ARGUMENT with a message, like a malformed request to any other kvstore service, and
nothing is logged for it: a probe is not a bug of the server.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import _async as health_async
from grpc_health.v1 import health_pb2

from kvstore.server.rpc import Undecodable, service_handler

__all__ = ["HEALTH_SERVICE", "add_health_to_server"]

HEALTH_SERVICE = "grpc.health.v1.Health"


async def _refuse_undecodable(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
    if isinstance(request, Undecodable):
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT, f"undecodable request: {request.reason}"
        )


def add_health_to_server(health: health_async.HealthServicer, server: grpc.aio.Server) -> None:
    """Serve every method of ``health`` (Check, Watch, List) on ``server``, answering garbage
    INVALID_ARGUMENT."""
    service = health_pb2.DESCRIPTOR.services_by_name["Health"]
    handlers = {method.name: _tolerant(getattr(health, method.name)) for method in service.methods}
    server.add_generic_rpc_handlers((service_handler(service, handlers),))


def _tolerant(
    method: Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Awaitable[Any]],
) -> Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Awaitable[Any]]:
    async def serve(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await _refuse_undecodable(request, context)
        return await method(request, context)

    return serve
