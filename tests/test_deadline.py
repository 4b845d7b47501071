"""``kvstore.deadline.within``: an await that returns at its deadline even when the awaited call
takes long to wind down after its cancellation (as redis-py's cluster pipeline does)."""

from __future__ import annotations

import asyncio
import time

import pytest
from harness.polling import apoll

from kvstore.deadline import within

# What a loaded 2-core box may add to a 0.1 s deadline (scheduling only).
SLACK_S = 0.4


async def slow_to_cancel(finished: list[str]) -> str:
    """Sleeps; once cancelled, takes another second to clean up (a close under its own timeout)."""
    try:
        await asyncio.sleep(10)  # sleep: the slow call (cancelled long before)
    except asyncio.CancelledError:
        await asyncio.sleep(1.0)  # sleep: its slow clean-up
        finished.append("cleaned up")
        raise
    return "never"


async def test_returns_at_the_deadline_whatever_the_cancelled_call_does() -> None:
    finished: list[str] = []
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        await within(slow_to_cancel(finished), 0.1)
    assert time.monotonic() - start < 0.1 + SLACK_S
    assert finished == []  # still cleaning up, in the background
    # wait_for, by contrast, waits for the clean-up: the overrun the issue saw.
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(slow_to_cancel([]), 0.1)
    assert time.monotonic() - start >= 1.0
    # The first call's clean-up ends in the background.
    await apoll(lambda: finished == ["cleaned up"], 30.0, "the clean-up")


async def test_an_outer_deadline_cancels_through_it_at_once() -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(within(slow_to_cancel([]), None), 0.1)
    assert time.monotonic() - start < 0.1 + SLACK_S


async def test_answers_and_errors_pass_through() -> None:
    async def answer() -> int:
        await asyncio.sleep(0)  # sleep: an answer that takes one loop turn
        return 7

    async def fail() -> None:
        raise ConnectionError("refused")

    assert await within(answer(), 1.0) == 7
    with pytest.raises(ConnectionError, match="refused"):
        await within(fail(), 1.0)
    with pytest.raises(TimeoutError):
        await within(answer(), 0)
