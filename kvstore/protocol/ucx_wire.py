"""The UCX side of a transfer, shared by the server (:mod:`kvstore.server.ucx`), the blocking
client (:mod:`kvstore.client.ucx`) and a node's peer reads (:mod:`kvstore.node.peer_ucx`):
opening an endpoint, moving a plan's messages over a transfer's lanes, aborting.

ucxx's API is asyncio-based and binds its process-wide context to the first event loop that uses
it. The blocking client runs every UCX operation on one daemon thread with its own loop
(:func:`shared_loop`); a node runs them on its server's loop. The coroutines here run on that loop.

:func:`move_messages` posts every message of a transfer at once (several in flight per endpoint,
spread over the lanes by the plan) and waits for all of them, however each ends: a lane whose
operation fails is aborted, which cancels its other operations, and the call returns only once
every operation it posted has ended, so nothing it posted can write into a buffer afterwards.
A lane that dies costs its own messages only; the caller decides what becomes of their blocks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
from collections.abc import Coroutine, Sequence
from typing import Any, Literal, TypeVar

import numpy as np

from kvstore.protocol.ucx import HELLO_TAG, UcxTransportError, load_ucxx, transfer_tag

__all__ = [
    "LoopThread",
    "abort_endpoint",
    "move_messages",
    "open_endpoint",
    "shared_loop",
    "wait_for_loop",
]

T = TypeVar("T")

#: Extra time the caller's thread waits for the UCX loop beyond a coroutine's own deadline.
LOOP_GRACE_S = 2.0
#: How long aborting an endpoint may block (nanoseconds, ucxx's unit).
_ABORT_PERIOD_NS = 1_000_000_000
#: How long operations of an aborted lane may take to report their cancellation.
_SETTLE_S = 2.0


class LoopThread:
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

    def submit_both(
        self, first: Coroutine[Any, Any, T], second: Coroutine[Any, Any, Any]
    ) -> tuple[concurrent.futures.Future[T], concurrent.futures.Future[Any]]:
        """Schedule two coroutines with one wake-up of the loop, ``first`` started first (a
        get's receives before its control message: one thread hop fewer than two submits)."""
        futures: tuple[concurrent.futures.Future[T], concurrent.futures.Future[Any]] = (
            concurrent.futures.Future(),
            concurrent.futures.Future(),
        )

        def start() -> None:
            for coroutine, future in zip((first, second), futures, strict=True):
                task = asyncio.ensure_future(coroutine)
                task.add_done_callback(functools.partial(_settle, future))

        self.loop.call_soon_threadsafe(start)
        return futures

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run ``coroutine`` on the loop and wait for it, at most ``timeout`` seconds (+ grace)."""
        return wait_for_loop(self.submit(coroutine), timeout)


def wait_for_loop(future: concurrent.futures.Future[T], timeout: float) -> T:
    """The result of a coroutine submitted to the loop, waited for at most ``timeout`` seconds
    (+ grace)."""
    try:
        return future.result(max(timeout, 0.0) + LOOP_GRACE_S)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise UcxTransportError("the UCX event loop did not answer in time") from None


def _settle(future: concurrent.futures.Future[Any], task: asyncio.Task[Any]) -> None:
    """Copy how ``task`` ended into ``future`` (unless the waiter gave up on it)."""
    if future.cancelled():
        if not task.cancelled():
            task.exception()  # retrieved
        return
    if task.cancelled():
        future.cancel()
    elif task.exception() is not None:
        future.set_exception(task.exception())
    else:
        future.set_result(task.result())


_loop_thread: LoopThread | None = None
_loop_lock = threading.Lock()


def shared_loop() -> LoopThread:
    """The process's UCX loop thread (started on first use)."""
    global _loop_thread
    with _loop_lock:
        if _loop_thread is None:
            _loop_thread = LoopThread()
        return _loop_thread


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


async def move_messages(
    op: Literal["send", "recv"],
    lanes: Sequence[Any],
    transfer_id: int,
    views: Sequence[Any],
    lane_of: Sequence[int],
    timeout: float,
    tags: Sequence[int] | None = None,
) -> dict[int, BaseException]:
    """Send or receive message ``m`` (``views[m]``) of a transfer over endpoint
    ``lanes[lane_of[m]]``, all at once; the lanes that failed, with why (empty: all moved).
    Message ``m`` is tagged ``(transfer_id, m)``, or ``(transfer_id, tags[m])`` (a server of
    the previous release tags each block by its key's index).

    A lane whose operation fails is aborted (cancelling its other operations); past ``timeout``
    every lane still busy is. Returns only after every posted operation has ended.
    """
    posted: list[tuple[int, asyncio.Future[Any]]] = []
    failed: dict[int, BaseException] = {}
    for index, (view, lane) in enumerate(zip(views, lane_of, strict=True)):
        tag = index if tags is None else tags[index]
        endpoint = lanes[lane]
        if lane in failed:
            continue
        try:
            call = endpoint.send if op == "send" else endpoint.recv
            posted.append(
                (lane, asyncio.ensure_future(call(view, tag=transfer_tag(transfer_id, tag))))
            )
        except Exception as exc:  # the endpoint closed already
            failed[lane] = exc
    for lane in failed:
        await abort_endpoint(lanes[lane])

    def _on_done(future: asyncio.Future[Any], lane: int) -> None:
        error = None if future.cancelled() else future.exception()
        if error is None or lane in failed:
            return
        failed[lane] = error
        # Abort at once: the lane's other operations end now instead of at the deadline.
        if not lanes[lane].closed:
            lanes[lane].abort(period=_ABORT_PERIOD_NS)

    for lane, future in posted:
        future.add_done_callback(functools.partial(_on_done, lane=lane))
    futures = [future for _, future in posted]
    if futures:
        _, pending = await asyncio.wait(futures, timeout=timeout)
        if pending:
            late = {lane for lane, future in posted if future in pending}
            for lane in late:
                failed.setdefault(lane, TimeoutError("UCX transfer timed out"))
                await abort_endpoint(lanes[lane])
            _, still = await asyncio.wait(pending, timeout=_SETTLE_S)
            for future in still:  # never seen: UCX cancels what an abort leaves posted
                future.cancel()
    for future in futures:
        if not future.cancelled():
            future.exception()  # retrieved: no "exception never retrieved" warnings
    return failed


async def abort_endpoint(endpoint: Any) -> None:
    """Close ``endpoint`` at once; UCX cancels its outstanding requests."""
    if not endpoint.closed:
        endpoint.abort(period=_ABORT_PERIOD_NS)
