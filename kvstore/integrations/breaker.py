"""A circuit breaker around the store, shared by every engine integration.

A dead or slow store must cost an engine a miss, never a stall: :class:`Breaker` remembers a
failure so that for a while nothing waits on the store again, and :func:`warm_up` opens the
connection and the data path off the engine's critical path.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvstore.errors import DeadlineExceededError, KVStoreError, StoreUnavailableError
from kvstore.integrations.store_client import StoreClient

__all__ = ["Breaker", "warm_up"]

logger = logging.getLogger(__name__)


class Breaker:
    """Remembers that the store failed, so that for a while nothing waits on it again.

    A dead store must cost the engine nothing: without this, every lookup would wait for its
    own connection attempt and every save for its own deadline. An unreachable store
    (:class:`~kvstore.errors.StoreUnavailableError`) is watched through ``reconnected`` (the
    client's :meth:`~kvstore.KVStoreClient.when_reconnected`): the breaker closes as soon as
    the channel connects again, rather than ``retry_after_s`` after the last failure, so that
    saves resume within a second of a restarted store's ``serving on``.
    """

    def __init__(
        self,
        retry_after_s: float,
        clock: Callable[[], float] = time.monotonic,
        *,
        warning: str = "kvstore unavailable (%s); treating it as down for %.1f s",
        reconnected: Callable[[Callable[[], None]], None] | None = None,
    ) -> None:
        self._retry_after_s = retry_after_s
        self._clock = clock
        #: The warning of an outage's first failure (the error, then ``retry_after_s``).
        self._warning = warning
        self._reconnected = reconnected
        self._watching = False
        self._down_until = 0.0
        self._held = False
        self._lock = threading.Lock()

    def is_open(self) -> bool:
        """True while the store is considered down (or for good, once :meth:`hold` was called)."""
        return self._held or self._clock() < self._down_until

    def hold(self) -> None:
        """Open for good: the store must not be used again (it names chunks otherwise)."""
        self._held = True

    @property
    def held(self) -> bool:
        """Whether :meth:`hold` was called."""
        return self._held

    def trip(self, error: BaseException) -> None:
        """Record a failure; the first one of an outage is logged."""
        with self._lock:
            if not self.is_open():
                logger.warning(self._warning, error, self._retry_after_s)
            self._down_until = self._clock() + self._retry_after_s
            watch = (
                self._reconnected is not None
                and isinstance(error, StoreUnavailableError)
                and not self._watching
            )
            self._watching = self._watching or watch
        if watch:
            assert self._reconnected is not None
            try:
                self._reconnected(self._close)
            except Exception:  # the breaker still closes after retry_after_s
                with self._lock:
                    self._watching = False
                logger.warning("kvstore: cannot watch the connection", exc_info=True)

    def _close(self) -> None:
        with self._lock:
            self._watching = False
            was_open = self.is_open() and not self._held
            self._down_until = 0.0
        if was_open:
            logger.info("kvstore answers again; lookups and saves resume")


def warm_up(client: StoreClient, breaker: Breaker, timeout: float) -> None:
    """Open the client's connection and its data path; a dead store opens the breaker.

    Run it on a background thread at start-up: the first call on a fresh gRPC channel pays for
    the connection, which would otherwise land on the first request's critical path. The data
    path (shared memory, else UCX) is settled too: the worker's first load picks how to load
    from it (on CUDA, straight into device memory only over UCX). A first call that outlives its
    deadline is a slow start (an engine starting on a loaded host), not an outage: opening the
    breaker then would drop every save of the next ``retry_after_s``.
    """
    try:
        client.stats(timeout=timeout)
        client.open_data_plane(timeout=timeout)
    except StoreUnavailableError as exc:
        breaker.trip(exc)
    except DeadlineExceededError as exc:
        logger.warning("kvstore: the first call outlived its %.1f s deadline (%s)", timeout, exc)
    except KVStoreError as exc:
        logger.warning("kvstore: first call failed: %s", exc)
    except Exception:  # it runs on a pool thread: an error there would go unseen
        logger.warning("kvstore: first call failed", exc_info=True)
