"""Request durations, recorded on the request path as cheaply as it can be done.

The data planes time each request with two ``perf_counter`` calls and one
:meth:`Durations.observe` (a bisect into fixed buckets and two list increments); the metrics
endpoint (:mod:`kvstore.server.metrics`) turns them into ``kvstore_request_duration_seconds``
when scraped.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterator

__all__ = ["BUCKETS", "DURATIONS", "Durations", "timed"]

#: Upper bounds (seconds) of the request-duration buckets: 50 us to 10 s.
BUCKETS = (
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    2.5e-2,
    5e-2,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


class Durations:
    """Request durations by ``(op, plane, tenant)``, in fixed buckets, cheap to record.

    Each series is one list: a count per bucket (the last one past 10 s), then the sum. Only
    the event loop's thread records, so no lock.
    """

    def __init__(self) -> None:
        self._series: dict[tuple[str, str, str], list[float]] = {}
        #: Keys refused for the caller's credentials (``denied`` misses; no tenant known).
        self.denied = 0

    def observe(self, op: str, plane: str, tenant: str, seconds: float) -> None:
        """Record one request of ``op`` on ``plane`` that took ``seconds``."""
        key = (op, plane, tenant)
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = [0.0] * (len(BUCKETS) + 2)
        series[bisect_left(BUCKETS, seconds)] += 1
        series[-1] += seconds

    def count(self, op: str, plane: str, tenant: str) -> int:
        """How many ``op`` requests ``plane`` served for ``tenant``."""
        series = self._series.get((op, plane, tenant))
        return 0 if series is None else int(sum(series[:-1]))

    def items(self) -> Iterator[tuple[tuple[str, str, str], list[float]]]:
        """Every series recorded so far (a copy of the list of them)."""
        return iter(list(self._series.items()))


#: The process's request durations (one server per process).
DURATIONS = Durations()


def timed(op: str, plane: str, tenant: Callable[[], str]) -> _Timer:
    """A context manager timing one request into :data:`DURATIONS`."""
    return _Timer(op, plane, tenant)


class _Timer:
    __slots__ = ("_op", "_plane", "_start", "_tenant")

    def __init__(self, op: str, plane: str, tenant: Callable[[], str]) -> None:
        self._op, self._plane, self._tenant = op, plane, tenant
        self._start = 0.0

    def __enter__(self) -> None:
        self._start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        DURATIONS.observe(self._op, self._plane, self._tenant(), time.perf_counter() - self._start)
