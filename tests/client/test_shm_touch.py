"""Tests of :class:`kvstore.client.shm_touch.TouchSender`: reads reach the server coalesced.

``send`` here records what it is given instead of writing to a socket; the socket side is covered
by the integration tests (``tests/integration/test_shm.py``), where a real server counts them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest

from kvstore.client import shm_touch
from kvstore.client.shm_touch import TouchSender


def key(n: int) -> bytes:
    return n.to_bytes(16, "little")


class Recorder:
    def __init__(self, fail_after: int | None = None) -> None:
        self.sent: list[tuple[list[bytes], int]] = []
        self.lookups = 0
        self.fail_after = fail_after
        self.done = threading.Event()
        self.syncs = 0

    def __call__(self, keys: Sequence[bytes], calls: int, lookups: int) -> None:
        if self.fail_after is not None and len(self.sent) >= self.fail_after:
            self.done.set()
            raise BrokenPipeError("the server went away")
        self.sent.append((list(keys), calls))
        self.lookups += lookups

    def sync(self, deadline: float) -> None:
        assert deadline > time.monotonic()
        self.syncs += 1

    def keys(self) -> list[bytes]:
        return [k for keys, _ in self.sent for k in keys]

    def calls(self) -> int:
        return sum(calls for _, calls in self.sent)


def wait_for(condition: object, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_reads_of_many_calls_go_out_in_few_messages() -> None:
    recorder = Recorder()
    sender = TouchSender(recorder, recorder.sync, max_keys=1024, window_s=0.05)
    for n in range(100):
        sender.add([key(n), key(n + 1000)])
    wait_for(lambda: recorder.calls() == 100)
    assert len(recorder.sent) <= 3  # one per window, not one per call
    assert sorted(recorder.keys()) == sorted(
        [key(n) for n in range(100)] + [key(n + 1000) for n in range(100)]
    )
    sender.close()


def test_a_message_never_exceeds_the_servers_key_limit() -> None:
    recorder = Recorder()
    sender = TouchSender(recorder, recorder.sync, max_keys=8, window_s=0.05)
    for n in range(5):
        sender.add([key(10 * n + i) for i in range(5)])
    wait_for(lambda: len(recorder.keys()) == 25)
    assert all(len(keys) <= 8 for keys, _ in recorder.sent)
    assert recorder.calls() == 5  # counted once, not once per chunk
    sender.close()


class NoticedEvent(threading.Event):
    """A :class:`threading.Event` that says when someone first waits on it."""

    def __init__(self) -> None:
        super().__init__()
        self.waited = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.waited.set()
        return super().wait(timeout)


class WindowNoticed(TouchSender):
    """A TouchSender whose thread says when it waits out its first window (``window_waited``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.window_waited = threading.Event()
        super().__init__(*args, **kwargs)

    def _run(self) -> None:
        noticed = NoticedEvent()  # nothing sets the old one before the window is waited on
        noticed.waited = self.window_waited
        self._closing = noticed
        super()._run()


def test_close_sends_what_is_pending() -> None:
    recorder = Recorder()
    sender = WindowNoticed(recorder, recorder.sync, max_keys=64, window_s=60.0)  # a minute
    assert sender.window_waited.wait(10)  # the thread is in (or entering) its 60 s wait
    sender.close(timeout=30)  # before anything was added: nothing to send
    assert not sender._thread.is_alive()  # close() woke it, not the 60 s window running out
    assert recorder.sent == []
    sender = TouchSender(recorder, recorder.sync, max_keys=64, window_s=0.5)
    sender.add([key(1)])
    sender.close(timeout=5)
    assert recorder.sent == [([key(1)], 1)]


def test_a_failed_send_makes_the_next_add_raise() -> None:
    recorder = Recorder(fail_after=0)
    sender = TouchSender(recorder, recorder.sync, max_keys=64, window_s=0.001)
    sender.add([key(1)])  # accepted; the background send then fails
    assert recorder.done.wait(5)
    wait_for(lambda: sender.failure is not None)
    with pytest.raises(ConnectionError, match="server went away"):
        sender.add([key(2)])
    sender.close()


def test_pending_keys_are_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm_touch, "MAX_PENDING_KEYS", 10)
    recorder = Recorder()
    sender = TouchSender(recorder, recorder.sync, max_keys=64, window_s=0.2)
    for n in range(20):
        sender.add([key(n)])
    sender.close(timeout=5)
    assert len(recorder.keys()) == 10


def test_flush_sends_at_once_then_syncs() -> None:
    recorder = Recorder()
    sender = TouchSender(recorder, recorder.sync, max_keys=64, window_s=60.0)
    sender.add([key(1), key(2)])
    sender.add([key(3)])
    sender.flush(time.monotonic() + 5)  # no waiting for the minute-long window
    assert recorder.sent == [([key(1), key(2), key(3)], 2)]
    assert recorder.syncs == 1
    sender.flush(time.monotonic() + 5)  # nothing pending: still a sync, nothing sent
    assert len(recorder.sent) == 1 and recorder.syncs == 2
    sender.close(timeout=0.1)


def test_lookups_are_counted_even_without_reads() -> None:
    recorder = Recorder()
    sender = TouchSender(recorder, recorder.sync, max_keys=4, window_s=60.0)
    sender.add_lookup()
    sender.add_lookup()
    sender.flush(time.monotonic() + 5)
    assert recorder.sent == [([], 0)] and recorder.lookups == 2
    sender.add([key(n) for n in range(6)])
    sender.add_lookup()
    sender.flush(time.monotonic() + 5)
    assert recorder.sent[1:] == [([key(n) for n in range(4)], 1), ([key(4), key(5)], 0)]
    assert recorder.lookups == 3
    sender.close()


def test_an_idle_sender_sleeps_and_the_next_read_wakes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm_touch, "IDLE_WINDOWS", 3)
    recorder = Recorder()
    sender = TouchSender(recorder, recorder.sync, max_keys=64, window_s=0.001)
    wait_for(lambda: sender._asleep)  # polled a few empty windows, then blocked
    sender.add([key(1)])
    wait_for(lambda: recorder.keys() == [key(1)])
    wait_for(lambda: sender._asleep)
    sender.add_lookup()
    wait_for(lambda: recorder.lookups == 1)
    sender.close()
