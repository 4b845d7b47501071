"""The client side of the UCX data path, for the blocking :class:`kvstore.KVStoreClient`.

The control calls go over the first lane's UCX endpoint itself once a ``UcxBind`` call bound it
(:mod:`kvstore.client.ucx_control`), else over gRPC on the client's channel; the UCX operations run
on the process's UCX loop thread (:mod:`kvstore.protocol.ucx_wire`), over a small pool of endpoints
to the server (:mod:`kvstore.client.ucx_lanes`), and the caller waits for them with a deadline. A
batch moves as its plan's messages (:mod:`kvstore.protocol.ucx_plan`): blocks next to each other in
both sides' memory as one message, spread over the lanes, all in flight at once. The control call
overlaps the data: a put posts its sends before its control call and the server answers once every
byte is in; ``get_into`` (host buffers) posts its receives before its control call too, for its own
plan (``UcxGetRequest.messages``: its buffers one after another, those that follow each other in
memory as one message), and the server sends each planned message whole, from its pages (a copy
only where they are not contiguous there), or empty where a block in it is missing or of another
size: nothing lands in a miss's buffer, and the blocks found that shared an empty message are asked
for again without a plan. ``get`` (no buffers yet) tells the server it takes the stream in one
buffer and receives the server's plan.

Each :class:`UcxDataClient` method returns ``None`` when the bytes could not move over UCX (ucxx
missing, no connection, a failed or late transfer, a server without the service): the caller then
uses the gRPC path for that call. After such a failure the client leaves UCX alone for
``retry_after_s`` seconds. Request errors (bad keys, namespace mismatch, capacity) raise
:class:`~kvstore.errors.KVStoreError` exactly as the gRPC path does.

**A lane that dies mid-transfer** costs only its messages: its blocks are asked again over the
lanes left (once, in what is left of the deadline), and a block whose bytes are not all in and
checked is never returned: either it comes whole over another lane, or the call falls back to gRPC.
A failed lane's operations end (it is aborted) before the method returns: no late UCX write can
land in a caller's buffer after the fallback has filled it.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import grpc

from kvstore._proto.kvstore.v1 import ucx_pb2 as ucx_pb
from kvstore.buffers import byte_view, writable_byte_view
from kvstore.client.device_fill import device_transports_in, is_device_tensor
from kvstore.client.ucx_control import ControlPath, Forgotten, Prepared
from kvstore.client.ucx_lanes import LANE_BYTES, Lane, LanePool, Moving
from kvstore.client.ucx_outcome import GetOutcome, landing, settle
from kvstore.protocol import messages as _wire
from kvstore.protocol import ucx_control as ctl
from kvstore.protocol.checks import check_pairs
from kvstore.protocol.ucx import UcxTransportError, load_ucxx, parse_address
from kvstore.protocol.ucx_plan import (
    StreamLayout,
    check_plan,
    host_piece,
    plan_messages,
)
from kvstore.protocol.ucx_wire import LoopThread, shared_loop
from kvstore.types import PutResult

__all__ = ["CONNECT_SHARE", "UcxDataClient"]

logger = logging.getLogger(__name__)

#: The share of a call's remaining time a new connection may take: a listener that vanished can
#: stall the handshake (no refusal comes), and the call's gRPC fallback needs the rest.
CONNECT_SHARE = 0.5


class UcxDataClient:
    """Moves the payloads of ``get_into`` / ``get`` / ``put`` over UCX to one server.

    ``channel`` is the gRPC channel of the server (the control calls use it), ``ucx_address`` its
    ``DataPlane().ucx_address``, ``namespace`` the 16-byte namespace fingerprint, ``lanes`` the
    endpoints it opens to the server (1 to :data:`~kvstore.client.ucx_lanes.MAX_LANES`), each
    carrying at most ``lane_bytes`` in flight. Thread-safe.
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
        lanes: int = 1,
        lane_bytes: int = LANE_BYTES,
        post_early: bool = True,
        ucx_control: bool = False,
    ) -> None:
        self.address = ucx_address
        host, port = parse_address(ucx_address)
        self._namespace = namespace
        self.timeout = timeout
        self.connect_timeout_s = connect_timeout_s
        self.retry_after_s = retry_after_s
        self._pool = LanePool(self._loop, host, port, lanes, lane_bytes=lane_bytes)
        #: Whether ``get_into`` posts its receives before the control call (see the module).
        self.post_early = post_early
        self._transfer_ids = itertools.count(1)  # 0 is never used: HELLO_TAG is tag (0, 1)
        self._retry_at = 0.0
        self._closed = False
        self._device_transports: tuple[str, ...] | None = None
        #: ``transfers``, ``fallbacks``, ``connects``, ``messages``, ``lane_failures``,
        #: ``retries``, ``control_ucx``, ``control_grpc``: for logs, tests and benchmarks.
        self.counters: Counter[str] = Counter()
        #: Why the last fallback happened ("" if none yet).
        self.last_error = ""
        #: The control calls: over UCX once the server bound the lanes (``ucx_control``), and
        #: counted in ``control_ucx`` / ``control_grpc``.
        self._ctl = ControlPath(channel, self._loop, self.counters, over_ucx=ucx_control)

    @property
    def usable(self) -> bool:
        """False once closed, and for ``retry_after_s`` seconds after a UCX failure."""
        return not self._closed and time.monotonic() >= self._retry_at

    @property
    def lanes(self) -> LanePool:
        """The endpoints to the server (for tests and benchmarks)."""
        return self._pool

    # -- public calls ----------------------------------------------------------------------

    def get_into(
        self, keys: Sequence[bytes], buffers: Sequence[Any], *, timeout: float | None = None
    ) -> list[bool] | None:
        """Receive each found payload straight into its buffer; False where missing or the size
        differs. ``None``: UCX could not be used, read over gRPC instead."""
        check_pairs(keys, buffers, "buffers")
        # Device memory (flat uint8 tensors, see kvstore.client.device_fill) goes to ucxx as is.
        views = [b if is_device_tensor(b) else host_piece(writable_byte_view(b)) for b in buffers]
        outcome = self._call_get(keys, views, timeout)
        return None if outcome is None else outcome.sent

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
        outcome = self._call_get(keys, None, timeout)
        if outcome is None:
            return None
        values: list[bytes | None] = [None] * len(keys)
        for index, buffer in outcome.buffers.items():
            values[index] = buffer.tobytes()
        return values

    def put(
        self, keys: Sequence[bytes], values: Sequence[Any], *, timeout: float | None = None
    ) -> PutResult | None:
        """Store ``values`` under ``keys``; ``None`` if UCX could not be used (put over gRPC)."""
        check_pairs(keys, values, "values")
        if not self.usable:
            return None
        views = [host_piece(byte_view(value)) for value in values]
        deadline = self._deadline(timeout)
        try:
            for attempt in (1, 2):
                result = self._put_once(keys, views, deadline, attempt)
                if result is not None:
                    self.counters["transfers"] += 1
                    return result
                self.counters["retries"] += 1
            raise UcxTransportError("a lane failed on both attempts of the put")
        except UcxTransportError as exc:
            self._fail(exc)
            return None

    def close(self) -> None:
        """Close the endpoints; later calls return ``None``."""
        self._closed = True
        self._pool.close()

    # -- get -------------------------------------------------------------------------------

    def _call_get(
        self, keys: Sequence[bytes], views: list[Any] | None, timeout: float | None
    ) -> GetOutcome | None:
        if not self.usable:
            return None
        deadline = self._deadline(timeout)
        # Receives posted before the control call where the caller's buffers are known (host
        # memory): the data then moves while the answer travels back.
        posted = views is not None and self.post_early and not any(map(is_device_tensor, views))
        try:
            try:
                outcome = self._get_once(keys, views, deadline, posted)
            except Forgotten:  # the server restarted, or dropped a lane: once more, new lanes
                self.counters["retries"] += 1
                outcome = self._get_once(keys, views, deadline, False)
            if outcome.failed:
                # Blocks a dead lane carried (or a posted plan could not send): ask again for
                # them alone, over the lanes left, the plan the server's to make.
                self.counters["retries"] += 1
                again = sorted(outcome.failed)
                sub_views = None if views is None else [views[i] for i in again]
                retry = self._get_once([keys[i] for i in again], sub_views, deadline, False)
                if retry.failed:
                    raise UcxTransportError("a lane failed on both attempts of the get")
                for position, index in enumerate(again):
                    outcome.sent[index] = retry.sent[position]
                    if position in retry.buffers:
                        outcome.buffers[index] = retry.buffers[position]
                outcome.failed = set()
            self.counters["transfers"] += 1
            return outcome
        except UcxTransportError as exc:
            self._fail(exc)
            return None

    def _get_once(
        self, keys: Sequence[bytes], views: list[Any] | None, deadline: float, posted: bool
    ) -> GetOutcome:
        sizes = [] if views is None else [int(view.nbytes) for view in views]
        lanes = self._take(sum(sizes), deadline)
        posted = posted and not self._ctl.legacy  # it would not send the posted plan
        transfer_id = next(self._transfer_ids)
        mine = None if views is None else StreamLayout([[view] for view in views])
        request = ucx_pb.UcxGetRequest(
            namespace=_wire.namespace_bytes(self._namespace),
            keys=list(keys),
            client_id=lanes[0].client_id,
            lanes=[lane.client_id for lane in lanes[1:]],
            transfer_id=transfer_id,
            sizes=sizes,
            receive_any=views is None,
            joined=[] if mine is None else _joined(mine, len(keys)),
        )
        early, prepared = None, None
        if posted and mine is not None and mine.total:
            request.messages.extend(plan_messages(mine.total, mine.breaks))
            # The receives and the control message go to the loop in one wake-up.
            prepared = self._ctl.prepare(ctl.REQUEST_GET, request, _remaining(deadline), lanes)
            early = self._pool.start(
                "recv",
                lanes,
                transfer_id,
                mine.views(request.messages),
                request.messages,
                _remaining(deadline),
                then=None if prepared is None else prepared.exchange,
            )
        response = self._get_answer(request, deadline, lanes, early, prepared)
        sent = list(response.sent)
        indices = [index for index, flag in enumerate(sent) if flag]
        outcome = GetOutcome(sent, landing(views, response.lengths, indices))
        if early is not None:
            assert mine is not None
            layout, placed = mine, list(range(len(keys)))
            lost = early.finish(_left(deadline))
            self._count(early)
            # Found and the right size, but a posted message it shared with a miss went empty.
            outcome.failed.update(
                i for i, n in enumerate(response.lengths) if not sent[i] and 0 < n == sizes[i]
            )
        elif outcome.buffers:
            layout, placed = StreamLayout([[outcome.buffers[i]] for i in indices]), indices
            lost = self._receive_plan(lanes, transfer_id, layout, response, deadline, indices)
        else:
            return outcome
        settle(outcome, layout, placed, lost, response)
        return outcome

    def _get_answer(
        self,
        request: ucx_pb.UcxGetRequest,
        deadline: float,
        lanes: list[Lane],
        early: Moving | None,
        prepared: Prepared | None,
    ) -> ucx_pb.UcxGetResponse:
        """The control call's answer, well-formed; whatever fails abandons the posted receives
        (nothing posted may write into the buffers later)."""
        started = None if early is None else early.then
        try:
            response = self._control(ctl.REQUEST_GET, request, deadline, lanes, prepared, started)
        except BaseException:
            if early is not None:
                early.abandon()
            raise
        count = len(request.keys)
        if len(response.lengths) != count or len(response.sent) != count:
            if early is not None:
                early.abandon()
            self._pool.drop(lanes)  # its sends, if any, end with the endpoints
            raise UcxTransportError("malformed UcxGet answer")
        return response  # type: ignore[no-any-return]

    def _receive_plan(
        self,
        lanes: list[Lane],
        transfer_id: int,
        layout: StreamLayout,
        response: ucx_pb.UcxGetResponse,
        deadline: float,
        indices: list[int],
    ) -> list[tuple[int, int]]:
        """Receive the server's plan into ``layout`` (of the blocks ``indices``); the stream
        ranges lost with a lane."""
        messages, tags = list(response.messages), None
        if self._ctl.legacy and not messages:  # one message per block, tagged by key index
            messages, tags = [response.lengths[i] for i in indices], indices
        try:
            if tags is None:
                check_plan(messages, layout.total, layout.breaks)
        except ValueError as exc:
            self._pool.drop(lanes)
            raise UcxTransportError(f"UcxGet answer with a bad plan: {exc}") from exc
        moving = self._pool.start(
            "recv", lanes, transfer_id, layout.views(messages), messages, _remaining(deadline), tags
        )
        lost = moving.finish(_left(deadline))
        self._count(moving)
        return lost

    # -- put -------------------------------------------------------------------------------

    def _put_once(
        self, keys: Sequence[bytes], views: list[Any], deadline: float, attempt: int
    ) -> PutResult | None:
        """One try of a put; ``None`` if a lane died under it (nothing was stored)."""
        layout = StreamLayout([[view] for view in views])
        lanes = self._take(layout.total, deadline)
        messages = plan_messages(layout.total, layout.breaks)
        if self._ctl.legacy:  # the previous release receives one whole message per value
            messages = [n for n in (int(view.nbytes) for view in views) if n]
        transfer_id = next(self._transfer_ids)
        request = ucx_pb.UcxPutRequest(
            namespace=_wire.namespace_bytes(self._namespace),
            keys=list(keys),
            lengths=[int(view.nbytes) for view in views],
            client_id=lanes[0].client_id,
            lanes=[lane.client_id for lane in lanes[1:]],
            transfer_id=transfer_id,
            messages=messages,
        )
        # Send at once: UCX holds the payloads until the server posts its receives, so the
        # whole put is one control round trip.
        prepared = self._ctl.prepare(ctl.REQUEST_PUT, request, _remaining(deadline), lanes)
        sending = self._pool.start(
            "send",
            lanes,
            transfer_id,
            layout.views(messages),
            messages,
            _remaining(deadline),
            then=None if prepared is None else prepared.exchange,
        )
        error: BaseException | None = None
        try:
            response = self._control(
                ctl.REQUEST_PUT, request, deadline, lanes, prepared, sending.then
            )
        except BaseException as exc:  # settle the sends first, then decide
            error = exc
            if not isinstance(exc, UcxTransportError):
                self._pool.drop(lanes)  # refused: the server dropped these endpoints too
        sending.finish(_left(deadline))
        self._count(sending)
        dead = list(sending.failed)
        if error is not None:
            if dead and isinstance(error, UcxTransportError) and attempt == 1:
                return None  # a lane died under the put: send it again (new lanes fill in)
            if isinstance(error, UcxTransportError):
                self._pool.drop(lanes)
            raise error
        return _wire.put_result(response)

    # -- transfers and control calls -------------------------------------------------------

    def _count(self, moving: Moving) -> None:
        self.counters["messages"] += len(moving.messages)
        self.counters["lane_failures"] += len(moving.failed)

    def _control(
        self,
        kind: int,
        request: Any,
        deadline: float,
        lanes: list[Lane],
        prepared: Prepared | None = None,
        started: concurrent.futures.Future[Any] | None = None,
    ) -> Any:
        """Make a control call (:class:`~kvstore.client.ucx_control.ControlPath`; ``prepared``
        and ``started``: one already on its way); transport failures raise UcxTransportError,
        request errors their KVStoreError; :class:`Forgotten` if the server forgot these
        endpoints (it restarted): they are dropped."""
        try:
            return self._ctl.call(kind, request, _remaining(deadline), lanes, prepared, started)
        except Forgotten:
            self._pool.drop(lanes)
            raise

    # -- connection ------------------------------------------------------------------------

    def _loop(self) -> LoopThread:
        return shared_loop()

    def _deadline(self, timeout: float | None) -> float:
        return time.monotonic() + (self.timeout if timeout is None else timeout)

    def _take(self, nbytes: int, deadline: float) -> list[Lane]:
        """Lanes for a transfer of ``nbytes`` (opening missing ones in a share of the time left)."""
        timeout = min(self.connect_timeout_s, _remaining(deadline) * CONNECT_SHARE)
        try:
            lanes = self._pool.take(nbytes, deadline, timeout)
        finally:
            self.counters["connects"] = self._pool.connects
        self._ctl.bind(lanes, timeout)
        # A server of the previous release moves every block over the first endpoint.
        return lanes[:1] if self._ctl.legacy else lanes

    def _fail(self, exc: UcxTransportError) -> None:
        """Fall back for this call and leave UCX alone for ``retry_after_s`` seconds."""
        self._pool.close()
        self._retry_at = time.monotonic() + self.retry_after_s
        self.counters["fallbacks"] += 1
        self.last_error = str(exc)
        logger.warning(
            "UCX data path to %s failed (%s); using gRPC for %.0fs",
            self.address,
            exc,
            self.retry_after_s,
        )


def _joined(layout: StreamLayout, count: int) -> list[bool]:
    """Per key, whether its buffer starts where the previous key's ends (``joined``)."""
    breaks = set(layout.breaks)
    return [index > 0 and layout.block_starts[index] not in breaks for index in range(count)]


def _left(deadline: float) -> float:
    """Seconds to the deadline, 0 once past (waits for operations that end by themselves)."""
    return max(0.0, deadline - time.monotonic())


def _remaining(deadline: float) -> float:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise UcxTransportError("deadline passed before the UCX transfer finished")
    return remaining
