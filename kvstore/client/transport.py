"""The seam between a client and the wire: a :class:`Transport` carries every control-plane call.

A client's plans (:mod:`kvstore.client.core`) yield :class:`~kvstore.client.steps.Rpc` steps;
the client hands each to its transport's one method::

    call(method, request, timeout, each=None) -> response

``method`` is the RPC's name in ``proto/kvstore/v1/kvstore.proto`` (``"Lookup"``, ``"Put"``,
``"Get"``, ...), ``request`` its request message (for ``Put``, a client-streaming call, an iterator
of ``PutRequest`` messages), ``timeout`` the seconds left of the call's deadline. A
server-streaming call (``Get``) passes ``each``, which receives every message, and returns
``None``. A failure is raised as a ``grpc.RpcError`` (``code()``, ``details()``), which the plan
maps to a :class:`~kvstore.errors.KVStoreError` in one place, whatever the transport.

:class:`GrpcTransport` and :class:`AsyncGrpcTransport` are what the clients open by default: the
server's stub over a blocking or ``grpc.aio`` channel. :class:`~kvstore.client.mock_transport.
MockTransport` answers from a function, for tests of code that uses a client. The shared-memory
and UCX data planes need a real server: a client given a transport of its own runs over it alone.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, Protocol

import grpc

from kvstore._proto.kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.client.channel import (
    ChannelSecurity,
    ReconnectWatch,
    aio_channel,
    await_reconnect,
    blocking_channel,
    settle_watches,
    when_reconnected,
)

__all__ = ["AsyncGrpcTransport", "AsyncTransport", "GrpcTransport", "Transport"]


class Transport(Protocol):
    """What :class:`~kvstore.KVStoreClient` needs of the wire: a call, a reconnect watch, close."""

    def call(
        self,
        method: str,
        request: Any,
        timeout: float,
        each: Callable[[Any], None] | None = None,
    ) -> Any:
        """Make the RPC ``method`` within ``timeout`` seconds (see the module docstring)."""
        ...

    def when_reconnected(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once, from another thread, when the server answers again."""
        ...

    def close(self) -> None:
        """Release the connection."""
        ...


class AsyncTransport(Protocol):
    """What :class:`~kvstore.AsyncKVStoreClient` needs of the wire: ``call``, awaited."""

    async def acall(
        self,
        method: str,
        request: Any,
        timeout: float,
        each: Callable[[Any], None] | None = None,
    ) -> Any:
        """Make the RPC ``method`` within ``timeout`` seconds (see the module docstring)."""
        ...

    def when_reconnected(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once, on the running event loop, when the server answers again."""
        ...

    async def aclose(self) -> None:
        """Release the connection."""
        ...


class GrpcTransport:
    """:class:`Transport` over a blocking gRPC channel to ``target`` (thread-safe)."""

    def __init__(self, target: str, security: ChannelSecurity) -> None:
        #: The channel; the UCX path makes its control calls on it too.
        self.channel = blocking_channel(target, security)
        self._stub = pb_grpc.KVStoreStub(self.channel)
        self._watches: list[ReconnectWatch] = []

    def call(
        self,
        method: str,
        request: Any,
        timeout: float,
        each: Callable[[Any], None] | None = None,
    ) -> Any:
        """``stub.<method>(request, timeout=timeout)``; a stream's messages to ``each``."""
        rpc = getattr(self._stub, method)
        if each is None:
            return rpc(request, timeout=timeout)
        for message in rpc(request, timeout=timeout):
            each(message)
        return None

    def when_reconnected(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once, from another thread, when the channel connects afresh after a
        loss (see :class:`~kvstore.client.channel.ReconnectWatch`)."""
        now = time.monotonic()
        # Ended watches are kept only as long as close() may have to wait for them.
        self._watches = [
            w
            for w in self._watches
            if w.ended_at is None or now - w.ended_at < ReconnectWatch.SETTLE_S
        ]
        self._watches.append(when_reconnected(self.channel, callback))

    def close(self) -> None:
        """Stop the reconnect watches, then close the channel."""
        settle_watches(self._watches, self.channel)
        self.channel.close()


class AsyncGrpcTransport:
    """:class:`AsyncTransport` over a ``grpc.aio`` channel to ``target``.

    The UCX path's control calls block (in a worker thread), so they get a blocking channel of
    their own, :meth:`control_channel`, opened only if the server offers UCX.
    """

    def __init__(self, target: str, security: ChannelSecurity) -> None:
        self._target = target
        self._security = security
        self._channel = aio_channel(target, security)
        self._stub = pb_grpc.KVStoreStub(self._channel)
        self._control: grpc.Channel | None = None
        self._watches: set[asyncio.Task[None]] = set()

    def control_channel(self) -> grpc.Channel:
        """A blocking channel to the same server, opened on first use."""
        if self._control is None:
            self._control = blocking_channel(self._target, self._security)
        return self._control

    async def acall(
        self,
        method: str,
        request: Any,
        timeout: float,
        each: Callable[[Any], None] | None = None,
    ) -> Any:
        """``await stub.<method>(request, timeout=timeout)``; a stream's messages to ``each``."""
        rpc = getattr(self._stub, method)
        if each is None:
            return await rpc(request, timeout=timeout)
        async for message in rpc(request, timeout=timeout):
            each(message)
        return None

    def when_reconnected(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once, on the running event loop (call this from it), when the
        channel connects afresh after a loss (:func:`~kvstore.client.channel.await_reconnect`)."""
        watch = asyncio.get_running_loop().create_task(await_reconnect(self._channel, callback))
        self._watches.add(watch)  # held: the loop keeps only a weak reference to a task
        watch.add_done_callback(self._watches.discard)

    async def aclose(self) -> None:
        """Stop the reconnect watches (their callbacks are not called), close both channels."""
        for watch in list(self._watches):
            watch.cancel()
        if self._control is not None:
            self._control.close()
        await self._channel.close(grace=None)
