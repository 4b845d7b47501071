"""The steps a client's call plan yields (:mod:`kvstore.client.core`), and its deadline.

A plan is a generator: it yields a :data:`Step` wherever something must wait, and the blocking
and asyncio clients each carry the steps out their own way (:mod:`kvstore.client.sync`,
:mod:`kvstore.client.aio`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["Blocking", "Deadline", "Plan", "Rpc", "Sleep", "Step", "poll_delays"]

T = TypeVar("T")

#: Polling of a prefetch's status starts this often and backs off to :data:`_POLL_MAX_S`.
_POLL_FIRST_S = 0.001
_POLL_MAX_S = 0.05


class Deadline:
    """The instant (``time.monotonic``) by which a call must be over."""

    __slots__ = ("at",)

    def __init__(self, timeout: float) -> None:
        self.at = time.monotonic() + timeout

    def remaining(self) -> float:
        """Seconds left, never negative (a step given 0 fails with its own deadline error)."""
        return max(self.at - time.monotonic(), 0.0)


@dataclass(frozen=True, slots=True)
class Rpc:
    """A call of the server's ``method``, made by the client's transport
    (:mod:`kvstore.client.transport`; by default ``stub.<method>(request, timeout=timeout)``).

    ``each``, for a server-streaming method, receives every message (the step's result is then
    ``None``); otherwise the result is the response. Failures come back as ``grpc.RpcError``.
    """

    method: str
    request: Any
    timeout: float
    each: Callable[[Any], None] | None = None


@dataclass(frozen=True, slots=True)
class Blocking:
    """Work that blocks (copies, socket waits, UCX transfers): ``call()``'s result."""

    call: Callable[[], Any]


@dataclass(frozen=True, slots=True)
class Sleep:
    """Wait ``seconds``."""

    seconds: float


Step = Rpc | Blocking | Sleep
#: A call's plan: yields steps, is sent each step's result, returns the call's result.
Plan = Generator[Step, Any, T]


def poll_delays(timeout: float) -> Iterator[tuple[float, float]]:
    """(remaining seconds, then delay before the next poll) until ``timeout`` has passed."""
    deadline = time.monotonic() + timeout
    delay = _POLL_FIRST_S
    while (remaining := deadline - time.monotonic()) > 0:
        yield remaining, min(delay, remaining)
        delay = min(2 * delay, _POLL_MAX_S)
