"""The UCX listener of the server's data path and its client endpoints: what
:class:`~kvstore.server.ucx.UcxDataServer` (the gets and puts) moves payloads over.

Everything here runs on the server's one asyncio event loop (the grpc.aio loop), the only thread
allowed to touch the store. ucxx binds its context to that loop the first time it is used, so a
process serves UCX from one loop only.

A client's life: it connects to the listener and sends its client id; :meth:`UcxEndpoints._accept`
registers the endpoint under that id and answers one byte. From then on ``UcxGet`` and ``UcxPut``
name the id, and the payloads of a call move over that endpoint, tagged by (transfer id, index).
Every transfer is bounded by the call's gRPC deadline (capped by ``transfer_timeout_s``); a transfer
that fails or runs late drops the client's endpoint, which cancels whatever else it had in flight,
and the client reconnects on its next call.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from kvstore.errors import PermissionDeniedError
from kvstore.protocol.ucx import (
    CLIENT_ID_BYTES,
    HELLO_TAG,
    UcxTransportError,
    load_ucxx,
    parse_address,
)

__all__ = ["ClientEndpoint", "UcxEndpoints"]

logger = logging.getLogger(__name__)

#: How long a new endpoint may take to say who it is.
HELLO_TIMEOUT_S = 5.0


@dataclass
class ClientEndpoint:
    """A registered client endpoint; ``owner``: the tenant whose control call first used it."""

    endpoint: Any  # ucxx Endpoint
    client_id: bytes
    owner: str | None = None


class UcxEndpoints:
    """The UCX listener, the client endpoints it registered and the transfers over them."""

    def __init__(self, listen: str = "0.0.0.0:0", *, transfer_timeout_s: float = 30.0) -> None:
        self._host, self._port = parse_address(listen)
        self.transfer_timeout_s = transfer_timeout_s
        self._listener: Any = None
        self._clients: dict[bytes, ClientEndpoint] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        #: Counters for logs and tests: transfers, blocks and bytes each way, failures.
        self.counters: Counter[str] = Counter()
        #: ``HOST:PORT`` clients connect to; set by :meth:`start`.
        self.address = ""

    async def start(self) -> None:
        """Start listening (port 0 picks a free one); ``UcxTransportError`` if ucxx is unusable."""
        ucxx = load_ucxx()
        self._loop = asyncio.get_running_loop()
        try:
            self._listener = ucxx.create_listener(
                self._accept, port=self._port, endpoint_error_handling=True
            )
        except Exception as exc:
            raise UcxTransportError(f"cannot listen for UCX on port {self._port}: {exc}") from exc
        host = self._host
        if host in ("", "0.0.0.0", "::"):
            # The listener takes every interface; advertise one a remote client can reach.
            host = ucxx.get_address()
        else:
            # ucxx's listener takes a port, no address: asking for one interface (say loopback)
            # does not keep other hosts out, and an operator must not believe it does.
            logger.warning(
                "the UCX listener on port %d takes every interface (ucxx cannot bind one "
                "address); %s is only the address advertised to clients: firewall the port "
                "where other hosts must not reach it",
                self._listener.port,
                host,
            )
        self.address = f"{host}:{self._listener.port}"
        logger.info("UCX data path listening on %s", self.address)

    async def close(self) -> None:
        """Stop listening, drop every client endpoint and cancel transfers still in flight."""
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for client in list(self._clients.values()):
            self._drop(client, "server closing")
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    # -- endpoints -------------------------------------------------------------------------

    async def _accept(self, endpoint: Any) -> None:
        """Listener callback: read the client's id, register its endpoint, answer one byte."""
        client_id = bytearray(CLIENT_ID_BYTES)
        try:
            await asyncio.wait_for(endpoint.recv(client_id, tag=HELLO_TAG), HELLO_TIMEOUT_S)
        except Exception as exc:
            logger.warning("UCX client did not introduce itself: %s", exc)
            endpoint.abort()
            return
        client = ClientEndpoint(endpoint, bytes(client_id))
        old = self._clients.pop(client.client_id, None)
        if old is not None:
            self._drop(old, "replaced by a new connection")
        self._clients[client.client_id] = client
        loop = self._loop
        assert loop is not None
        # UCX calls this from its progress thread when the peer goes away.
        endpoint.set_close_callback(lambda: loop.call_soon_threadsafe(self._forget, client))
        try:
            await asyncio.wait_for(
                endpoint.send(np.ones(1, dtype=np.uint8), tag=HELLO_TAG), HELLO_TIMEOUT_S
            )
        except Exception as exc:
            self._drop(client, f"hello answer failed: {exc}")
            return
        self.counters["clients_connected"] += 1
        logger.debug("UCX client %s connected", client.client_id.hex())

    def _forget(self, client: ClientEndpoint) -> None:
        if self._clients.get(client.client_id) is client:
            del self._clients[client.client_id]

    def _drop(self, client: ClientEndpoint, reason: str) -> None:
        """Abort a client's endpoint: its transfers in flight fail, it must reconnect."""
        self._forget(client)
        self.counters["clients_dropped"] += 1
        logger.info("dropping UCX client %s: %s", client.client_id.hex(), reason)
        try:
            client.endpoint.abort()
        except Exception:  # already closed by the peer's failure
            logger.debug("abort of a UCX endpoint failed", exc_info=True)

    def _client(self, client_id: bytes, owner: str) -> ClientEndpoint:
        """The endpoint ``client_id`` names, bound to ``owner`` by the first call that uses it.

        The endpoint's hello carries no credentials; the authenticated control call does. Binding
        the endpoint to the first caller's tenant means another tenant that learnt the id can
        neither receive this endpoint's blocks nor push blocks through it.
        """
        client = self._clients.get(client_id)
        if client is None:
            raise UcxTransportError("unknown UCX client id; reconnect")
        if client.owner is None:
            client.owner = owner
        elif client.owner != owner:
            raise PermissionDeniedError(
                "this UCX client id belongs to another caller; connect an endpoint of your own"
            )
        return client

    def _timeout(self, context: grpc.aio.ServicerContext[Any, Any]) -> float:
        remaining = context.time_remaining()
        return (
            self.transfer_timeout_s
            if remaining is None
            else min(remaining, self.transfer_timeout_s)
        )

    # -- transfers -------------------------------------------------------------------------

    async def _transfer(
        self, client: ClientEndpoint, operations: list[Awaitable[Any]], timeout: float, what: str
    ) -> bool:
        """Run a batch of sends or receives within ``timeout``; on failure drop the client."""
        started = time.monotonic()
        try:
            await asyncio.wait_for(asyncio.gather(*operations), timeout)
        except asyncio.CancelledError:
            # The gRPC call was cancelled (client gone or deadline): its transfer is abandoned.
            self._drop(client, f"{what} cancelled")
            raise
        except Exception as exc:
            self.counters["transfer_failures"] += 1
            self._drop(
                client,
                f"{what} failed after {time.monotonic() - started:.2f}s: "
                f"{type(exc).__name__}: {exc}",
            )
            return False
        return True

    def _spawn(self, coroutine: Awaitable[None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task
