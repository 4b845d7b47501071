"""``RedisLink``: the client of the shared tier, its deadline on every call, and its outages.

Every call runs under :func:`kvstore.deadline.within` (it returns at the deadline even when
redis-py takes long to wind a cancelled call down), a deadline that grows with the bytes the call
moves (:mod:`kvstore.tiers.redis_rate`: ``op_timeout_s`` for a call moving few bytes, up to
``max_timeout_s``), with client-side retries off (a retry would multiply the wait). Sockets time
out connecting after ``op_timeout_s`` and reading after ``max_timeout_s`` (a large reply arrives
over one read, which the call's own deadline bounds). A connection error or timeout marks
the link *down* (a single server) or one cluster primary down (only the keys of its slots are
skipped); a background task pings fresh clients with capped, jittered exponential backoff and
swaps one in once it answers: for a cluster, once every primary answers PING, which is when a
replica has taken over a dead master's slots. Other Redis errors (e.g. ``OOM``) fail that one
call and leave the link up.

:meth:`RedisLink.pipelined` splits a batch by the primary serving each key's slot and sends each
primary its own pipeline, concurrently, within one deadline; per-key refusals while the cluster
reshapes (``CLUSTERDOWN`` while a failover is decided) come back as exceptions for those keys.
Writes to a primary that has a replica end with ``WAIT 1``: Redis Cluster replicates
asynchronously, and a write counts as stored only once a replica has it too, so a master's death
cannot take acknowledged writes with it (they are refused, and the store sends them again).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import (
    ClusterError,
    ConnectionError,
    RedisClusterException,
    RedisError,
)
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvstore.deadline import within
from kvstore.tiers.redis_rate import TransferRate
from kvstore.tiers.redis_retired import RetiredClients
from kvstore.tiers.redis_slots import ConnectionSlots

__all__ = ["FAILED", "SKIPPED", "Failed", "RedisLink"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_Client = Redis | RedisCluster

_SINGLE_SCHEMES = ("redis://", "rediss://", "unix://")
_CLUSTER_SCHEMES = {"redis+cluster://": "redis://", "rediss+cluster://": "rediss://"}

# Errors that mean "Redis is unreachable or stalled": they mark the link (or the cluster node)
# down. Cluster errors are here because a cluster that cannot be bootstrapped is unusable.
_OUTAGE_ERRORS = (
    ConnectionError,
    RedisTimeoutError,
    TimeoutError,
    OSError,
    ClusterError,
    RedisClusterException,
)


class Failed(enum.Enum):
    """Why a call has no reply."""

    FAILED = enum.auto()
    SKIPPED = enum.auto()


#: The call failed (an outage, a timeout, a Redis error): no reply.
FAILED = Failed.FAILED
#: Not sent: the cluster node serving the key is down.
SKIPPED = Failed.SKIPPED

# Fewest seconds between two fresh views of the cluster asked for by unacknowledged writes.
_REFRESH_EVERY_S = 1.0

# A client and the positions of a batch's names by the cluster primary serving them.
_Groups = tuple[_Client, dict[str, list[int]]]


class RedisLink:
    """One Redis or Redis Cluster reached through :attr:`url`, with outage handling."""

    def __init__(
        self,
        url: str,
        op_timeout_s: float,
        reconnect_backoff_s: tuple[float, float],
        *,
        max_timeout_s: float | None = None,
        min_rate: float = 4 * 1024**2,
        max_connections: int = 4,
    ) -> None:
        self.url = url
        self.op_timeout_s = op_timeout_s
        self.max_timeout_s = op_timeout_s if max_timeout_s is None else max_timeout_s
        #: The deadline of a call by the bytes it moves, and the rate measured on this link.
        self.rate = TransferRate(op_timeout_s, self.max_timeout_s, min_rate)
        self.reconnect_backoff_s = reconnect_backoff_s
        # Every cluster node a client has seen ("host", port): a fresh client bootstraps from
        # them too, not only from the URL's node, which may be the master that just died.
        self._cluster_nodes: dict[tuple[str, int], None] = {}
        # Clients swapped out while calls still run on them: closed again once those end.
        self._retired = RetiredClients(_close, op_timeout_s)
        #: Calls in flight, and so connections open, per Redis server (``redis.max_connections``).
        self.slots = ConnectionSlots(max_connections)
        self._client = self._make_client()
        # The client whose connections were last opened up front, and that task.
        self._filled: _Client | None = None
        self._filling: asyncio.Task[None] | None = None
        self._up = True
        # Cluster primaries ("host:port") that stopped answering: their keys are skipped.
        self._down_nodes: dict[str, None] = {}
        self._closed = False
        self._reconnect_task: asyncio.Task[None] | None = None
        #: Whole-link outages (a single server, or a cluster that could not be reached at all).
        self.outages = 0
        #: Cluster primaries that stopped answering while the rest of the cluster served.
        self.node_outages = 0
        #: Outages ended by the reconnect loop.
        self.reconnects = 0
        #: Writes a master took but no replica acknowledged in time (refused, sent again).
        self.unreplicated = 0
        self._refreshed_at = 0.0
        # Calls given up at their deadline and still winding down (awaited by close()).
        self._abandoned: set[asyncio.Future[Any]] = set()

    def _make_client(self) -> _Client:
        """A new client for :attr:`url`; it connects lazily, on its first command."""
        options: dict[str, Any] = {
            "socket_timeout": self.max_timeout_s,
            "socket_connect_timeout": self.op_timeout_s,
            # No client-side retries: one attempt per call, and the reconnect loop does the rest.
            "retry": Retry(NoBackoff(), 0),
        }
        for scheme, plain in _CLUSTER_SCHEMES.items():
            if self.url.startswith(scheme):
                known = [ClusterNode(host, port) for host, port in self._cluster_nodes]
                return RedisCluster.from_url(
                    plain + self.url[len(scheme) :], startup_nodes=known, **options
                )
        if self.url.startswith(_SINGLE_SCHEMES):
            return Redis.from_url(self.url, **options)
        allowed = ", ".join([*_SINGLE_SCHEMES, *_CLUSTER_SCHEMES])
        raise ValueError(f"unsupported Redis URL {self.url!r}; use one of {allowed}")

    @property
    def up(self) -> bool:
        """True while Redis answers; False from an outage until the reconnect loop succeeds.

        With Redis Cluster, a dead primary leaves the tier up: only its keys are skipped."""
        return self._up and not self._closed

    @property
    def cluster(self) -> bool:
        """Whether :attr:`url` names a Redis Cluster."""
        return self.url.startswith(tuple(_CLUSTER_SCHEMES))

    @property
    def down_nodes(self) -> list[str]:
        """Cluster primaries (``host:port``) whose keys are skipped until the reconnect loop
        finds every slot served again."""
        return list(self._down_nodes)

    async def call(
        self,
        op: str,
        fn: Callable[[_Client], Awaitable[_T]],
        *,
        client: _Client | None = None,
        node: str = "",
        deadline: float | None = None,
        size: int = 0,
    ) -> _T | Failed:
        """Run ``fn`` against the client until ``deadline`` (default: what a call moving ``size``
        bytes may take, from now); ``FAILED`` on Redis trouble. An outage on a cluster ``node``
        marks only that node down."""
        client = self._client if client is None else client
        started = time.monotonic()
        timeout = self.rate.timeout(size) if deadline is None else deadline - started
        # Waiting for a slot is this node's own queue, not Redis failing: no outage, also where
        # the slot comes free with (next to) no time left (``within`` would call that one).
        left = await self.slots.take_until(node, started + timeout)
        if left is None:
            logger.debug("redis %s: no free connection to %r in %.3f s", op, node, timeout)
            return FAILED
        task = asyncio.ensure_future(self._retired.run(client, fn))
        self.slots.hold_until_done(node, task)
        self._fill_soon(client)
        try:
            return await within(task, left, self._abandoned)
        except _OUTAGE_ERRORS as exc:
            if isinstance(exc, TimeoutError) and deadline is None:
                self.rate.missed(size, time.monotonic() - started)
            self._mark_down(client, op, exc, node)
        except RedisError as exc:
            logger.warning("redis %s failed: %s", op, exc)
        return FAILED

    def _fill_soon(self, client: _Client) -> None:
        """Open ``client``'s connections up front, once per client, in the background."""
        if client is not self._client or self._closed or self._filled is client:
            return
        self._filled = client
        self._filling = asyncio.get_running_loop().create_task(
            self._fill(client), name="kvstore-redis-open-connections"
        )

    async def _fill(self, client: _Client) -> None:
        """Open every free slot's connection to each server now (a PING each, concurrently).

        Then a node keeps ``max_connections`` sockets per server from its first call on, whatever
        its load did since: a fixed count an operator can plan for, and a burst does not wait for
        connection set-ups. A cluster client learns its primaries first. Best effort: a server
        that does not answer is found by the calls themselves."""
        servers: list[tuple[str, Any]] = [("", None)]
        if isinstance(client, RedisCluster):
            if not await self._learn_slots(client, time.monotonic() + self.op_timeout_s):
                return
            servers = [(primary.name, primary) for primary in client.get_primaries()]
        pings: list[asyncio.Future[Any]] = []
        for name, server in servers:
            while await self.slots.take_free(name):
                task = asyncio.ensure_future(self._retired.run(client, _pinger(server)))
                self.slots.hold_until_done(name, task)
                pings.append(task)
        outcomes = await asyncio.gather(
            *(within(task, self.op_timeout_s, self._abandoned) for task in pings),
            return_exceptions=True,
        )
        failed = [o for o in outcomes if isinstance(o, BaseException)]
        if failed:
            logger.debug("opening redis connections: %d of %d failed", len(failed), len(pings))

    def _mark_down(self, client: _Client, op: str, exc: BaseException, node: str = "") -> None:
        # A call still in flight on a client the reconnect loop already replaced must not take
        # the fresh one down again.
        if client is not self._client or self._closed:
            return
        reason = exc or f"no answer within {self.op_timeout_s} s"
        if node:
            if node in self._down_nodes or not self._up:
                return
            self._down_nodes[node] = None
            self.node_outages += 1
            logger.warning(
                "redis cluster node %s down (%s during %s: %s); its keys are skipped until "
                "every slot is served again",
                node,
                type(exc).__name__,
                op,
                reason,
            )
        else:
            if not self._up:
                return
            self._up = False
            self.outages += 1
            logger.warning(
                "redis tier down (%s during %s: %s); reconnecting in the background",
                type(exc).__name__,
                op,
                reason,
            )
        if self._reconnect_task is None or self._reconnect_task.done():
            self._reconnect_task = asyncio.get_running_loop().create_task(
                self._reconnect(), name="kvstore-redis-reconnect"
            )

    async def _reconnect(self) -> None:
        """Ping fresh clients with capped, jittered exponential backoff until one answers, then
        swap it in (the client in use keeps serving healthy cluster nodes meanwhile)."""
        delay, cap = self.reconnect_backoff_s
        attempts = 0
        while not self._closed:
            # Jitter keeps the nodes of a cluster from reconnecting in lockstep after a restart.
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            attempts += 1
            if isinstance(self._client, RedisCluster):
                self._remember_nodes(self._client)
            # A fresh client has no connection that may be half-read or stuck, and in cluster
            # mode rediscovers the topology.
            candidate = self._make_client()
            try:
                await within(
                    self._retired.run(candidate, self._ping), self.op_timeout_s, self._abandoned
                )
            except (*_OUTAGE_ERRORS, RedisError) as exc:
                logger.debug("redis reconnect attempt %d failed: %s", attempts, exc)
                await self._discard(candidate)
                # While only some cluster nodes are down the rest serves, and a promoted replica
                # takes over within seconds: look again at least every second.
                delay = min(delay * 2, cap if not self._up else min(cap, 1.0))
                continue
            old, self._client = self._client, candidate
            whole, partial = not self._up, bool(self._down_nodes)
            self._up = True
            self._down_nodes.clear()
            if whole or partial:
                self.reconnects += 1
                logger.warning(
                    "redis %s up again after %d attempt(s)",
                    "tier" if whole else "cluster (every slot served)",
                    attempts,
                )
            await self._discard(old)
            return

    def _refresh(self) -> None:
        """Swap in a fresh client (a new view of the cluster) in the background, at most once
        per :data:`_REFRESH_EVERY_S`."""
        now = time.monotonic()
        if self._closed or now - self._refreshed_at < _REFRESH_EVERY_S:
            return
        self._refreshed_at = now
        if self._reconnect_task is None or self._reconnect_task.done():
            self._reconnect_task = asyncio.get_running_loop().create_task(
                self._reconnect(), name="kvstore-redis-refresh"
            )

    async def _ping(self, client: _Client) -> None:
        if isinstance(client, RedisCluster):
            # Only the primaries: every slot needs one, while a dead node the cluster still
            # lists (a failed replica, the old master) must not keep the tier down.
            await client.ping(target_nodes=RedisCluster.PRIMARIES)
        else:
            await client.ping()

    def _remember_nodes(self, client: RedisCluster) -> None:
        for node in client.get_nodes():
            self._cluster_nodes[(node.host, int(node.port))] = None

    async def _discard(self, client: _Client) -> None:
        if isinstance(client, RedisCluster):
            self._remember_nodes(client)
        await self._retired.retire(client)

    async def _learn_slots(self, client: RedisCluster, deadline: float) -> bool:
        """Have ``client`` know which primary serves each slot; False if Redis did not say in
        time. Only a client that has not learnt the slots yet (or that redis-py marked for a
        refresh) needs the round trip."""
        if not client._initialize:
            return True
        ready = await self.call(
            "connect", lambda c: c.initialize(), client=client, deadline=deadline
        )
        return not isinstance(ready, Failed)

    async def _split(self, names: Sequence[bytes], deadline: float) -> _Groups | Failed:
        """The client to use and the positions of ``names`` by the primary serving them (one
        group, ``""``, for a single server)."""
        client = self._client
        if not isinstance(client, RedisCluster):
            return client, {"": list(range(len(names)))}
        if not await self._learn_slots(client, deadline):
            return FAILED
        groups: dict[str, list[int]] = {}
        for position, name in enumerate(names):
            try:
                node = client.nodes_manager.get_node_from_slot(client.keyslot(name))
            except RedisClusterException:  # a slot no primary serves (yet): FAILED
                continue
            groups.setdefault(node.name, []).append(position)
        return client, groups

    async def pipelined(
        self,
        op: str,
        names: Sequence[bytes],
        command: Callable[[Any, bytes], object],
        *,
        replicated: bool = False,
        size: int = 0,
    ) -> list[Any]:
        """Per name, the reply to ``command(pipeline, name)`` (an exception where that command
        failed), :data:`SKIPPED` where its cluster node is down, or :data:`FAILED` where the
        call failed or did not answer in time.

        ``replicated`` (writes to a cluster): a primary that has a replica must also have it
        acknowledge the writes (``WAIT 1``) before its replies count. Redis Cluster replicates
        asynchronously; without it, writes a master took in its last moments before dying are
        lost in the failover with nobody knowing. A primary that dies first fails the whole
        call (the writes are then sent again); where no replica acknowledges in time the
        replies are :data:`FAILED` too (counted in :attr:`unreplicated`), and a fresh view of
        the cluster is taken, which leaves out a replica the cluster has flagged failed.

        ``size``: the bytes the batch moves (sent and expected back), which set its deadline
        (:mod:`kvstore.tiers.redis_rate`); a batch that runs out of it lowers the rate assumed.
        """
        started = time.monotonic()
        deadline = started + self.rate.timeout(size)
        replies: list[Any] = [FAILED] * len(names)
        split = await self._split(names, deadline)
        if isinstance(split, Failed):
            return replies
        client, groups = split

        async def run(node: str, positions: list[int]) -> None:
            if node in self._down_nodes:
                for position in positions:
                    replies[position] = SKIPPED
                return
            primary = _replicated_primary(client, names[positions[0]]) if replicated else None

            def send(c: _Client) -> Awaitable[list[Any]]:
                pipe = c.pipeline(transaction=False)
                for position in positions:
                    command(pipe, names[position])
                if primary is not None:
                    # Half the time left: the replica's answer must come back within the call.
                    wait_ms = max(1, int((deadline - time.monotonic()) * 500))
                    pipe.execute_command("WAIT", 1, wait_ms, target_nodes=primary)
                return pipe.execute(raise_on_error=False)

            answers = await self.call(op, send, client=client, node=node, deadline=deadline)
            if isinstance(answers, Failed):
                return
            if primary is not None:
                acknowledged = answers.pop()
                if not isinstance(acknowledged, int) or acknowledged < 1:
                    # The writes are on the master only: not counted, so they are sent again.
                    # A replica that stopped acknowledging may be dead; a fresh view of the
                    # cluster leaves it out once the cluster has flagged it failed.
                    logger.debug("%s: no replica acknowledged (%s)", node, acknowledged)
                    self.unreplicated += len(positions)
                    self._refresh()
                    return
            for position, answer in zip(positions, answers, strict=True):
                replies[position] = answer

        await asyncio.gather(*(run(node, positions) for node, positions in groups.items()))
        if size and time.monotonic() >= deadline and FAILED in replies:
            self.rate.missed(size, time.monotonic() - started)
        return replies

    async def close(self) -> None:
        """Stop reconnecting and close the client's connections."""
        self._closed = True
        for task in (self._reconnect_task, self._filling):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._reconnect_task = self._filling = None
        if self._abandoned:
            await asyncio.wait(set(self._abandoned), timeout=self.op_timeout_s)
        await self._discard(self._client)
        if self._abandoned:
            # Sockets read for up to max_timeout_s (a large reply): a call still stuck in one
            # ends once its connection is closed, which it was just now.
            await asyncio.wait(set(self._abandoned), timeout=self.op_timeout_s)
        await self._retired.drain()


async def _close(client: _Client) -> None:
    """Close every connection of ``client``.

    ``RedisCluster.aclose()`` does nothing on a client that redis-py marked for
    re-initialization, which it does on any connection error: a reconnect attempt whose PING
    met the dead master. Its nodes' sockets then stayed open until garbage collection logged
    ``Unclosed ClusterNode object`` (3-6 times per failover), so the nodes are closed here too.
    """
    await client.aclose()
    if isinstance(client, RedisCluster):
        await client.nodes_manager.aclose()
        await client.nodes_manager.aclose("startup_nodes")


def _pinger(server: ClusterNode | None) -> Callable[[Any], Awaitable[Any]]:
    """A call that PINGs ``server`` (a cluster primary), or the one server (``None``)."""
    if server is None:
        return lambda client: client.ping()
    return lambda client: client.ping(target_nodes=server)


def _replicated_primary(client: _Client, name: bytes) -> ClusterNode | None:
    """The cluster primary serving ``name`` if the client's view of the cluster gives it a
    (non-failed) replica; ``None`` for a single server or a primary without one."""
    if not isinstance(client, RedisCluster):
        return None
    serving = client.nodes_manager.slots_cache.get(client.keyslot(name), [])
    return serving[0] if len(serving) > 1 else None
