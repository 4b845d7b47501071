"""The client side of the UCX data path, for the blocking :class:`kvstore.KVStoreClient`.

ucxx's API is asyncio-based and binds its process-wide context to the first event loop that uses
it, so every UCX operation of this process runs on one daemon thread with its own loop
(:class:`_LoopThread`); the caller's thread makes the gRPC control calls itself (on the client's
existing channel) and waits for the UCX side with a deadline.

Each :class:`UcxDataClient` method returns ``None`` when the bytes could not move over UCX (ucxx
missing, no connection, a failed or late transfer, a server without the service): the caller then
uses the gRPC path for that call. After such a failure the client leaves UCX alone for
``retry_after_s`` seconds. Request errors (bad keys, namespace mismatch, capacity) raise
:class:`~kvstore.errors.KVStoreError` exactly as the gRPC path does.

A receive that fails or runs late aborts the endpoint before the method returns, which cancels
the receives still posted: no late UCX write can land in a caller's buffer after the fallback has
filled it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import numpy as np

from kvstore._proto.kvstore.v1 import ucx_pb2 as ucx_pb
from kvstore._proto.kvstore.v1 import ucx_pb2_grpc as ucx_pb_grpc
from kvstore.buffers import byte_view, writable_byte_view
from kvstore.client.device_fill import device_transports_in, is_device_tensor
from kvstore.protocol import messages as _wire
from kvstore.protocol.checks import check_pairs
from kvstore.protocol.ucx import (
    CLIENT_ID_BYTES,
    HELLO_TAG,
    UcxTransportError,
    endpoint_error,
    load_ucxx,
    parse_address,
    transfer_tag,
    verify_payloads,
)
from kvstore.types import PutResult

__all__ = ["UcxDataClient", "abort_endpoint", "open_endpoint", "receive_payloads"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: gRPC codes that mean "the UCX path failed", not "the request was bad": fall back to gRPC.
_TRANSPORT_CODES = {grpc.StatusCode.ABORTED, grpc.StatusCode.UNIMPLEMENTED}
#: Extra time the caller's thread waits for the UCX loop beyond a coroutine's own deadline.
_LOOP_GRACE_S = 2.0
#: The share of a call's remaining time a new connection may take: a listener that vanished can
#: stall the handshake (no refusal comes), and the call's gRPC fallback needs the rest.
CONNECT_SHARE = 0.5
#: How long aborting an endpoint may block (nanoseconds, ucxx's unit).
_ABORT_PERIOD_NS = 1_000_000_000


class _LoopThread:
    """The process's one event loop for ucxx, running in a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="kvstore-ucx", daemon=True
        )
        self._thread.start()

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coroutine`` on the loop."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run ``coroutine`` on the loop and wait for it, at most ``timeout`` seconds (+ grace)."""
        future = self.submit(coroutine)
        try:
            return future.result(max(timeout, 0.0) + _LOOP_GRACE_S)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise UcxTransportError("the UCX event loop did not answer in time") from None


_loop_thread: _LoopThread | None = None
_loop_lock = threading.Lock()


def _shared_loop() -> _LoopThread:
    global _loop_thread
    with _loop_lock:
        if _loop_thread is None:
            _loop_thread = _LoopThread()
        return _loop_thread


@dataclass
class _Connection:
    endpoint: Any  # ucxx Endpoint
    client_id: bytes


class UcxDataClient:
    """Moves the payloads of ``get_into`` / ``get`` / ``put`` over UCX to one server.

    ``channel`` is the gRPC channel of the server (the control calls use it), ``ucx_address`` its
    ``DataPlane().ucx_address``, ``namespace`` the 16-byte namespace fingerprint. Thread-safe.
    """

    def __init__(
        self,
        channel: grpc.Channel,
        ucx_address: str,
        namespace: bytes | None,
        *,
        timeout: float = 5.0,
        connect_timeout_s: float = 5.0,
        retry_after_s: float = 30.0,
    ) -> None:
        self._stub = ucx_pb_grpc.UcxTransferStub(channel)
        self.address = ucx_address
        self._host, self._port = parse_address(ucx_address)
        self._namespace = namespace
        self.timeout = timeout
        self.connect_timeout_s = connect_timeout_s
        self.retry_after_s = retry_after_s
        self._lock = threading.Lock()
        self._connection: _Connection | None = None
        self._transfer_ids = itertools.count(1)  # 0 is never used: HELLO_TAG is tag (0, 1)
        self._retry_at = 0.0
        self._closed = False
        self._device_transports: tuple[str, ...] | None = None
        #: ``transfers``, ``fallbacks``, ``connects``: for logs, tests and benchmarks.
        self.counters: Counter[str] = Counter()
        #: Why the last fallback happened ("" if none yet).
        self.last_error = ""

    @property
    def usable(self) -> bool:
        """False once closed, and for ``retry_after_s`` seconds after a UCX failure."""
        return not self._closed and time.monotonic() >= self._retry_at

    # -- public calls ----------------------------------------------------------------------

    def get_into(
        self, keys: Sequence[bytes], buffers: Sequence[Any], *, timeout: float | None = None
    ) -> list[bool] | None:
        """Receive each found payload straight into its buffer; False where missing or the size
        differs. ``None``: UCX could not be used, read over gRPC instead."""
        check_pairs(keys, buffers, "buffers")
        # Device memory (flat uint8 tensors, see kvstore.client.device_fill) goes to ucxx as is.
        views = [b if is_device_tensor(b) else writable_byte_view(b) for b in buffers]
        sizes = [int(b.nbytes) for b in views]
        response = self._call_get(keys, sizes, views, timeout)
        return None if response is None else list(response.sent)

    def device_transports(self) -> tuple[str, ...]:
        """The transports of this process's UCX context that reach device memory (none without
        a GPU and its driver); asked once."""
        if self._device_transports is None:

            async def describe() -> str:
                return str(load_ucxx().get_ucp_context_info())

            try:
                info = self._loop().run(describe(), self.connect_timeout_s)
            except Exception as exc:  # no ucxx, or a context that cannot start: host paths only
                logger.debug("UCX context description unavailable: %s", exc)
                info = ""
            self._device_transports = device_transports_in(info)
        return self._device_transports

    def get(
        self, keys: Sequence[bytes], *, timeout: float | None = None
    ) -> list[bytes | None] | None:
        """The payload of each key (``None`` where missing); ``None`` if UCX could not be used."""
        response = self._call_get(keys, [], None, timeout)
        if response is None:
            return None
        values: list[bytes | None] = [None] * len(keys)
        for index, buffer in response.buffers.items():
            values[index] = buffer.tobytes()
        return values

    def put(
        self, keys: Sequence[bytes], values: Sequence[Any], *, timeout: float | None = None
    ) -> PutResult | None:
        """Store ``values`` under ``keys``; ``None`` if UCX could not be used (put over gRPC)."""
        check_pairs(keys, values, "values")
        views = [byte_view(value) for value in values]
        deadline = self._deadline(timeout)
        try:
            return self._try_put(keys, views, deadline, retried=False)
        except _Reconnect:
            return self._try_put(keys, views, deadline, retried=True)

    def close(self) -> None:
        """Close the endpoint; later calls return ``None``."""
        self._closed = True
        with self._lock:
            connection, self._connection = self._connection, None
        if connection is not None:
            self._abort(connection)

    # -- get -------------------------------------------------------------------------------

    def _call_get(
        self,
        keys: Sequence[bytes],
        sizes: list[int],
        views: list[Any] | None,
        timeout: float | None,
    ) -> _GetOutcome | None:
        if not self.usable:
            return None
        deadline = self._deadline(timeout)
        try:
            return self._try_get(keys, sizes, views, deadline, retried=False)
        except _Reconnect:
            return self._try_get(keys, sizes, views, deadline, retried=True)

    def _try_get(
        self,
        keys: Sequence[bytes],
        sizes: list[int],
        views: list[Any] | None,
        deadline: float,
        retried: bool,
    ) -> _GetOutcome | None:
        connection = None
        try:
            connection = self._connect(deadline)
            transfer_id = next(self._transfer_ids)
            request = ucx_pb.UcxGetRequest(
                namespace=_wire.namespace_bytes(self._namespace),
                keys=list(keys),
                client_id=connection.client_id,
                transfer_id=transfer_id,
                sizes=sizes,
            )
            response = self._control(self._stub.UcxGet, request, deadline, retried, connection)
            if len(response.lengths) != len(keys) or len(response.sent) != len(keys):
                raise UcxTransportError("malformed UcxGet answer")
            buffers: dict[int, Any] = {}
            for index, sent in enumerate(response.sent):
                if sent:
                    buffers[index] = (
                        views[index]
                        if views is not None
                        else np.empty(response.lengths[index], dtype=np.uint8)
                    )
            if buffers:
                self._loop().run(
                    receive_payloads(
                        connection.endpoint, transfer_id, buffers, _remaining(deadline)
                    ),
                    _remaining(deadline),
                )
                # Device memory cannot be hashed here; what the host received is checked.
                host = {i: b for i, b in buffers.items() if not is_device_tensor(b)}
                verify_payloads(host, response.checksums)
            self.counters["transfers"] += 1
            return _GetOutcome(list(response.sent), buffers)
        except UcxTransportError as exc:
            self._fail(exc, connection)
            return None

    # -- put -------------------------------------------------------------------------------

    def _try_put(
        self, keys: Sequence[bytes], views: list[memoryview], deadline: float, retried: bool
    ) -> PutResult | None:
        if not self.usable:
            return None
        connection = None
        sending: concurrent.futures.Future[None] | None = None
        try:
            connection = self._connect(deadline)
            transfer_id = next(self._transfer_ids)
            request = ucx_pb.UcxPutRequest(
                namespace=_wire.namespace_bytes(self._namespace),
                keys=list(keys),
                lengths=[len(view) for view in views],
                client_id=connection.client_id,
                transfer_id=transfer_id,
            )
            # Send at once: UCX holds the payloads until the server posts its receives, so the
            # whole put is one control round trip.
            sending = self._loop().submit(
                _send(connection.endpoint, transfer_id, views, _remaining(deadline))
            )
            try:
                response = self._control(self._stub.UcxPut, request, deadline, retried, connection)
            except BaseException:
                self._settle(sending, connection)
                raise
            # The server answered after receiving every byte; the sends are (all but) done.
            try:
                sending.result(_remaining(deadline) + _LOOP_GRACE_S)
            except Exception as exc:
                raise endpoint_error(exc) from exc
            self.counters["transfers"] += 1
            return _wire.put_result(response)
        except UcxTransportError as exc:
            self._fail(exc, connection)
            return None

    def _settle(self, sending: concurrent.futures.Future[None], connection: _Connection) -> None:
        """After a refused put: wait briefly for the sends, else drop the endpoint under them."""
        try:
            sending.result(1.0)
        except Exception:
            self._drop(connection)

    # -- control calls ---------------------------------------------------------------------

    def _control(
        self,
        method: Any,
        request: Any,
        deadline: float,
        retried: bool,
        connection: _Connection,
    ) -> Any:
        """Make a control call; transport failures raise UcxTransportError, request errors their
        KVStoreError, and :class:`_Reconnect` means the server forgot this client (it restarted)."""
        try:
            return method(request, timeout=_remaining(deadline))
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
            details = exc.details() if hasattr(exc, "details") else str(exc)
            if code == grpc.StatusCode.ABORTED and "unknown UCX client" in (details or ""):
                self._drop(connection)
                if not retried:
                    raise _Reconnect from exc
            if code in _TRANSPORT_CODES or code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise UcxTransportError(f"UCX control call failed: {code.name}: {details}") from exc
            raise _wire.map_rpc_error(exc) from exc

    # -- connection ------------------------------------------------------------------------

    def _loop(self) -> _LoopThread:
        return _shared_loop()

    def _deadline(self, timeout: float | None) -> float:
        return time.monotonic() + (self.timeout if timeout is None else timeout)

    def _connect(self, deadline: float) -> _Connection:
        """The open connection, or a new one (endpoint + hello) made within the deadline."""
        with self._lock:
            connection = self._connection
            if connection is not None and not connection.endpoint.closed:
                return connection
            load_ucxx()
            client_id = os.urandom(CLIENT_ID_BYTES)
            timeout = min(self.connect_timeout_s, _remaining(deadline) * CONNECT_SHARE)
            endpoint = self._loop().run(
                open_endpoint(self._host, self._port, client_id, timeout), timeout
            )
            self._connection = _Connection(endpoint, client_id)
            self.counters["connects"] += 1
            return self._connection

    def _drop(self, connection: _Connection | None) -> None:
        """Forget and abort ``connection`` (the next call reconnects)."""
        if connection is None:
            return
        with self._lock:
            if self._connection is connection:
                self._connection = None
        self._abort(connection)

    def _abort(self, connection: _Connection) -> None:
        try:
            self._loop().run(abort_endpoint(connection.endpoint), 2.0)
        except Exception:
            logger.debug("aborting a UCX endpoint failed", exc_info=True)

    def _fail(self, exc: UcxTransportError, connection: _Connection | None) -> None:
        """Fall back for this call and leave UCX alone for ``retry_after_s`` seconds."""
        self._drop(connection)
        self._retry_at = time.monotonic() + self.retry_after_s
        self.counters["fallbacks"] += 1
        self.last_error = str(exc)
        logger.warning(
            "UCX data path to %s failed (%s); using gRPC for %.0fs",
            self.address,
            exc,
            self.retry_after_s,
        )


@dataclass
class _GetOutcome:
    sent: list[bool]
    buffers: dict[int, Any]


class _Reconnect(Exception):
    """The server does not know this client (it restarted): make the call again, reconnected."""


def _remaining(deadline: float) -> float:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise UcxTransportError("deadline passed before the UCX transfer finished")
    return remaining


# -- coroutines run on the UCX loop -----------------------------------------------------------


async def open_endpoint(host: str, port: int, client_id: bytes, timeout: float) -> Any:
    """Connect to the listener and introduce ourselves; the endpoint, once the server knows us."""
    ucxx = load_ucxx()
    endpoint = None
    try:
        endpoint = await asyncio.wait_for(
            ucxx.create_endpoint(host, port, endpoint_error_handling=True, connect_timeout=timeout),
            timeout,
        )
        # A refused connection only shows as the endpoint closing; without watching for that,
        # the hello would wait out the whole timeout before the caller can fall back.
        hello = asyncio.ensure_future(_hello(endpoint, client_id))
        watch = asyncio.ensure_future(_until_closed(endpoint))
        done, pending = await asyncio.wait(
            {hello, watch}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
        for task in pending:
            task.cancel()
        if hello in done:
            hello.result()
        elif watch in done:
            watch.result()
        else:
            raise TimeoutError(f"no answer within {timeout:.1f}s")
    except Exception as exc:
        if endpoint is not None:
            await abort_endpoint(endpoint)
        raise UcxTransportError(f"cannot connect to UCX listener {host}:{port}: {exc}") from exc
    return endpoint


async def _hello(endpoint: Any, client_id: bytes) -> None:
    """Say who we are and wait for the listener's one-byte welcome."""
    await endpoint.send(bytearray(client_id), tag=HELLO_TAG)
    answer = np.empty(1, dtype=np.uint8)
    await endpoint.recv(answer, tag=HELLO_TAG)


async def _until_closed(endpoint: Any, poll_s: float = 0.005) -> None:
    """Raise once ``endpoint`` closes (refused or reset); runs until cancelled otherwise."""
    while not endpoint.closed:
        await asyncio.sleep(poll_s)
    raise ConnectionRefusedError("the UCX endpoint closed before the listener answered")


async def receive_payloads(
    endpoint: Any, transfer_id: int, buffers: dict[int, Any], timeout: float
) -> None:
    """Receive one transfer's payloads; on failure abort the endpoint, cancelling the rest."""
    receives = [
        endpoint.recv(buffer, tag=transfer_tag(transfer_id, index))
        for index, buffer in buffers.items()
    ]
    try:
        await asyncio.wait_for(asyncio.gather(*receives), timeout)
    except Exception as exc:
        # Before the caller falls back: no posted receive may write into its buffers later.
        await abort_endpoint(endpoint)
        raise endpoint_error(exc) from exc


async def _send(endpoint: Any, transfer_id: int, views: list[memoryview], timeout: float) -> None:
    """Send one transfer's payloads."""
    sends = [
        endpoint.send(view, tag=transfer_tag(transfer_id, index))
        for index, view in enumerate(views)
    ]
    try:
        await asyncio.wait_for(asyncio.gather(*sends), timeout)
    except Exception as exc:
        await abort_endpoint(endpoint)
        raise endpoint_error(exc) from exc


async def abort_endpoint(endpoint: Any) -> None:
    """Close ``endpoint`` at once; UCX cancels its outstanding requests."""
    if not endpoint.closed:
        endpoint.abort(period=_ABORT_PERIOD_NS)
