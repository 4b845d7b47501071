"""``within``: await something for at most a given time, whatever it does when cancelled.

:func:`asyncio.wait_for` (Python 3.11) cancels the awaitable at the deadline and then *waits for
it to finish*. redis-py's cluster client does real work after a cancellation: a pipeline's
``finally`` closes the connection it was using (under a timeout of its own) before the
cancellation reaches the caller, and a cancellation that lands while a timeout of its own fires
can become a retry. Under load that turned a 0.5 s ``wait_for`` into 3.6-4.5 s. :func:`within`
cancels too, but returns at the deadline and leaves the cancelled call to end in the background
(its exception, if any, is retrieved so that asyncio does not log it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

__all__ = ["within"]

_T = TypeVar("_T")


async def within(
    awaitable: Awaitable[_T],
    timeout_s: float | None,
    abandoned: set[asyncio.Future[Any]] | None = None,
) -> _T:
    """``await awaitable``, raising :class:`TimeoutError` once ``timeout_s`` has passed (``None``:
    no bound of its own).

    At the deadline the awaitable's task is cancelled and abandoned, not awaited: the caller gets
    its answer on time even if the call takes long to wind down. A cancellation of the caller
    (an outer ``wait_for``, say) cancels the call too, and likewise returns at once. An abandoned
    call is added to ``abandoned`` until it ends, so that its owner can let it finish before
    closing (a loop closed under it would log "Exception ignored").
    """
    task = asyncio.ensure_future(awaitable)
    if timeout_s is not None and timeout_s <= 0 and not task.done():
        _abandon(task, abandoned)
        raise TimeoutError(f"no time left ({timeout_s:.3f} s)")
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    except asyncio.CancelledError:
        _abandon(task, abandoned)
        raise
    if not done:
        _abandon(task, abandoned)
        raise TimeoutError(f"no answer within {timeout_s:.3f} s")
    return task.result()


def _abandon(task: asyncio.Future[_T], abandoned: set[asyncio.Future[Any]] | None) -> None:
    task.cancel()
    task.add_done_callback(_retrieve)
    if abandoned is not None:
        abandoned.add(task)
        task.add_done_callback(abandoned.discard)


def _retrieve(task: asyncio.Future[_T]) -> None:
    if not task.cancelled():
        task.exception()
