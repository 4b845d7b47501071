"""``redis.max_connections`` against a real redis-server and a real Redis Cluster: a link opens
that many connections to each server on its first call and never more, however many calls are
in flight; a call that finds every connection busy until its deadline fails alone (the tier
stays up); a slot comes back however its call ends."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness.polling import apoll
from harness.redis_cluster import RedisCluster
from harness.redis_server import RedisServer

from kvstore.tiers.redis_link import FAILED, RedisLink
from kvstore.tiers.redis_slots import MIN_CALL_S, ConnectionSlots


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path / "redis") as running:
        yield running


def others(client: Any, *, calls_only: bool = False) -> int:
    """Connections a server has open besides the one asking (``client``, a redis-py client).
    ``calls_only``: not counting a cluster client's bootstrap connection, which keeps the
    ``CLUSTER SLOTS`` it learnt the topology with, one per link beside the pools."""
    me = client.client_id()
    return sum(
        1
        for entry in client.client_list()
        if int(entry["id"]) != me and not (calls_only and entry["cmd"] == "cluster|slots")
    )


def slow(seconds: float):  # type: ignore[no-untyped-def]
    """A command that holds its connection for ``seconds``: BLPOP on a list nobody fills."""
    return lambda client: client.blpop(["kvstore-slots-never-filled"], timeout=seconds)


async def test_the_link_opens_its_connections_up_front_and_a_burst_opens_no_more(
    server: RedisServer,
) -> None:
    inspector = server.client()
    link = RedisLink(server.url, 5.0, (0.1, 1.0), max_connections=3)
    try:
        assert await link.call("ping", lambda c: c.ping()) is True
        # Opened in the background on the first call: PINGs on every free slot.
        await apoll(lambda: others(inspector) == 3, 10.0, "3 connections opened up front")
        began = time.monotonic()
        answers = await asyncio.gather(*(link.call("wait", slow(0.2)) for _ in range(12)))
        took = time.monotonic() - began
        assert answers == [None] * 12  # every call answered: BLPOP timing out is None
        # redis-py keeps every connection it ever opened: what is open now is the peak.
        # Without the slots the 12 concurrent BLPOPs would have left 12.
        assert others(inspector) == 3
        assert took >= 0.75, f"12 calls of 0.2 s on 3 connections took {took:.2f} s"
        assert link.up and link.slots.in_use("") == 0
    finally:
        await link.close()
    await apoll(lambda: others(inspector) == 0, 10.0, "the link's connections closed")


async def test_a_call_that_finds_no_free_connection_in_time_fails_alone(
    server: RedisServer,
) -> None:
    link = RedisLink(server.url, 5.0, (0.1, 1.0), max_connections=1)
    try:
        holder = asyncio.ensure_future(link.call("hold", slow(1.0)))
        await apoll(lambda: link.slots.in_use("") == 1, 10.0, "the one slot taken")
        began = time.monotonic()
        late = await link.call("late", lambda c: c.ping(), deadline=time.monotonic() + 0.2)
        assert late is FAILED
        assert time.monotonic() - began < 0.9, "it waited past its own deadline"
        assert link.slots.waits_timed_out == 1
        assert link.up and link.outages == 0, "a busy queue is not a Redis outage"
        assert await holder is None
        assert await link.call("ping", lambda c: c.ping()) is True
    finally:
        await link.close()


class LateSlots(ConnectionSlots):
    """Stand-in for a race that real timing hits only now and then: the slot comes free
    ``spare`` seconds before the caller's deadline (below 0: after it), so ``take`` answers True
    with (next to) no time left."""

    def __init__(self, per_node: int, spare: float) -> None:
        super().__init__(per_node)
        self.spare = spare

    async def take(self, node: str, timeout_s: float) -> bool:
        # sleep: spend the wait up to the moment the slot comes free, as the race does
        await asyncio.sleep(max(0.0, timeout_s - self.spare))
        return await self.take_free(node)


@pytest.mark.parametrize("spare", [-0.01, MIN_CALL_S / 2], ids=["after", "just-before"])
async def test_a_slot_that_comes_free_at_the_deadline_is_a_wait_that_timed_out(
    server: RedisServer, spare: float
) -> None:
    link = RedisLink(server.url, 5.0, (0.1, 1.0), max_connections=1)
    link.slots = LateSlots(1, spare)
    try:
        late = await link.call("late", lambda c: c.ping(), deadline=time.monotonic() + 0.05)
        assert late is FAILED
        assert link.slots.waits_timed_out == 1 and link.slots.in_use("") == 0
        assert link.up and link.outages == 0, "nothing was sent: Redis did not fail"
    finally:
        await link.close()


async def test_a_slot_that_comes_free_in_time_is_used(server: RedisServer) -> None:
    link = RedisLink(server.url, 5.0, (0.1, 1.0), max_connections=1)
    link.slots = LateSlots(1, spare=2.0)  # free 2 s before the deadline: time for the call
    try:
        assert await link.call("ping", lambda c: c.ping(), deadline=time.monotonic() + 2.5) is True
        assert link.slots.waits_timed_out == 0 and link.slots.in_use("") == 0
    finally:
        await link.close()


async def test_each_cluster_primary_gets_max_connections(tmp_path: Path) -> None:
    with RedisCluster(tmp_path / "cluster", masters=3, replicas=0) as cluster:
        inspectors = [node.client() for node in cluster.nodes]
        link = RedisLink(cluster.url, 5.0, (0.1, 1.0), max_connections=2)
        try:
            names = [b"kvstore-slots-%d" % i for i in range(64)]
            replies = await link.pipelined("set", names, lambda pipe, name: pipe.set(name, b"v"))
            assert replies == [True] * len(names)
            await apoll(
                lambda: [others(c, calls_only=True) for c in inspectors] == [2, 2, 2],
                10.0,
                "2 connections per primary",
            )
            opened = [others(c) for c in inspectors]
            for _ in range(5):  # concurrent batches touching every primary
                await asyncio.gather(
                    *(
                        link.pipelined("get", names, lambda pipe, name: pipe.get(name))
                        for _ in range(8)
                    )
                )
            assert [others(c) for c in inspectors] == opened
        finally:
            await link.close()


async def test_a_slot_comes_back_however_its_call_ends() -> None:
    slots = ConnectionSlots(2)
    assert await slots.take("a", 0.0) and await slots.take("a", 0.0)
    assert not await slots.take("a", 0.05), "both slots taken"
    assert slots.waits_timed_out == 1

    async def fails() -> None:
        raise RuntimeError("the call failed")

    failing = asyncio.ensure_future(fails())
    slots.hold_until_done("a", failing)
    never_started = asyncio.ensure_future(asyncio.Event().wait())
    slots.hold_until_done("a", never_started)
    never_started.cancel()  # cancelled before its first step: its own finally would not run
    with pytest.raises(RuntimeError):
        await failing
    with pytest.raises(asyncio.CancelledError):
        await never_started
    # Done callbacks run on the loop's next turn after the task ends.
    await apoll(lambda: slots.in_use("a") == 0, 10.0, "both slots given back")
    assert await slots.take_free("a") and await slots.take_free("a")
    assert not await slots.take_free("a")
    assert slots.in_use("b") == 0 and await slots.take_free("b"), "servers have their own slots"
    with pytest.raises(ValueError, match="per_node must be >= 1"):
        ConnectionSlots(0)
