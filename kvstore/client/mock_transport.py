"""A transport that answers from a function, so tests drive a real client with no server.

``MockTransport(handler)`` calls ``handler(method, request)`` for every call the client makes
(``method`` as in ``proto/kvstore/v1/kvstore.proto``) and returns what it returns: the response
message, or for ``Get`` (a server-streaming call) an iterable of ``GetResponse`` messages. ``Put``
is client-streaming: its ``request`` is the list of the stream's ``PutRequest`` messages. The
messages are the generated module's, importable from here as ``pb``. A handler fails a call by
raising :meth:`MockTransport.error`, which the client maps to the same
:class:`~kvstore.errors.KVStoreError` as that status from a server; a call whose deadline passes
before the handler returns fails with ``DEADLINE_EXCEEDED``, as over gRPC. It is a
:class:`~kvstore.client.transport.Transport` and an ``AsyncTransport`` both::

    import grpc
    from kvstore import KVStoreClient, MockTransport, Namespace
    from kvstore.testing import pb

    def handler(method, request):
        if method == "Lookup":  # none of the keys is stored
            return pb.LookupResponse(hits=0, tiers=[""] * len(request.keys))
        raise MockTransport.error(grpc.StatusCode.UNAVAILABLE, "store is down")

    transport = MockTransport(handler)
    with KVStoreClient("unused", namespace=Namespace(model="m"), transport=transport) as client:
        assert client.lookup([bytes(16)]) == 0  # client.put(...) raises StoreUnavailableError
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from google.protobuf.message import Message

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb

__all__ = ["Handler", "MockRpcError", "MockTransport", "pb"]

#: ``handler(method, request) -> response``.
Handler = Callable[[str, Any], Any]


class MockRpcError(grpc.RpcError):
    """A failed call with a status ``code`` and ``details``, as gRPC raises it."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        """The call's status code."""
        return self._code

    def details(self) -> str:
        """The message the status came with."""
        return self._details


class MockTransport:
    """Answers every call with ``handler(method, request)`` (see the module docstring).

    ``when_reconnected`` callbacks wait for :meth:`reconnect`, which plays a server that answers
    again. Calls after :meth:`close` raise ``ValueError``, as a closed gRPC channel does.
    """

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        #: Whether :meth:`close` (or :meth:`aclose`) was called.
        self.closed = False
        self._callbacks: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    @staticmethod
    def error(code: grpc.StatusCode, message: str = "") -> MockRpcError:
        """The error for a handler to raise to fail a call with ``code``."""
        return MockRpcError(code, message or code.name.lower())

    def call(
        self,
        method: str,
        request: Any,
        timeout: float,
        each: Callable[[Any], None] | None = None,
    ) -> Any:
        """The handler's answer to ``request``; a stream's messages to ``each``."""
        if self.closed:
            raise ValueError("Cannot invoke RPC on a closed MockTransport")
        if timeout <= 0:
            raise self.error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        if isinstance(request, Iterator):  # a request stream: a list a handler can read twice
            request = list(request)
        started = time.monotonic()
        response = self.handler(method, request)
        if response is None or (each is not None and isinstance(response, Message)):
            shape = "an iterable of messages" if each is not None else "a response message"
            raise TypeError(f"the handler must answer {method} with {shape}, not {response!r}")
        if each is not None:
            for message in response:
                each(message)
            response = None
        if time.monotonic() - started > timeout:
            raise self.error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        return response

    async def acall(
        self,
        method: str,
        request: Any,
        timeout: float,
        each: Callable[[Any], None] | None = None,
    ) -> Any:
        """:meth:`call`, for the asyncio client (the handler runs on the event loop's thread)."""
        return self.call(method, request, timeout, each)

    def when_reconnected(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` on the next :meth:`reconnect`."""
        with self._lock:
            self._callbacks.append(callback)

    def reconnect(self) -> None:
        """Play the server answering again: call (once) every ``when_reconnected`` callback."""
        with self._lock:
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    def close(self) -> None:
        """Refuse further calls."""
        self.closed = True

    async def aclose(self) -> None:
        """:meth:`close`, for the asyncio client."""
        self.close()
