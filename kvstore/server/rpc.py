"""What every gRPC service of the server shares: errors mapped to statuses, tolerant parsing.

:func:`guard` runs a handler's work and answers a :class:`~kvstore.errors.KVStoreError` with its
status and message (anything unexpected with INTERNAL, logged once as a bug);
:func:`tolerant_parser` and :func:`check_decoded` turn undecodable request bytes into
INVALID_ARGUMENT with a message instead of grpc's bare UNKNOWN. ``kvstore.v1.KVStore``, the UCX
control service and the health service all use them.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from kvstore.errors import InvalidRequestError, KVStoreError, PermissionDeniedError, status_of
from kvstore.server.durations import DURATIONS

__all__ = ["Undecodable", "check_decoded", "guard", "tolerant_parser"]

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
