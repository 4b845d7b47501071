"""Asking the cluster index, within a deadline sized from how long it has been answering.

A fixed deadline is wrong both ways: a loaded host (the router's own event loop, Redis, the
network) answers in tens of milliseconds where an idle one answers in one, and a query cut off
routes the request blind (away from the replica holding its prefix, which then computes it
again: far dearer than waiting a few more milliseconds). So :class:`AdaptiveDeadline` keeps the
latencies of the last :data:`WINDOW` answered queries and sets the deadline to
:data:`HEADROOM` times their 99th percentile, clamped to
``[router.index_timeout_s, router.index_timeout_max_s]``: ``index_timeout_s`` is the *floor*
(an idle index is given at least that) and ``index_timeout_max_s`` the *cap* (the most a stalled
index can add to a request). A query that times out doubles the deadline (within the cap: its
latency is unknown, only that it was longer; answers alone would never lift a deadline every
query misses); the next recomputation from the answers brings it back down.

:class:`IndexQuery` asks (``asyncio.timeout``: a timer handle, no task per request) and says why
it has no answer when it has none: ``no_index`` (none configured), ``index_down`` (within
``router.index_retry_s`` of a failure), ``index_timeout`` (past the deadline), ``index_error``.
An error marks the index down for ``index_retry_s``; so does a timeout when nothing has been
answered for longer than the cap (a stalled index, not a slow one: under a burst some queries
miss the deadline while others are answered, and the next request asks again).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from redis.exceptions import TimeoutError as RedisTimeout

from kvstore.cluster.index import Holding
from kvstore.cluster.layout import REDIS_ERRORS

__all__ = ["HEADROOM", "WINDOW", "AdaptiveDeadline", "Index", "IndexQuery"]

logger = logging.getLogger(__name__)

#: How many recent answered queries the deadline is sized from.
WINDOW = 512
#: The deadline is this many times the window's 99th percentile latency (before clamping).
HEADROOM = 2.0
#: The deadline is recomputed once per this many samples (a sort of WINDOW floats, ~20 us).
_EVERY = 32


class Index(Protocol):
    """What the router asks the index (:class:`~kvstore.cluster.index.ClusterIndex`, or
    :class:`~kvstore.router.lookup.ScriptIndex` on a single Redis)."""

    async def holders(self, keys: Sequence[bytes]) -> dict[str, Holding]:
        """Per live node holding any of ``keys``: its leading run and tier per key."""
        ...


class AdaptiveDeadline:
    """The index query's deadline: :data:`HEADROOM` x p99 of recent answers, in
    ``[floor_s, cap_s]``."""

    def __init__(self, floor_s: float, cap_s: float) -> None:
        self.floor_s = floor_s
        self.cap_s = max(cap_s, floor_s)
        self.seconds = floor_s
        self._samples: deque[float] = deque(maxlen=WINDOW)
        self._since = 0

    def observe(self, seconds: float) -> None:
        """An answered query took ``seconds``."""
        self._samples.append(seconds)
        self._since += 1
        if self._since >= _EVERY:
            self._since = 0
            ordered = sorted(self._samples)
            p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
            self.seconds = min(max(HEADROOM * p99, self.floor_s), self.cap_s)

    def missed(self) -> None:
        """A query ran past the deadline: double it (within the cap)."""
        self.seconds = min(self.seconds * 2, self.cap_s)


class IndexQuery:
    """One router's questions to the index: the deadline, the retry window, the reasons."""

    def __init__(
        self,
        index: Index | None,
        deadline: AdaptiveDeadline,
        retry_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.index = index
        self.deadline = deadline
        self.retry_s = retry_s
        self._clock = clock
        self._down_until = 0.0
        self._answered = clock()  # when the index last answered (or this reader started)

    async def holders(self, keys: Sequence[bytes]) -> tuple[Mapping[str, Holding], str, float]:
        """The index's answer, ``""`` and how long it took; or nothing, the fallback reason
        and how long was spent finding out."""
        if self.index is None:
            return {}, "no_index", 0.0
        if self._clock() < self._down_until:
            return {}, "index_down", 0.0
        started = time.perf_counter()
        try:
            async with asyncio.timeout(self.deadline.seconds):
                found = await self.index.holders(keys)
        except (TimeoutError, RedisTimeout):  # asyncio's deadline, or the socket timeout (cap)
            spent = time.perf_counter() - started
            self.deadline.missed()
            silent = self._clock() - self._answered
            if silent > self.deadline.cap_s:
                self._mark_down(f"no answer for {silent:.1f} s")
            return {}, "index_timeout", spent
        except REDIS_ERRORS as exc:
            self._mark_down(str(exc) or type(exc).__name__)
            return {}, "index_error", time.perf_counter() - started
        spent = time.perf_counter() - started
        self._answered = self._clock()
        self.deadline.observe(spent)
        return found, "", spent

    def _mark_down(self, why: str) -> None:
        """Skip the index for ``retry_s`` (logged once per outage, not per request)."""
        now = self._clock()
        if self._down_until == 0.0 or now >= self._down_until + 1:
            logger.warning(
                "cluster index query failed (%s); routing by load for %.1f s "
                "(router.index_retry_s)",
                why,
                self.retry_s,
            )
        self._down_until = now + self.retry_s
