"""What every gRPC service of the server shares: errors mapped to statuses, tolerant parsing.

:func:`guard` runs a handler's work and answers a :class:`~kvstore.errors.KVStoreError` with its
status and message (anything unexpected with INTERNAL, logged once as a bug);
:func:`tolerant_parser` and :func:`check_decoded` turn undecodable request bytes into
INVALID_ARGUMENT with a message instead of grpc's bare UNKNOWN; :func:`service_handler` registers
a servicer's methods as the service's descriptor declares them, each with tolerant parsing.
``kvstore.v1.KVStore``, the UCX control service and the health service all use them.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import grpc
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass

from kvstore.errors import InvalidRequestError, KVStoreError, PermissionDeniedError, status_of
from kvstore.server.durations import DURATIONS

__all__ = ["Undecodable", "check_decoded", "guard", "service_handler", "tolerant_parser"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


async def guard(
    context: grpc.aio.ServicerContext[Any, Any],
    call: Callable[[], Awaitable[T]],
    statuses: Mapping[type[Exception], grpc.StatusCode] | None = None,
) -> T:
    """Run ``call``; map kvstore errors to their status, anything else to INTERNAL.

    ``statuses`` maps further exception types to the status they answer with (a transport's own
    failures, say); anything still unmatched is logged as a bug.
    """
    try:
        return await call()
    except KVStoreError as exc:
        code, details = status_of(exc), str(exc)
        if isinstance(exc, PermissionDeniedError):
            DURATIONS.denied += 1  # a ``denied`` miss: the call was refused before any key
    except DecodeError as exc:  # a streamed message that is not protobuf
        code, details = grpc.StatusCode.INVALID_ARGUMENT, f"undecodable request: {exc}"
    except Exception as exc:
        matched = [status for kind, status in (statuses or {}).items() if isinstance(exc, kind)]
        if matched:
            code, details = matched[0], str(exc)
        else:
            logger.exception("unexpected failure serving a request")
            code, details = grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}"
    # Aborted outside the except clause: the abort must not chain the request's exception, whose
    # traceback holds the frames (and every payload a refused Put stream had received) for as
    # long as grpc keeps the abort around.
    await context.abort(code, details)
    raise AssertionError("unreachable: context.abort raises")


class Undecodable:
    """Stands in for a request whose bytes are not the expected protobuf message."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def check_decoded(request: Any) -> None:
    """Refuse (INVALID_ARGUMENT) a request :func:`tolerant_parser` could not decode."""
    if isinstance(request, Undecodable):
        raise InvalidRequestError(f"undecodable request: {request.reason}")


def tolerant_parser(message_type: type[Message]) -> Callable[[bytes], Any]:
    """A deserializer that hands undecodable bytes to the handler instead of failing in grpc.

    grpc answers a raising deserializer with UNKNOWN; letting the handler see it gives the client
    INVALID_ARGUMENT with a message, as for every other malformed request.
    """

    def parse(data: bytes) -> Any:
        try:
            return message_type.FromString(data)
        except DecodeError as exc:
            return Undecodable(str(exc))

    return parse


# grpc's handler factory for each (client streams, server streams) shape a method can have.
_HANDLER_FACTORIES: dict[tuple[bool, bool], Callable[..., grpc.RpcMethodHandler[Any, Any]]] = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def service_handler(
    service: ServiceDescriptor, handlers: Mapping[str, Callable[..., Any]]
) -> grpc.GenericRpcHandler[Any, Any]:
    """A generic handler serving every method of ``service`` with ``handlers[method name]``.

    Request and response types and the streaming shape come from the descriptor (the ``.proto``
    file), so a method added there cannot be registered with the wrong types or shape; requests are
    parsed with :func:`tolerant_parser`. A method of the service with no handler, or a handler for
    a method the service does not declare, raises ``ValueError`` at registration: a server must not
    start answering UNIMPLEMENTED for a method its clients were generated with.
    """
    methods = {method.name: method for method in service.methods}
    missing = sorted(set(methods) - set(handlers))
    unknown = sorted(set(handlers) - set(methods))
    if missing or unknown:
        raise ValueError(
            f"{service.full_name}: handlers missing for {missing or 'none'}, "
            f"given for undeclared methods {unknown or 'none'}"
        )
    table = {name: _method_handler(methods[name], handlers[name]) for name in methods}
    return grpc.method_handlers_generic_handler(service.full_name, table)


def _method_handler(
    method: MethodDescriptor, handler: Callable[..., Any]
) -> grpc.RpcMethodHandler[Any, Any]:
    factory = _HANDLER_FACTORIES[(method.client_streaming, method.server_streaming)]
    request_type = GetMessageClass(method.input_type)
    response_type = GetMessageClass(method.output_type)
    return factory(
        handler,
        request_deserializer=tolerant_parser(request_type),
        response_serializer=response_type.SerializeToString,
    )
