"""The UCX server's in-flight limits per endpoint and per tenant (``ucx.*_bytes_in_flight``):
admissions, waits, the lone transfer larger than a limit, and the deadline."""

from __future__ import annotations

import asyncio

import pytest
from harness.polling import apoll

from kvstore.protocol.ucx import UcxTransportError
from kvstore.server.ucx_endpoints import ClientEndpoint, InflightLimits


def _lane(name: bytes) -> ClientEndpoint:
    return ClientEndpoint(endpoint=None, client_id=name.ljust(16, b"-"))


async def test_a_lane_past_its_limit_waits_until_bytes_come_back() -> None:
    limits = InflightLimits(connection_bytes=100, tenant_bytes=1000)
    a, b = _lane(b"a"), _lane(b"b")
    await limits.admit("t", [a], [80], 1.0)
    waiting = asyncio.create_task(limits.admit("t", [a, b], [30, 10], 5.0))
    other = asyncio.create_task(limits.admit("t", [b], [90], 5.0))  # another lane: room
    await apoll(other.done, 10.0, "the other lane admitted")
    assert not waiting.done()  # its lane is full until the release below
    limits.release("t", [a], [80])
    await asyncio.wait_for(waiting, 5.0)
    assert limits.by_client[a.client_id] == 30 and limits.by_client[b.client_id] == 100
    assert limits.by_tenant["t"] == 130


async def test_a_tenant_past_its_limit_waits_and_others_do_not() -> None:
    limits = InflightLimits(connection_bytes=1000, tenant_bytes=100)
    await limits.admit("t", [_lane(b"a")], [90], 1.0)
    await limits.admit("u", [_lane(b"b")], [90], 1.0)  # another tenant's budget
    with pytest.raises(UcxTransportError, match="tenant_bytes_in_flight"):
        await limits.admit("t", [_lane(b"c")], [20], 0.05)
    assert limits.by_tenant == {"t": 90, "u": 90}  # the refused transfer charged nothing


async def test_one_transfer_larger_than_the_limits_moves_alone() -> None:
    limits = InflightLimits(connection_bytes=10, tenant_bytes=10)
    lane = _lane(b"a")
    await limits.admit("t", [lane], [500], 0.05)
    with pytest.raises(UcxTransportError):
        await limits.admit("t", [lane], [1], 0.05)
    limits.release("t", [lane], [500])
    assert not limits.by_client and not limits.by_tenant
