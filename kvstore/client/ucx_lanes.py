"""The lanes of a blocking client's UCX data path: a small pool of endpoints to one server.

One endpoint is one TCP connection (or one RDMA queue pair) and one stream of requests in UCX; a
pool of them lets one batch spread its messages over several (the plan's lane rule,
:func:`kvstore.protocol.ucx_plan.assign_lanes`) and concurrent calls of a client use the
least-loaded ones. ``size`` (``KVSTORE_UCX_LANES``) bounds the pool; the server bounds what one
transfer may name (``ucx.max_lanes``).

Back-pressure: each lane carries at most ``lane_bytes`` of transfers in flight. A call waits,
within its deadline, until some lane has room, and uses only lanes with room; past the deadline it
fails (and the call moves over gRPC). A lane that fails is dropped on its own; the next call
opens a new one, and the others carry on.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kvstore.protocol.ucx import CLIENT_ID_BYTES, UcxTransportError, load_ucxx
from kvstore.protocol.ucx_plan import assign_lanes, lane_loads
from kvstore.protocol.ucx_wire import (
    LOOP_GRACE_S,
    LoopThread,
    abort_endpoint,
    move_messages,
    open_endpoint,
)

__all__ = ["LANE_BYTES", "MAX_LANES", "Lane", "LanePool", "Moving"]

#: Most lanes a client opens to one server (the server's ``ucx.max_lanes`` default too).
MAX_LANES = 8
#: Bytes one lane carries in flight at most before calls wait for it (per-lane back-pressure).
LANE_BYTES = 256 * 1024**2


@dataclass(eq=False)
class Lane:
    """One endpoint of the pool, named by its client id; ``in_flight``: bytes of its transfers."""

    endpoint: Any  # ucxx Endpoint
    client_id: bytes
    in_flight: int = 0
    dead: bool = field(default=False)
    #: The key ``UcxBind`` gave it (``None``: its control calls go over gRPC), whether a bind
    #: was tried, and the ``seq`` of its last control message (:mod:`kvstore.client.ucx_control`).
    control_key: bytes | None = None
    bind_tried: bool = False
    control_seq: int = 0


class LanePool:
    """Up to ``size`` endpoints to the listener at ``host:port``, made on ``loop`` (thread-safe)."""

    def __init__(
        self,
        loop: Callable[[], LoopThread],
        host: str,
        port: int,
        size: int,
        *,
        lane_bytes: int = LANE_BYTES,
    ) -> None:
        if not 1 <= size <= MAX_LANES:
            raise ValueError(f"UCX lanes must be 1 to {MAX_LANES}, got {size}")
        self._loop = loop
        self._host, self._port = host, port
        self.size = size
        self.lane_bytes = lane_bytes
        self._lanes: list[Lane] = []
        self._cond = threading.Condition()
        self._connecting = threading.Lock()
        #: New endpoints opened so far (tests and benchmarks read it).
        self.connects = 0

    def take(self, nbytes: int, deadline: float, connect_timeout: float) -> list[Lane]:
        """Live lanes for a transfer of about ``nbytes``, the least loaded first, each below its
        in-flight limit; opens missing lanes first. Waits for room until ``deadline``."""
        self._fill(connect_timeout)
        with self._cond:
            while True:
                live = [lane for lane in self._lanes if not lane.dead and not lane.endpoint.closed]
                if not live:
                    raise UcxTransportError("no UCX lane is open")
                roomy = [lane for lane in live if lane.in_flight + nbytes <= self.lane_bytes]
                if not roomy and all(lane.in_flight == 0 for lane in live):
                    roomy = live  # one transfer larger than a lane's limit: alone, it goes
                if roomy:
                    return sorted(roomy, key=lambda lane: lane.in_flight)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise UcxTransportError("every UCX lane is busy (in-flight limit)")
                self._cond.wait(left)

    def live(self) -> list[Lane]:
        """The lanes open now."""
        with self._cond:
            return [lane for lane in self._lanes if not lane.dead and not lane.endpoint.closed]

    def charge(self, lanes: Sequence[Lane], loads: Sequence[int]) -> None:
        """Count ``loads[i]`` bytes in flight on ``lanes[i]``."""
        with self._cond:
            for lane, load in zip(lanes, loads, strict=True):
                lane.in_flight += load

    def discharge(self, lanes: Sequence[Lane], loads: Sequence[int]) -> None:
        """Give back what :meth:`charge` counted; wakes calls waiting for room."""
        with self._cond:
            for lane, load in zip(lanes, loads, strict=True):
                lane.in_flight -= load
            self._cond.notify_all()

    def drop(self, lanes: Sequence[Lane]) -> None:
        """Forget and abort ``lanes`` (the next call opens new ones)."""
        with self._cond:
            for lane in lanes:
                lane.dead = True
            self._lanes = [lane for lane in self._lanes if not lane.dead]
            self._cond.notify_all()
        for lane in lanes:
            self._abort(lane)

    def start(
        self,
        op: Literal["send", "recv"],
        lanes: list[Lane],
        transfer_id: int,
        views: Sequence[Any],
        messages: Sequence[int],
        timeout: float,
        tags: Sequence[int] | None = None,
        then: Coroutine[Any, Any, Any] | None = None,
    ) -> Moving:
        """Post a plan's messages over ``lanes`` (the plan's lane rule), charged to them
        (``tags``: see :func:`~kvstore.protocol.ucx_wire.move_messages`); ``then``, a coroutine
        started on the loop right after (a control exchange), in the same wake-up: its future is
        :attr:`Moving.then`."""
        lane_of = assign_lanes(messages, len(lanes))
        loads = lane_loads(messages, lane_of, len(lanes))
        self.charge(lanes, loads)
        endpoints = [lane.endpoint for lane in lanes]
        move = move_messages(op, endpoints, transfer_id, views, lane_of, timeout, tags)
        after: concurrent.futures.Future[Any] | None = None
        try:
            if then is None:
                future = self._loop().submit(move)
            else:
                future, after = self._loop().submit_both(move, then)
        except BaseException:
            self.discharge(lanes, loads)
            move.close()
            if then is not None:
                then.close()
            raise
        return Moving(self, lanes, list(messages), lane_of, loads, future, then=after)

    def close(self) -> None:
        """Drop every lane."""
        with self._cond:
            lanes, self._lanes = self._lanes, []
        self.drop(lanes)

    def _fill(self, timeout: float) -> None:
        """Open lanes until ``size`` are live (concurrently); fails only if none is live."""
        with self._connecting:
            with self._cond:
                self._lanes = [lane for lane in self._lanes if not lane.endpoint.closed]
                missing = self.size - len(self._lanes)
            if missing <= 0:
                return
            load_ucxx()
            ids = [os.urandom(CLIENT_ID_BYTES) for _ in range(missing)]
            loop = self._loop()
            futures = [
                loop.submit(open_endpoint(self._host, self._port, client_id, timeout))
                for client_id in ids
            ]
            errors: list[BaseException] = []
            opened: list[Lane] = []
            for client_id, future in zip(ids, futures, strict=True):
                try:
                    opened.append(Lane(future.result(timeout + 2.0), client_id))
                except Exception as exc:
                    errors.append(exc)
            with self._cond:
                self._lanes.extend(opened)
                self.connects += len(opened)
                live = len(self._lanes)
        if not live:
            error = errors[0] if errors else None
            if isinstance(error, UcxTransportError):
                raise error
            raise UcxTransportError(f"cannot open a UCX lane: {error}")

    def _abort(self, lane: Lane) -> None:
        with contextlib.suppress(Exception):  # already closed by the peer's failure
            self._loop().run(abort_endpoint(lane.endpoint), 2.0)


@dataclass
class Moving:
    """A plan's messages in flight over some lanes (:meth:`LanePool.start`)."""

    pool: LanePool
    lanes: list[Lane]
    messages: list[int]
    lane_of: list[int]
    loads: list[int]
    future: concurrent.futures.Future[dict[int, BaseException]]
    #: The future of the coroutine started with the messages (:meth:`LanePool.start`'s ``then``).
    then: concurrent.futures.Future[Any] | None = None
    #: Lanes that failed, once :meth:`finish` returned.
    failed: dict[int, BaseException] = field(default_factory=dict)

    def finish(self, timeout: float) -> list[tuple[int, int]]:
        """Wait until every message has ended; the stream ranges of the messages lost with a
        lane (its lanes dropped). Every lane is dropped if they do not end in time."""
        try:
            self.failed = self.future.result(timeout + LOOP_GRACE_S)
        except Exception as exc:
            self.pool.drop(self.lanes)  # aborted: whatever was still posted ends with them
            raise UcxTransportError(f"UCX transfer did not end: {exc}") from exc
        finally:
            self.pool.discharge(self.lanes, self.loads)
        if self.failed:
            self.pool.drop([self.lanes[lane] for lane in self.failed])
        lost, offset = [], 0
        for length, lane in zip(self.messages, self.lane_of, strict=True):
            if lane in self.failed:
                lost.append((offset, offset + length))
            offset += length
        return lost

    def abandon(self) -> None:
        """Drop the lanes (cancelling every message still posted) and wait for that."""
        self.pool.drop(self.lanes)
        with contextlib.suppress(Exception):
            self.finish(2.0)
