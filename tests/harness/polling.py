"""Waiting for a condition with a deadline instead of sleeping a fixed time: on an idle machine
the wait ends as soon as the condition holds, on a loaded one (2 cores at load 10) it still
passes as long as the deadline is generous."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

import pytest

__all__ = ["apoll", "poll", "poll_value"]

T = TypeVar("T")


def poll(condition: Callable[[], object], within: float, what: str, every: float = 0.05) -> None:
    """Return once ``condition()`` is true; fail the test naming ``what`` after ``within`` s."""
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"{what} not within {within} s"
        time.sleep(every)


async def apoll(
    condition: Callable[[], object], within: float, what: str, every: float = 0.005
) -> None:
    """:func:`poll` on an event loop: the loop runs the other tasks between the checks."""
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"{what} not within {within} s"
        await asyncio.sleep(every)


def poll_value(
    check: Callable[[], T | None], what: str, within: float = 30.0, every: float = 0.5
) -> T:
    """Return the first true value of ``check()`` (a dict of figures, say: ``None`` until it is
    there); fail the test naming ``what`` after ``within`` s. For conditions slow to come true (an
    engine's next step), hence the longer default interval."""
    deadline = time.monotonic() + within
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what} within {within:.0f} s")
        time.sleep(every)
