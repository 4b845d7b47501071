"""A blocking client's control calls: over UCX itself where the server binds its lanes, else the
``UcxGet`` / ``UcxPut`` gRPC calls (:mod:`kvstore.protocol.ucx_control` says how and why).

:class:`ControlPath` binds new lanes with one ``UcxBind`` gRPC call (authenticated as every call
of the client's channel), then sends each request over the call's first lane and waits for the
answer there: one UCX round trip instead of a gRPC one (only with ``KVSTORE_UCX_CONTROL=1``:
on 2 shared cores over TCP the gRPC call measured faster; the bind is made either way). A server
without ``UcxBind`` (the previous release) answers UNIMPLEMENTED, and this client keeps the gRPC
calls and that release's framing for good; a bind that fails otherwise leaves those lanes on
gRPC. An answer that does not verify, a refused message, or one
that is late, is a transport failure (the call falls back to gRPC); request errors raise the
:class:`~kvstore.errors.KVStoreError` the gRPC call would.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore._proto.kvstore.v1 import ucx_pb2 as ucx_pb
from kvstore._proto.kvstore.v1 import ucx_pb2_grpc as ucx_pb_grpc
from kvstore.client.ucx_lanes import Lane
from kvstore.errors import error_from_status
from kvstore.formats import UCX_CONTROL
from kvstore.protocol import ucx_control as ctl
from kvstore.protocol.ucx import UcxTransportError
from kvstore.protocol.ucx_wire import LoopThread, wait_for_loop

__all__ = ["MAX_CONTROL_KEYS", "ControlPath", "Forgotten", "Prepared"]

logger = logging.getLogger(__name__)

#: Batches of more keys make their control call over gRPC (their answer may not fit a message).
MAX_CONTROL_KEYS = 2048
#: Room for an answer: a header, and per key its length, flag, tier, checksum and messages.
_ANSWER_BASE, _ANSWER_PER_KEY = 4096, 256
#: gRPC codes that mean "the UCX path failed", not "the request was bad": fall back to gRPC.
_TRANSPORT_CODES = {
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}
#: The details prefix of a refused control message (:mod:`kvstore.server.ucx_control`).
_REFUSED = "UCX control message refused"


class Forgotten(UcxTransportError):
    """The server does not know the lanes a call named (it restarted): new lanes, once."""


@dataclass
class Prepared:
    """A control exchange not yet started (:meth:`ControlPath.prepare`)."""

    key: bytes
    answer: Any
    exchange: Coroutine[Any, Any, int]


class ControlPath:
    """The control calls of one :class:`~kvstore.client.ucx.UcxDataClient` (thread-safe)."""

    def __init__(
        self,
        channel: grpc.Channel,
        loop: Callable[[], LoopThread],
        counters: Counter[str],
        *,
        over_ucx: bool = True,
    ) -> None:
        self._stub = ucx_pb_grpc.UcxTransferStub(channel)
        self._loop = loop
        #: ``control_ucx`` / ``control_grpc``: control calls made each way.
        self.counters = counters
        #: The server predates ``UcxBind`` (the previous release): it knows no message plans
        #: nor lanes, and tags each block's message by its key's index.
        self.legacy = False
        #: Largest control message the server receives (its ``UcxBind`` answer says).
        self.max_bytes = ctl.MAX_CONTROL_BYTES
        #: Whether requests go over UCX where lanes are bound (``KVSTORE_UCX_CONTROL``).
        self.over_ucx = over_ucx

    def bind(self, lanes: list[Lane], timeout: float) -> None:
        """Bind the lanes not tried yet (one ``UcxBind``); failures leave them on gRPC. Made with
        control messages off too: it tells a server of the previous release (UNIMPLEMENTED),
        whose framing differs (:attr:`legacy`)."""
        new = [lane for lane in lanes if not lane.bind_tried]
        if self.legacy or not new:
            return
        for lane in new:
            lane.bind_tried = True
        request = ucx_pb.UcxBindRequest(
            client_ids=[lane.client_id for lane in new], versions=list(UCX_CONTROL.reads)
        )
        try:
            response = self._stub.UcxBind(request, timeout=timeout)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:  # an older server: gRPC for good
                self.legacy = True
            logger.debug("UcxBind failed (%s): control calls over gRPC", exc.code())
            return
        if response.version not in UCX_CONTROL.reads or len(response.key) != ctl.KEY_BYTES:
            return  # no version both speak: these lanes stay on gRPC
        if response.max_message_bytes:
            self.max_bytes = min(ctl.MAX_CONTROL_BYTES, response.max_message_bytes)
        for lane in new:
            lane.control_key = response.key

    def prepare(
        self, kind: int, request: Any, timeout: float, lanes: list[Lane]
    ) -> Prepared | None:
        """The exchange of ``request`` over ``lanes[0]``, not started (``None``: it goes over
        gRPC); :meth:`call` runs it, or waits for it where the caller started it on the loop
        with its transfer's messages (one wake-up of the loop for both)."""
        lane = lanes[0]
        key = lane.control_key
        if not self.over_ucx or self.legacy or key is None or len(request.keys) > MAX_CONTROL_KEYS:
            return None
        body = request.SerializeToString()
        if ctl.HEADER_BYTES + len(body) > self.max_bytes:
            return None
        answer = np.empty(_ANSWER_BASE + _ANSWER_PER_KEY * len(request.keys), dtype=np.uint8)
        exchange = _exchange(lane, kind, int(request.transfer_id), body, answer, timeout)
        return Prepared(key, answer, exchange)

    def call(
        self,
        kind: int,
        request: Any,
        timeout: float,
        lanes: list[Lane],
        prepared: Prepared | None = None,
        started: concurrent.futures.Future[int] | None = None,
    ) -> Any:
        """The answer to ``request`` (``REQUEST_GET`` or ``REQUEST_PUT``), over UCX on
        ``lanes[0]`` where it is bound (``prepared``, and ``started``: its future, if the
        caller started it), else over gRPC."""
        if prepared is None:
            prepared = self.prepare(kind, request, timeout, lanes)
            if prepared is None:
                return self._grpc(kind, request, timeout, lanes)
        self.counters["control_ucx"] += 1
        try:
            if started is None:
                seq = self._loop().run(prepared.exchange, timeout)
            else:
                seq = wait_for_loop(started, timeout)
        except Exception as exc:
            # Late or failed: the lane goes (its posted answer receive with it).
            raise UcxTransportError(
                f"UCX control message over its lane failed: {type(exc).__name__}: {exc}"
            ) from exc
        key, answer = prepared.key, prepared.answer
        expected = ctl.ANSWER_GET if kind == ctl.REQUEST_GET else ctl.ANSWER_PUT
        try:
            frame = ctl.decode(key, answer, {expected, ctl.ANSWER_ERROR})
        except ctl.ControlError as exc:
            raise UcxTransportError(f"UCX control answer refused: {exc}") from exc
        if frame.seq != seq or frame.transfer_id != request.transfer_id:
            raise UcxTransportError("UCX control answer to another request")
        if frame.kind == ctl.ANSWER_ERROR:
            code, details = ctl.error_of(frame)
            _raise(_status(code), details, lanes)
        if kind == ctl.REQUEST_GET:
            return ucx_pb.UcxGetResponse.FromString(frame.body)
        return pb.PutResponse.FromString(frame.body)

    def _grpc(self, kind: int, request: Any, timeout: float, lanes: list[Lane]) -> Any:
        self.counters["control_grpc"] += 1
        method = self._stub.UcxGet if kind == ctl.REQUEST_GET else self._stub.UcxPut
        try:
            return method(request, timeout=timeout)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
            details = exc.details() if hasattr(exc, "details") else str(exc)
            _raise(code, details or "", lanes, exc)


def _raise(
    code: grpc.StatusCode, details: str, lanes: list[Lane], cause: BaseException | None = None
) -> None:
    """Raise what a failed control call means: :class:`Forgotten`, a transport failure, or the
    request error of ``code`` (as :func:`~kvstore.protocol.messages.map_rpc_error`)."""
    if code == grpc.StatusCode.ABORTED and "unknown UCX client" in details:
        raise Forgotten(f"the server forgot this client's lanes: {details}") from cause
    refused = details.startswith(_REFUSED)
    if refused:
        lanes[0].control_key = None  # its key no longer holds: gRPC until a new lane binds
    if code in _TRANSPORT_CODES or refused:
        raise UcxTransportError(f"UCX control call failed: {code.name}: {details}") from cause
    raise error_from_status(code, details) from cause


def _status(value: int) -> grpc.StatusCode:
    for code in grpc.StatusCode:
        if code.value[0] == value:
            return code
    return grpc.StatusCode.UNKNOWN


async def _exchange(
    lane: Lane, kind: int, transfer_id: int, body: bytes, answer: Any, timeout: float
) -> int:
    """Post the answer's receive, send the request on ``lane``; its ``seq`` once answered."""
    endpoint, key = lane.endpoint, lane.control_key
    assert key is not None
    receiving = asyncio.ensure_future(endpoint.recv(answer, tag=ctl.answer_tag(transfer_id)))
    # Numbered and sent with no await in between: the server sees seqs rise in send order.
    lane.control_seq += 1
    seq = lane.control_seq
    frame = ctl.encode(
        key,
        kind,
        seq,
        transfer_id,
        body,
        timeout_ms=int(timeout * 1000),
        answer_bytes=int(answer.nbytes),
    )
    try:
        # A small message goes eagerly: the send ends at once (or fails: the lane is gone).
        await endpoint.send(np.frombuffer(frame, dtype=np.uint8), tag=ctl.CONTROL_TAG)
        await asyncio.wait_for(receiving, timeout)
    except BaseException:
        receiving.cancel()
        raise
    return seq
