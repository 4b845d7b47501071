"""Telling the server about reads it did not serve, off the reader's path.

A read through the published index (:mod:`kvstore.protocol.dram_index`) never reaches the server,
yet the server's LRU order and hit counts should see it. Sending a message per read would put a
system call (and a wake-up of the server) on every read, which costs as much as the index saves
(0.1 ms per call measured on a cold cache). :class:`TouchSender` instead collects the keys read
and a background thread sends them as one ``TOUCH`` per window (50 ms): the server learns of
every read, a little later, at one message per window however many reads there were. While
reads keep coming the thread wakes once per window on its own, and a reader never wakes it;
after a quiet second it blocks until the next read wakes it, so an idle client costs nothing.
The window is long on purpose: an engine's forward pass keeps every core busy (vLLM's CPU
worker spins its OpenMP threads), so any thread that wakes during it preempts one of those
threads and holds up every barrier they meet. At 2 ms windows (and a reader's wake-up after a
quiet spell) the sender and the server's handling of each TOUCH took a measurable share of a
40 ms CPU prefill; at 50 ms there is at most one wake-up per forward pass. One TOUCH ages the
keys of the calls in its window together, which blurs their order within that window and
nothing more. :meth:`TouchSender.flush` sends what is pending at once and waits until the
server has handled it, for callers that read the counters next (a client's ``stats()``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence

from kvstore.protocol.shm_frames import MAX_TOUCH_LOOKUPS

__all__ = ["TouchSender"]

#: Keys held for the next TOUCH at most (lookups: MAX_TOUCH_LOOKUPS); past this (a server that
#: stopped reading), new reads go uncounted rather than piling up in memory.
MAX_PENDING_KEYS = 1 << 16
#: Empty windows in a row (one second) after which the thread blocks until a read wakes it.
IDLE_WINDOWS = 20


class TouchSender:
    """Collects the keys of reads (and counts lookups) and sends them every ``window_s``.

    ``send(keys, calls, lookups)`` must deliver one TOUCH of at most ``max_keys`` keys (read by
    ``calls`` client calls) and a count of lookups answered from the index; ``sync(deadline)``
    must return once the server has handled everything sent before (by the
    :func:`time.monotonic` instant ``deadline``, or raise). Both run under one lock, on the
    sender's thread or in :meth:`flush`. After a background send fails, :attr:`failure` holds
    the exception and :meth:`add` raises :class:`ConnectionError`.
    """

    def __init__(
        self,
        send: Callable[[Sequence[bytes], int, int], None],
        sync: Callable[[float], None],
        max_keys: int,
        *,
        window_s: float = 0.05,
    ) -> None:
        self._send = send
        self._sync = sync
        self._max_keys = max(1, max_keys)
        self._window_s = window_s
        self._lock = threading.Lock()  # guards the pending reads
        self._send_lock = threading.Lock()  # one sender at a time, in order
        self._pending: list[bytes] = []
        self._calls = 0
        self._lookups = 0
        self._wake = threading.Event()
        self._asleep = False  # blocked on _wake, not polling (guarded by _lock)
        self._closing = threading.Event()
        self.failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvstore-shm-touch", daemon=True)
        self._thread.start()

    def add(self, keys: Sequence[bytes], *, counts_call: bool = True) -> None:
        """Note one call's reads (``counts_call``: count the call as a get too); raises
        ConnectionError once the server is known to be gone."""
        if self.failure is not None:
            raise ConnectionError(f"the store's shared-memory socket failed: {self.failure}")
        with self._lock:
            if len(self._pending) < MAX_PENDING_KEYS:
                self._pending.extend(keys)
                self._calls += counts_call
            wake = self._wake_if_asleep()
        if wake:
            self._wake.set()

    def add_lookup(self) -> None:
        """Note one lookup answered without the server."""
        with self._lock:
            self._lookups = min(self._lookups + 1, MAX_TOUCH_LOOKUPS)
            wake = self._wake_if_asleep()
        if wake:
            self._wake.set()

    def _wake_if_asleep(self) -> bool:
        """Whether the caller must wake the thread (under ``_lock``); at most once per sleep."""
        asleep, self._asleep = self._asleep, False
        return asleep

    def _idle(self) -> bool:
        return not self._pending and not self._calls and not self._lookups

    def flush(self, deadline: float) -> None:
        """Send what is pending now; return once the server has handled every TOUCH so far.

        Raises TimeoutError if a send already under way does not finish by ``deadline``.
        """
        if not self._send_lock.acquire(timeout=max(deadline - time.monotonic(), 0.0)):
            raise TimeoutError("a TOUCH still being sent held up the flush")
        try:
            self._deliver()
            self._sync(deadline)
        finally:
            self._send_lock.release()

    def close(self, timeout: float = 1.0) -> None:
        """Send what is pending and stop the thread."""
        with self._lock:  # so that the thread cannot decide to sleep in between
            self._closing.set()
            self._wake.set()
        self._thread.join(timeout)

    def _deliver(self) -> bool:
        """Send what is pending; whether there was anything."""
        with self._lock:
            keys, self._pending = self._pending, []
            calls, self._calls = self._calls, 0
            lookups, self._lookups = self._lookups, 0
        if not (keys or calls or lookups):
            return False
        # The counts ride with the first chunk only (an empty one if only lookups happened).
        for start in range(0, max(len(keys), 1), self._max_keys):
            first = start == 0
            chunk = keys[start : start + self._max_keys]
            self._send(chunk, calls if first else 0, lookups if first else 0)
        return True

    def _run(self) -> None:
        quiet = 0  # windows in a row with nothing to send
        while not self._closing.is_set():
            if quiet >= IDLE_WINDOWS:
                # Idle for a while: block until a reader wakes us (a futex wake costs the reader
                # tens of microseconds on a VM, so while reads keep coming we poll instead).
                with self._lock:
                    self._asleep = self._idle() and not self._closing.is_set()
                    if self._asleep:
                        self._wake.clear()
                if self._asleep:
                    self._wake.wait()
                quiet = 0
            self._closing.wait(self._window_s)  # let more reads join this TOUCH
            try:
                with self._send_lock:
                    sent = self._deliver()
            except Exception as exc:  # the server is gone; the next add() says so
                self.failure = exc
                return
            quiet = 0 if sent else quiet + 1
        with contextlib.suppress(Exception), self._send_lock:
            self._deliver()  # closing: what is left
