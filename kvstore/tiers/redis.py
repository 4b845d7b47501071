"""The ``redis`` tier: blocks in a Redis server or Redis Cluster shared by every node.

Each block is one atomic Redis string, ``header ‖ payload`` (see :mod:`kvstore.block`), under
``key_prefix + key.hex()``, written with ``SET ... PX ttl``. A batch of reads is one ``MGET`` (split
per hash slot in cluster mode) and every value is verified with
:func:`kvstore.block.decode_value`, keyed MAC included: anyone able to write to Redis can change a
value but cannot sign one without the cluster's integrity secret, so a value that fails (forged,
old unkeyed format, rotted) is deleted, counted in ``corrupt_blocks`` and reported as a miss; it is
never served. Every node sharing the Redis needs the same integrity secrets. The MAC is computed
when a block is written (write-through or write-back) and verified on reads, in a worker thread for
batches over 64 KiB so that the event loop keeps serving. Batched writes and existence checks are
non-transactional pipelines.

The URL picks the client: ``redis://``, ``rediss://`` and ``unix://`` give one server
(:class:`redis.asyncio.Redis`); ``redis+cluster://host:port`` (or ``rediss+cluster://``) gives a
:class:`redis.asyncio.cluster.RedisCluster` bootstrapped from that node.

**Capacity.** Redis is shared, so no node knows how full it is. ``used`` counts what *this* node
wrote and has not seen disappear (approximate: other nodes, TTL expiry and Redis's own eviction
remove blocks behind its back; a read that misses a block this node wrote forgets it).
:meth:`RedisTier.write` never returns False for lack of room. Real eviction is Redis's own job:
run it with ``maxmemory`` and ``maxmemory-policy allkeys-lru``; the TTL bounds what a departed node
leaves behind.

**Outages.** The store must never wait on Redis longer than ``op_timeout_s``: every command runs
under :func:`asyncio.wait_for` and socket timeouts of the same length, and client-side retries are
off (a retry would multiply the wait). A connection error or timeout marks the tier *down*; while
down, reads are misses, writes are dropped (``writes_dropped``) and removes are skipped (the TTL
cleans up), all without touching the network. A background task pings a fresh client with capped,
jittered exponential backoff and marks the tier *up* again. Other Redis errors (e.g. ``OOM`` under
``maxmemory-policy noeviction``) fail that one call and leave the tier up. In cluster mode a
dead master takes the whole tier down until its replica is promoted: the reconnect client
bootstraps from every node seen so far (the URL's node may be the dead one) and counts as up once
every primary answers PING. No Redis trouble ever raises to the caller. The timeout covers a
whole batch, so size it for the largest batch a call moves (redis-py reads ~0.5 GB/s: 64 MiB take
~130 ms); too short a timeout turns a big read into an outage.

:meth:`RedisTier.write` returns False only for a dropped block; :attr:`RedisTier.up` lets a caller
skip the tier while it is down instead of evicting to make room that would not help.

The tier keeps no index across restarts (:meth:`RedisTier.scan` yields nothing);
:meth:`RedisTier.exists` answers a cluster-wide "who has this block" without moving payloads.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import random
from collections.abc import Awaitable, Callable, Iterator, Sequence
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

from kvstore.block import HEADER_BYTES, BlockHeader, CorruptBlockError, Keyring, decode_value
from kvstore.buffers import byte_view
from kvstore.tiers.base import Buffer, SharedTier, SizeLedger, StoredBlock

__all__ = ["RedisTier"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_Client = Redis | RedisCluster

_SINGLE_SCHEMES = ("redis://", "rediss://", "unix://")
_CLUSTER_SCHEMES = {"redis+cluster://": "redis://", "rediss+cluster://": "rediss://"}

# Errors that mean "Redis is unreachable or stalled": they mark the tier down. Cluster errors are
# here because a cluster that lost a primary or cannot be bootstrapped is just as unusable.
_OUTAGE_ERRORS = (
    ConnectionError,
    RedisTimeoutError,
    TimeoutError,
    OSError,
    ClusterError,
    RedisClusterException,
)


class _Failed(enum.Enum):
    FAILED = enum.auto()


_FAILED = _Failed.FAILED


class RedisTier(SharedTier):
    """Blocks as authenticated (MAC-carrying) values in a shared Redis or Redis Cluster."""

    name = "redis"

    def __init__(
        self,
        url: str,
        *,
        capacity: int,
        ttl_s: float | None = 3600,
        key_prefix: str = "kvstore:v1:",
        op_timeout_s: float = 0.5,
        reconnect_backoff_s: tuple[float, float] = (0.1, 5.0),
    ) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0 or None (no expiry), got {ttl_s}")
        if op_timeout_s <= 0:
            raise ValueError(f"op_timeout_s must be > 0, got {op_timeout_s}")
        low, high = reconnect_backoff_s
        if not 0 < low <= high:
            raise ValueError(
                f"reconnect_backoff_s must be (min, max) with 0 < min <= max, got "
                f"{reconnect_backoff_s}"
            )
        self.url = url
        self.capacity = capacity
        self.ttl_s = ttl_s
        self.key_prefix = key_prefix
        self.op_timeout_s = op_timeout_s
        self.reconnect_backoff_s = (low, high)
        self._prefix = key_prefix.encode()
        # PX (milliseconds) rather than EX so that fractional TTLs are honoured.
        self._ttl_ms = None if ttl_s is None else max(1, round(ttl_s * 1000))
        # Every cluster node a client has seen ("host", port): a fresh client bootstraps from
        # them too, not only from the URL's node, which may be the master that just died.
        self._cluster_nodes: dict[tuple[str, int], None] = {}
        self._client = self._make_client()
        self._up = True
        self._closed = False
        self._reconnect_task: asyncio.Task[None] | None = None
        self._ledger = SizeLedger(self.footprint)
        self.outages = 0
        #: Outages ended by the reconnect loop.
        self.reconnects = 0
        self.writes_dropped = 0
        self.reads_skipped = 0
        self.read_errors = 0
        self.corrupt_blocks = 0
        self.blocks_written = 0
        #: Blocks written with a retention TTL (:meth:`write_many`'s ``ttl_s``).
        self.retained_blocks_written = 0

    # -- client and outage handling --------------------------------------------------------

    def _make_client(self) -> _Client:
        """A new client for :attr:`url`; it connects lazily, on its first command."""
        options: dict[str, Any] = {
            "socket_timeout": self.op_timeout_s,
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
        """True while Redis answers; False from an outage until the reconnect loop succeeds."""
        return self._up and not self._closed

    async def _call(self, op: str, fn: Callable[[_Client], Awaitable[_T]]) -> _T | _Failed:
        """Run ``fn`` against the client within ``op_timeout_s``; ``_FAILED`` on Redis trouble."""
        client = self._client
        try:
            return await asyncio.wait_for(fn(client), self.op_timeout_s)
        except _OUTAGE_ERRORS as exc:
            self._mark_down(client, op, exc)
        except RedisError as exc:
            logger.warning("redis %s failed: %s", op, exc)
        return _FAILED

    def _mark_down(self, client: _Client, op: str, exc: BaseException) -> None:
        # A call still in flight on a client the reconnect loop already replaced must not take
        # the fresh one down again.
        if client is not self._client or not self._up or self._closed:
            return
        self._up = False
        self.outages += 1
        logger.warning(
            "redis tier down (%s during %s: %s); reconnecting in the background",
            type(exc).__name__,
            op,
            exc or f"no answer within {self.op_timeout_s} s",
        )
        self._reconnect_task = asyncio.get_running_loop().create_task(
            self._reconnect(), name="kvstore-redis-reconnect"
        )

    async def _reconnect(self) -> None:
        """Ping fresh clients with capped, jittered exponential backoff until one answers."""
        delay, cap = self.reconnect_backoff_s
        attempts = 0
        while not self._closed:
            # Jitter keeps the nodes of a cluster from reconnecting in lockstep after a restart.
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            attempts += 1
            # A fresh client drops every connection that may be half-read or stuck, and in
            # cluster mode rediscovers the topology.
            await self._discard(self._client)
            self._client = self._make_client()
            try:
                await asyncio.wait_for(self._ping(self._client), self.op_timeout_s)
            except (*_OUTAGE_ERRORS, RedisError) as exc:
                logger.debug("redis reconnect attempt %d failed: %s", attempts, exc)
                delay = min(delay * 2, cap)
                continue
            self._up = True
            self.reconnects += 1
            logger.warning("redis tier up again after %d attempt(s)", attempts)
            return

    async def _ping(self, client: _Client) -> None:
        if isinstance(client, RedisCluster):
            # Only the primaries: every slot needs one, while a dead node the cluster still
            # lists (a failed replica, the old master) must not keep the tier down.
            await client.ping(target_nodes=RedisCluster.PRIMARIES)
        else:
            await client.ping()

    async def _discard(self, client: _Client) -> None:
        if isinstance(client, RedisCluster):
            for node in client.get_nodes():
                self._cluster_nodes[(node.host, int(node.port))] = None
        try:
            await asyncio.wait_for(client.aclose(), self.op_timeout_s)
        except (*_OUTAGE_ERRORS, RedisError) as exc:
            logger.debug("closing a redis client failed: %s", exc)

    # -- Tier interface ---------------------------------------------------------------------

    def footprint(self, length: int) -> int:
        """The stored value's size, header plus payload (Redis's own overhead is not counted)."""
        return HEADER_BYTES + length

    @property
    def used(self) -> int:
        """Bytes this node wrote and has not seen disappear: an estimate, not Redis's usage."""
        return self._ledger.used

    def _name(self, key: bytes) -> bytes:
        return self._prefix + key.hex().encode()

    async def write(self, header: BlockHeader, payload: Buffer) -> bool:
        """Store one block with the TTL; False only when it was dropped (Redis down or failing)."""
        return (await self.write_many([(header, payload)]))[0]

    async def write_many(
        self, items: Sequence[tuple[BlockHeader, Buffer]], ttl_s: float | None = None
    ) -> list[bool]:
        """Store blocks in one pipelined round trip; per block, whether it was stored.

        ``ttl_s``: the blocks are retained (:mod:`kvstore.retention`): they expire no sooner than
        that, even where the tier's own TTL is shorter (counted in ``retained_blocks_written``).

        A block whose payload no longer matches the checksum it was put with is not signed nor
        stored (False, counted in ``corrupt_blocks``).
        """
        if not items:
            return []
        if not self.up:
            self.writes_dropped += len(items)
            return [False] * len(items)
        size = sum(header.length for header, _ in items)
        values = await _off_loop(size, _seal_all, list(items), self.keyring)
        chosen = [i for i, value in enumerate(values) if value is not None]
        payloads = [value for value in values if value is not None]
        if len(chosen) < len(items):
            self.corrupt_blocks += len(items) - len(chosen)
            logger.error(
                "refusing to store %d block(s) changed since their put", len(items) - len(chosen)
            )
        stored = [False] * len(items)
        if not chosen:
            return stored
        names = [self._name(items[i][0].key) for i in chosen]
        ttl_ms = self._ttl_ms
        if ttl_s and ttl_ms is not None:
            ttl_ms = max(ttl_ms, round(ttl_s * 1000))

        async def set_all(client: _Client) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for name, value in zip(names, payloads, strict=True):
                pipe.set(name, value, px=ttl_ms)
            return await pipe.execute(raise_on_error=False)

        results = await self._call("write", set_all)
        if results is _FAILED:
            self.writes_dropped += len(chosen)
            return stored
        for i, result in zip(chosen, results, strict=True):
            header = items[i][0]
            if isinstance(result, Exception):
                logger.warning("redis write of %s failed: %s", header.key.hex(), result)
                self.writes_dropped += 1
                continue
            self._ledger.add(header.key, header.length)
            self.blocks_written += 1
            if ttl_s:
                self.retained_blocks_written += 1
            stored[i] = True
        return stored

    async def read(self, keys: Sequence[bytes]) -> list[StoredBlock | None]:
        """Read a batch in one round trip; absent, corrupt or unreachable blocks are ``None``."""
        if not keys:
            return []
        if not self.up:
            self.reads_skipped += len(keys)
            return [None] * len(keys)
        names = [self._name(key) for key in keys]

        async def mget(client: _Client) -> list[Any]:
            if isinstance(client, RedisCluster):
                # MGET must not span hash slots; this splits it per slot and keeps the order.
                return await client.mget_nonatomic(names)
            return await client.mget(names)

        values = await self._call("read", mget)
        if values is _FAILED:
            self.read_errors += 1
            return [None] * len(keys)
        for key, value in zip(keys, values, strict=True):
            if value is None:
                # Expired, evicted by Redis or removed by another node: stop counting it.
                self._ledger.discard(key)
        size = sum(len(value) for value in values if value is not None)
        decoded = await _off_loop(size, _decode_all, list(keys), list(values), self.keyring)
        blocks: list[StoredBlock | None] = []
        corrupt: list[bytes] = []
        for key, block in zip(keys, decoded, strict=True):
            if isinstance(block, CorruptBlockError):
                logger.error("dropping corrupt redis block %s: %s", key.hex(), block)
                corrupt.append(key)
                blocks.append(None)
                continue
            blocks.append(block)
        if corrupt:
            self.corrupt_blocks += len(corrupt)
            await self.remove(corrupt)
        return blocks

    async def remove(self, keys: Sequence[bytes]) -> bool:
        """Delete blocks (``UNLINK``, freed off Redis's main thread); skipped while down.

        Always True: a block this node failed to unlink still expires with its TTL, and the
        shared tier is not indexed locally, so nothing is orphaned.
        """
        for key in keys:
            self._ledger.discard(key)
        if not keys or not self.up:
            return True
        names = [self._name(key) for key in keys]

        async def unlink(client: _Client) -> Any:
            # The cluster client splits a multi-key UNLINK per slot by itself.
            return await client.unlink(*names)

        await self._call("remove", unlink)
        return True

    async def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each block is in Redis now (from any node); all False while down."""
        if not keys or not self.up:
            return [False] * len(keys)
        names = [self._name(key) for key in keys]

        async def exists_all(client: _Client) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.exists(name)
            return await pipe.execute(raise_on_error=False)

        results = await self._call("exists", exists_all)
        if results is _FAILED:
            return [False] * len(keys)
        return [result == 1 for result in results]

    def scan(self) -> Iterator[BlockHeader]:
        """Nothing: the shared tier's contents are not indexed locally (see :meth:`exists`)."""
        return iter(())

    def stats(self) -> dict[str, int]:
        """Capacity, this node's estimate of usage, availability and error counters."""
        return {
            "capacity": self.capacity,
            "used": self._ledger.used,
            "blocks": len(self._ledger),
            "up": int(self.up),
            "outages": self.outages,
            "reconnects": self.reconnects,
            "blocks_written": self.blocks_written,
            "retained_blocks_written": self.retained_blocks_written,
            "writes_dropped": self.writes_dropped,
            "reads_skipped": self.reads_skipped,
            "read_errors": self.read_errors,
            "corrupt_blocks": self.corrupt_blocks,
        }

    async def close(self) -> None:
        """Stop reconnecting and close the client's connections; the tier is unusable after."""
        self._closed = True
        task, self._reconnect_task = self._reconnect_task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await self._discard(self._client)


# Below this many payload bytes a batch is sealed or verified on the event loop: a MAC over 64 KiB
# takes about 45 µs, about what handing the work to a thread and back costs.
_OFF_LOOP_BYTES = 64 * 1024


async def _off_loop(size: int, fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(*args)``, in a worker thread when it covers ``size`` >= :data:`_OFF_LOOP_BYTES`."""
    if size < _OFF_LOOP_BYTES:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


def _seal_all(
    items: list[tuple[BlockHeader, Buffer]], keyring: Keyring | None
) -> list[bytes | None]:
    """Per block, ``header ‖ payload`` signed for Redis, or ``None`` if it fails its checksum."""
    values: list[bytes | None] = []
    for header, payload in items:
        # Copy first, then check and sign the copy: the bytes stored are the bytes checked.
        data = bytes(byte_view(payload))
        try:
            # One value per block keeps a block atomic: a reader sees all of it or none of it.
            values.append(b"".join((header.seal(data, keyring), data)))
        except CorruptBlockError as exc:
            logger.error("not storing block %s in redis: %s", header.key.hex(), exc)
            values.append(None)
    return values


def _decode_all(
    keys: list[bytes], values: list[Any], keyring: Keyring | None
) -> list[StoredBlock | CorruptBlockError | None]:
    """Per value, the verified block, the reason it failed, or ``None`` where there was none."""
    out: list[StoredBlock | CorruptBlockError | None] = []
    for key, value in zip(keys, values, strict=True):
        if value is None:
            out.append(None)
            continue
        try:
            header, payload = decode_value(key, value, keyring)
        except CorruptBlockError as exc:
            out.append(exc)
            continue
        out.append(StoredBlock(header, payload))
    return out
