"""Retired Redis clients against a real redis-server: a call still running on a client that was
closed reopens a connection (redis-py reconnects on the next command), and ``RetiredClients``
closes it once more when that call ends, so nothing is left for the garbage collector (which
logged "Unclosed RedisCluster client" in the cluster failover test)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness.polling import poll
from harness.redis_server import RedisServer
from redis.asyncio import Redis

from kvstore.tiers.redis_retired import RetiredClients

NAME = "kvstore-retired-under-test"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path / "redis") as running:
        yield running


def connections(server: RedisServer) -> int:
    """Connections the client under test holds open, as the server sees them."""
    return sum(1 for entry in server.client().client_list() if entry.get("name") == NAME)


def client_for(server: RedisServer) -> Redis:
    return Redis.from_url(server.url, client_name=NAME)


async def close(client: Redis) -> None:
    await client.aclose()


class Straggler:
    """A call that was already under way when its client was swapped out: it has used the
    client once (:attr:`arrived` is set then), waits for :attr:`gate`, then uses it again."""

    def __init__(self) -> None:
        self.arrived = asyncio.Event()
        self.gate = asyncio.Event()

    async def __call__(self, client: Redis) -> None:
        await client.ping()
        self.arrived.set()
        await self.gate.wait()
        await client.ping()


async def under_way(straggler: Straggler, server: RedisServer) -> None:
    """Until the straggler's first command has been answered (closing the client before that
    would fail the command itself, not test what comes after), its connection still open."""
    await asyncio.wait_for(straggler.arrived.wait(), 10.0)
    assert connections(server) == 1


async def test_a_closed_client_reconnects_for_a_call_still_running(server: RedisServer) -> None:
    # The premise: closing is not enough while a call still runs on the client.
    client, straggler = client_for(server), Straggler()
    running = asyncio.create_task(straggler(client))
    await under_way(straggler, server)
    await client.aclose()
    straggler.gate.set()
    await running
    assert connections(server) == 1, "redis-py no longer reconnects a closed client"
    await client.aclose()


async def test_a_retired_client_is_closed_again_when_its_last_call_ends(
    server: RedisServer,
) -> None:
    retired = RetiredClients(close, timeout_s=5.0)
    client, straggler = client_for(server), Straggler()
    running = asyncio.create_task(retired.run(client, straggler))
    await under_way(straggler, server)
    await retired.retire(client)
    assert retired.waiting == 1
    straggler.gate.set()
    await running
    await asyncio.to_thread(
        poll, lambda: connections(server) == 0, 10.0, "the retired client closed again"
    )
    await asyncio.to_thread(poll, lambda: retired.waiting == 0, 10.0, "nothing left pending")


async def test_a_cancelled_call_counts_until_it_has_wound_down(server: RedisServer) -> None:
    retired = RetiredClients(close, timeout_s=5.0)
    client, straggler = client_for(server), Straggler()

    async def cancelled_late(c: Redis) -> None:
        try:
            await straggler(c)
        except asyncio.CancelledError:
            await c.ping()  # winding down still uses the client
            raise

    running = asyncio.create_task(retired.run(client, cancelled_late))
    await under_way(straggler, server)
    await retired.retire(client)
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    await asyncio.to_thread(poll, lambda: connections(server) == 0, 10.0, "closed after the call")


async def test_drain_closes_clients_still_in_use_at_shutdown(server: RedisServer) -> None:
    retired = RetiredClients(close, timeout_s=5.0)
    client, straggler = client_for(server), Straggler()
    running = asyncio.create_task(retired.run(client, straggler))
    await under_way(straggler, server)
    await retired.retire(client)
    await retired.drain()
    assert retired.waiting == 0
    running.cancel()
    await asyncio.gather(running, return_exceptions=True)
    await asyncio.to_thread(poll, lambda: connections(server) == 0, 10.0, "drained and closed")


async def test_a_client_without_calls_is_closed_once(server: RedisServer) -> None:
    retired = RetiredClients(close, timeout_s=5.0)
    client = client_for(server)
    await retired.run(client, lambda c: c.ping())
    await retired.retire(client)
    assert retired.waiting == 0
    await asyncio.to_thread(poll, lambda: connections(server) == 0, 10.0, "the client closed")
