"""Deadlines of shared-tier calls that scale with the bytes they move, and the rate they assume.

A fixed deadline cannot fit every call: PING must fail fast when Redis stalls, while an 8 MiB
batched read over a slow link takes seconds and is slow, not down. So a call moving ``size``
bytes (what it sends plus what it expects back) gets::

    deadline = min(cap, floor + size / rate)

``floor`` (``redis.op_timeout_s``) is what a call moving few bytes waits at most, ``cap``
(``redis.op_timeout_max_s``) what any call waits at most, however large. ``rate`` is the lower of
``redis.min_rate`` (the slowest transfer rate a healthy link is trusted to keep up: a call slower
than that counts as an outage) and half the rate measured on this link (:meth:`observe`: an
exponentially weighted mean over calls that moved at least :data:`SAMPLE_BYTES`), so a link known
to be slower than ``min_rate`` still gets deadlines it can meet, with room to spare. A call that
ran out of time (:meth:`missed`) lowers the measured rate to what it showed at best, so the next
one gets longer; the rate recovers as calls succeed again.

Only the event loop's thread uses it: no lock.
"""

from __future__ import annotations

__all__ = ["SAMPLE_BYTES", "TransferRate"]

#: Calls moving less than this are latency, not transfer: they do not move the measured rate.
SAMPLE_BYTES = 64 * 1024
#: Weight of the newest sample in the measured rate.
_ALPHA = 0.2
#: The deadline assumes the link may run this many times slower than measured.
_MARGIN = 2.0


class TransferRate:
    """The rate a link is measured to move bytes at, and the deadline of a call of a size."""

    def __init__(self, floor_s: float, cap_s: float, min_rate: float) -> None:
        if not 0 < floor_s <= cap_s:
            raise ValueError(f"need 0 < floor ({floor_s}) <= cap ({cap_s})")
        if min_rate <= 0:
            raise ValueError(f"min_rate must be > 0 bytes/s, got {min_rate}")
        self.floor_s = floor_s
        self.cap_s = cap_s
        self.min_rate = min_rate
        #: Bytes per second measured (``None``: nothing measured yet).
        self.measured: float | None = None
        #: Calls that ran out of time while moving at least :data:`SAMPLE_BYTES`.
        self.misses = 0

    def rate(self) -> float:
        """The rate deadlines assume now (bytes per second)."""
        if self.measured is None:
            return self.min_rate
        return min(self.min_rate, self.measured / _MARGIN)

    def timeout(self, size: int) -> float:
        """Seconds a call moving ``size`` bytes may take."""
        if size <= 0:
            return self.floor_s
        return min(self.cap_s, self.floor_s + size / self.rate())

    def observe(self, size: int, seconds: float) -> None:
        """A call moved ``size`` bytes in ``seconds``."""
        if size < SAMPLE_BYTES:
            return
        sample = size / max(seconds, 1e-6)
        measured = self.measured
        self.measured = sample if measured is None else measured + _ALPHA * (sample - measured)

    def missed(self, size: int, seconds: float) -> None:
        """A call of ``size`` bytes had not finished after ``seconds``: the link moved it slower
        than ``size / seconds``, and the next deadline allows for that."""
        if size < SAMPLE_BYTES:
            return
        self.misses += 1
        bound = size / max(seconds, 1e-6)
        self.measured = bound if self.measured is None else min(self.measured, bound)
