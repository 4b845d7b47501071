"""How fast something runs, measured as it runs: ``seconds = latency + size / rate``.

The store measures each tier's reads with a :class:`RateMeter` (size: payload bytes of one batched
read) and reports the fit per tier in ``Stats`` under :data:`RATE_KEY` and :data:`LATENCY_KEY`; the
vLLM connector measures its engine's prefill the same way (size: the step's prefill work, see
:mod:`kvstore.client.cost_model`) and weighs the two in its load-or-recompute decision.

The fit is an exponentially weighted least-squares line through ``(size, seconds)`` samples, so it
follows a tier that slows down (a congested link, a busy Redis) within a few dozen reads. Where
the sizes hardly vary the line is not determined; the meter then reports no fixed latency and the
mean rate (``mean size / mean seconds``), which is what a read of the usual size costs.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LATENCY_KEY", "RATE_KEY", "UNKNOWN", "Rate", "RateMeter", "rate_from_stats"]

#: ``Stats`` per-tier value: the measured read rate, bytes per second (0: not measured yet).
RATE_KEY = "read_bytes_per_s"
#: ``Stats`` per-tier value: the measured fixed cost of one batched read, microseconds.
LATENCY_KEY = "read_latency_us"

# Weight of the newest sample: about the last 1 / _ALPHA samples count.
_ALPHA = 0.05
# Sizes whose spread is under this fraction of their mean do not determine a line.
_MIN_SPREAD = 0.1


@dataclass(frozen=True, slots=True)
class Rate:
    """``seconds(size) = latency_s + size / per_s``; ``per_s <= 0`` means not known."""

    per_s: float
    latency_s: float = 0.0

    @property
    def known(self) -> bool:
        """Whether there is a rate to go by."""
        return self.per_s > 0

    def seconds(self, size: float) -> float:
        """Expected time for ``size`` (bytes, tokens...); 0 when the rate is not known."""
        if not self.known:
            return 0.0
        return self.latency_s + size / self.per_s


UNKNOWN = Rate(0.0)


class RateMeter:
    """An exponentially weighted fit of ``seconds = latency + size / rate`` over samples."""

    __slots__ = ("_n", "_x", "_xx", "_xy", "_y")

    def __init__(self) -> None:
        self._n = 0
        self._x = self._y = self._xx = self._xy = 0.0

    @property
    def samples(self) -> int:
        """Samples taken so far."""
        return self._n

    def add(self, size: float, seconds: float) -> None:
        """Take one sample (ignored unless both are positive: a zero-size read says nothing)."""
        if size <= 0 or seconds <= 0:
            return
        # The first sample sets the means outright, so a new meter is not biased towards 0.
        a = 1.0 if self._n == 0 else max(_ALPHA, 1.0 / (self._n + 1))
        self._n += 1
        self._x += a * (size - self._x)
        self._y += a * (seconds - self._y)
        self._xx += a * (size * size - self._xx)
        self._xy += a * (size * seconds - self._xy)

    def mean_rate(self) -> Rate:
        """Mean size over mean seconds, fixed costs included (:data:`UNKNOWN` before a sample)."""
        if self._n == 0 or self._y <= 0:
            return UNKNOWN
        return Rate(self._x / self._y)

    def rate(self) -> Rate:
        """The current fit (:data:`UNKNOWN` before the first sample)."""
        mean_rate = self.mean_rate()
        if not mean_rate.known:
            return UNKNOWN
        var = self._xx - self._x * self._x
        if var <= (_MIN_SPREAD * self._x) ** 2:
            return mean_rate
        slope = (self._xy - self._x * self._y) / var
        latency = self._y - slope * self._x
        if slope <= 0 or latency < 0:  # noise, not a line: go by the mean
            return mean_rate
        return Rate(1.0 / slope, latency)


def rate_from_stats(values: dict[str, int]) -> Rate:
    """The read rate a tier's ``Stats`` values report (:data:`UNKNOWN` if none)."""
    per_s = float(values.get(RATE_KEY, 0))
    return Rate(per_s, values.get(LATENCY_KEY, 0) / 1e6) if per_s > 0 else UNKNOWN
