"""The server's in-flight byte budget: refusals, waits, and wake-ups when bytes come back."""

from __future__ import annotations

import asyncio

import pytest
from harness.polling import apoll

from kvstore.server.budget import InflightBudget


async def test_try_take_refuses_past_the_limit_and_charges_nothing() -> None:
    budget = InflightBudget(10)
    assert budget.try_take(6)
    assert not budget.try_take(5)
    assert budget.in_use == 6
    budget.give(6)
    assert budget.try_take(10)


async def test_take_waits_for_room_and_caps_at_the_limit() -> None:
    budget = InflightBudget(10)
    assert budget.try_take(8)
    waiting = asyncio.create_task(budget.take(5))
    huge = asyncio.create_task(budget.take(1000))  # waits for an idle budget, not forever
    await apoll(lambda: len(budget._waiters) == 2, 10.0, "both takes waiting for room")
    assert not waiting.done() and not huge.done()
    budget.give(8)
    assert await waiting == 5
    budget.give(5)
    assert await huge == 10
    budget.give(10)
    assert budget.in_use == 0


async def test_a_cancelled_waiter_charges_nothing() -> None:
    budget = InflightBudget(4)
    assert budget.try_take(4)
    waiter = asyncio.create_task(budget.take(2))
    await apoll(lambda: len(budget._waiters) == 1, 10.0, "the take waiting for room")
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    budget.give(4)
    assert budget.in_use == 0


def test_budget_must_be_positive() -> None:
    with pytest.raises(ValueError, match="> 0 bytes"):
        InflightBudget(0)
