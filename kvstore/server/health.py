"""The standard ``grpc.health.v1.Health`` service, registered with tolerant request parsing.

grpc's generated registration parses requests itself; bytes that are not a
``HealthCheckRequest`` then fail inside grpc, which logs an ERROR with a full traceback for every
such request and answers UNKNOWN. Registered here instead, an undecodable probe is answered
INVALID_ARGUMENT with a message, like a malformed request to any other kvstore service, and
nothing is logged for it: a probe is not a bug of the server.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import _async as health_async
from grpc_health.v1 import health_pb2

from kvstore.server.rpc import Undecodable, tolerant_parser

__all__ = ["HEALTH_SERVICE", "add_health_to_server"]

HEALTH_SERVICE = "grpc.health.v1.Health"


_parse = tolerant_parser(health_pb2.HealthCheckRequest)


async def _refuse_undecodable(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
    if isinstance(request, Undecodable):
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT, f"undecodable request: {request.reason}"
        )


def add_health_to_server(health: health_async.HealthServicer, server: grpc.aio.Server) -> None:
    """Serve ``health`` (Check and Watch) on ``server``, answering garbage INVALID_ARGUMENT."""

    async def check(
        request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> health_pb2.HealthCheckResponse:
        await _refuse_undecodable(request, context)
        return await health.Check(request, context)

    async def watch(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await _refuse_undecodable(request, context)
        await health.Watch(request, context)

    serialize: Callable[[health_pb2.HealthCheckResponse], bytes] = (
        health_pb2.HealthCheckResponse.SerializeToString
    )
    handlers = {
        "Check": grpc.unary_unary_rpc_method_handler(
            check, request_deserializer=_parse, response_serializer=serialize
        ),
        "Watch": grpc.unary_stream_rpc_method_handler(
            watch, request_deserializer=_parse, response_serializer=serialize
        ),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(HEALTH_SERVICE, handlers),)
    )
