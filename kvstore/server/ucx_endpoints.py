"""The UCX listener of the server's data path and its client endpoints: what
:class:`~kvstore.server.ucx.UcxDataServer` (the gets and puts) moves payloads over.

Everything here runs on the server's one asyncio event loop (the grpc.aio loop), the only thread
allowed to touch the store. ucxx binds its context to that loop the first time it is used, so a
process serves UCX from one loop only.

A client's life: it connects to the listener and sends its client id; :meth:`UcxEndpoints._accept`
registers the endpoint under that id and answers one byte. A client may open several endpoints
(lanes, at most ``ucx.max_lanes`` per transfer). From then on ``UcxGet`` and ``UcxPut`` name the
ids, and the payloads of a call move over those endpoints as the messages of its plan
(:mod:`kvstore.protocol.ucx_plan`), tagged by (transfer id, message). Every transfer is bounded
by the call's gRPC deadline (capped by ``transfer_timeout_s``); a lane that fails or runs late is
dropped, which cancels whatever else it had in flight, and the client reconnects it later.

Bytes in flight are bounded per endpoint (``ucx.connection_bytes_in_flight``) and per tenant
(``ucx.tenant_bytes_in_flight``, :class:`InflightLimits`): a transfer waits, within its deadline,
until it fits (one alone always does), then fails over to gRPC.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import grpc
import numpy as np

from kvstore.errors import InvalidRequestError, PermissionDeniedError
from kvstore.protocol.ucx import (
    CLIENT_ID_BYTES,
    HELLO_TAG,
    UcxTransportError,
    load_ucxx,
    parse_address,
)
from kvstore.protocol.ucx_wire import move_messages

__all__ = ["ClientEndpoint", "InflightLimits", "UcxEndpoints"]

logger = logging.getLogger(__name__)

#: How long a new endpoint may take to say who it is.
HELLO_TIMEOUT_S = 5.0


@dataclass
class ClientEndpoint:
    """A registered client endpoint; ``owner``: the tenant whose control call first used it."""

    endpoint: Any  # ucxx Endpoint
    client_id: bytes
    owner: str | None = None
    #: Its :class:`~kvstore.server.ucx_control.ControlBinding` once ``UcxBind`` bound it.
    control: Any = None


class InflightLimits:
    """Bytes of UCX transfers in flight, per client endpoint and per tenant (loop thread only).

    A transfer is admitted once each of its lanes and its tenant has room for it, or holds
    nothing (so one transfer larger than a limit still moves, alone); it waits for that within
    its deadline.
    """

    def __init__(self, connection_bytes: int, tenant_bytes: int) -> None:
        self.connection_bytes = connection_bytes
        self.tenant_bytes = tenant_bytes
        self.by_client: defaultdict[bytes, int] = defaultdict(int)
        self.by_tenant: defaultdict[str, int] = defaultdict(int)
        self._changed = asyncio.Event()

    def _fits(self, owner: str, clients: Sequence[ClientEndpoint], loads: Sequence[int]) -> bool:
        for client, load in zip(clients, loads, strict=True):
            held = self.by_client[client.client_id]
            if held and held + load > self.connection_bytes:
                return False
        held = self.by_tenant[owner]
        return not held or held + sum(loads) <= self.tenant_bytes

    async def admit(
        self,
        owner: str,
        clients: Sequence[ClientEndpoint],
        loads: Sequence[int],
        timeout: float,
    ) -> None:
        """Charge ``loads[i]`` bytes to ``clients[i]`` and their sum to ``owner`` once they fit;
        :class:`UcxTransportError` if they do not within ``timeout``."""
        deadline = time.monotonic() + timeout
        while not self._fits(owner, clients, loads):
            left = deadline - time.monotonic()
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), max(left, 0.0))
            except TimeoutError:
                raise UcxTransportError(
                    "too many UCX bytes in flight for this endpoint or tenant "
                    "(ucx.connection_bytes_in_flight, ucx.tenant_bytes_in_flight)"
                ) from None
        for client, load in zip(clients, loads, strict=True):
            self.by_client[client.client_id] += load
        self.by_tenant[owner] += sum(loads)

    def release(self, owner: str, clients: Sequence[ClientEndpoint], loads: Sequence[int]) -> None:
        """Give back what :meth:`admit` charged."""
        for client, load in zip(clients, loads, strict=True):
            self.by_client[client.client_id] -= load
            if not self.by_client[client.client_id]:
                del self.by_client[client.client_id]
        self.by_tenant[owner] -= sum(loads)
        if not self.by_tenant[owner]:
            del self.by_tenant[owner]
        self._changed.set()


class UcxEndpoints:
    """The UCX listener, the client endpoints it registered and the transfers over them."""

    def __init__(
        self,
        listen: str = "0.0.0.0:0",
        *,
        transfer_timeout_s: float = 30.0,
        max_lanes: int = 8,
        connection_bytes: int = 256 * 1024**2,
        tenant_bytes: int = 1024**3,
    ) -> None:
        self._host, self._port = parse_address(listen)
        self.transfer_timeout_s = transfer_timeout_s
        self.max_lanes = max_lanes
        self.inflight = InflightLimits(connection_bytes, tenant_bytes)
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

    def _lanes(self, client_id: bytes, lanes: Sequence[bytes], owner: str) -> list[ClientEndpoint]:
        """The endpoints a call names (``client_id`` first), each bound to ``owner``."""
        ids = [client_id, *lanes]
        if len(ids) > self.max_lanes:
            raise InvalidRequestError(
                f"{len(ids)} UCX lanes in one transfer; ucx.max_lanes allows {self.max_lanes}"
            )
        if len(set(ids)) != len(ids):
            raise InvalidRequestError("a UCX lane is named twice in one transfer")
        return [self._client(one, owner) for one in ids]

    def _deadline_of(self, context: grpc.aio.ServicerContext[Any, Any]) -> float:
        """The ``time.monotonic()`` deadline of a gRPC call (``transfer_timeout_s`` from now at
        most)."""
        remaining = context.time_remaining()
        timeout = (
            self.transfer_timeout_s
            if remaining is None
            else min(remaining, self.transfer_timeout_s)
        )
        return time.monotonic() + timeout

    def _left(self, deadline: float) -> float:
        """Seconds a transfer may still take (0 once ``deadline`` passed)."""
        return max(0.0, min(deadline - time.monotonic(), self.transfer_timeout_s))

    # -- transfers -------------------------------------------------------------------------

    async def _transfer(
        self,
        clients: Sequence[ClientEndpoint],
        op: Literal["send", "recv"],
        transfer_id: int,
        views: Sequence[Any],
        lane_of: Sequence[int],
        timeout: float,
    ) -> bool:
        """Move a plan's messages over the lanes within ``timeout``; False if a lane failed (it
        is dropped: its operations end, the other lanes' complete)."""
        started = time.monotonic()
        endpoints = [client.endpoint for client in clients]
        try:
            failed = await move_messages(op, endpoints, transfer_id, views, lane_of, timeout)
        except asyncio.CancelledError:
            # The gRPC call was cancelled (client gone or deadline): its transfer is abandoned.
            for client in clients:
                self._drop(client, f"{op} cancelled")
            raise
        for lane, exc in failed.items():
            self.counters["transfer_failures"] += 1
            self._drop(
                clients[lane],
                f"{op} failed after {time.monotonic() - started:.2f}s: {type(exc).__name__}: {exc}",
            )
        return not failed

    def _spawn(self, coroutine: Awaitable[None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task
