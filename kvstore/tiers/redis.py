"""The ``redis`` tier: blocks in a Redis server or Redis Cluster shared by every node.

Each block is one atomic Redis string, ``header ‖ payload`` (see :mod:`kvstore.block`), under
``key_prefix + key.hex()``, written with ``SET ... PX ttl``. A batch of reads is one ``MGET`` (in
cluster mode, one pipeline of ``GET`` per master) and every value is verified with
:func:`kvstore.block.decode_value`, keyed MAC included: anyone able to write to Redis can change a
value but cannot sign one without the cluster's integrity secret, so a value that fails (forged, old
unkeyed format, rotted) is deleted, counted in ``corrupt_blocks`` and reported as a miss; it is
never served. A value in a header version newer than this release reads (a later release's, during a
rolling upgrade or after a downgrade: :mod:`kvstore.formats`) is a miss too, counted in
``newer_format_blocks``, and left in Redis for the nodes that read it. Every node sharing the Redis
needs the same integrity secrets. The MAC is computed when a block is written (write-through or
write-back) and verified on reads, in a worker thread for batches over 64 KiB so that the event loop
keeps serving. Batched writes and existence checks are non-transactional pipelines.

The URL picks the client: ``redis://``, ``rediss://`` and ``unix://`` give one server
(:class:`redis.asyncio.Redis`); ``redis+cluster://host:port`` (or ``rediss+cluster://``) gives a
:class:`redis.asyncio.cluster.RedisCluster` bootstrapped from that node.

**Capacity.** Redis is shared, so no node knows how full it is. ``used`` counts what *this* node
wrote and has not seen disappear (approximate: other nodes, TTL expiry and Redis's own eviction
remove blocks behind its back; a read that misses a block this node wrote forgets it).
:meth:`RedisTier.write` never returns False for lack of room. Real eviction is Redis's own job:
run it with ``maxmemory`` and ``maxmemory-policy allkeys-lru``; the TTL bounds what a departed node
leaves behind.

**Outages.** The store never waits on Redis longer than a call's deadline, which grows with the
bytes the call moves (:mod:`kvstore.tiers.redis_rate`: ``op_timeout_s`` for a call moving few bytes,
plus the bytes over the rate the link is trusted or measured to keep up, at most
``op_timeout_max_s``; the measured rate is ``rate_bytes_per_s`` in the stats): every command runs
under :func:`kvstore.deadline.within` (which returns at the deadline even when redis-py takes long
to wind a cancelled call down) and socket timeouts no shorter, and client-side retries are
off (a retry would multiply the wait). A connection error or timeout marks the tier *down*; while
down, reads are misses, writes fail at once (``writes_dropped``: the store keeps them for
re-sending, see :mod:`kvstore.store.shared_writer`) and removes are skipped (the TTL cleans up), all
without touching the network. A background task pings a fresh client with capped, jittered
exponential backoff and marks the tier *up* again. Other Redis errors (e.g. ``OOM`` under
``maxmemory-policy noeviction``) fail that one call and leave the tier up. No Redis trouble ever
raises to the caller. So a large batch over a slow link is slow, not an outage, while a stalled
Redis still fails a small call (PING, EXISTS) within ``op_timeout_s``.

**Redis Cluster.** A batch is split by the primary that serves each key's slot and each primary
gets its own pipeline, concurrently, within the one deadline. A primary that stops answering
marks only *its* keys down (``node_outages``): they are misses and failed writes while the rest
of the cluster keeps serving. The reconnect loop then bootstraps fresh clients from every node
seen so far (the URL's node may be the dead one) and swaps one in once every primary answers
PING, which is when a replica has taken over. Per-key refusals while the cluster reshapes
(``CLUSTERDOWN`` while a failover is decided, ``MOVED`` redirections past redis-py's own) fail
only those keys. A write to a master with a replica counts only once the replica acknowledged
it (``WAIT 1``, see :mod:`kvstore.tiers.redis_link`), so a failover cannot lose it unseen.

:meth:`RedisTier.write` returns False only for a dropped block; :attr:`RedisTier.up` lets a caller
skip the tier while it is down instead of evicting to make room that would not help.

The tier keeps no index across restarts (:meth:`RedisTier.scan` yields nothing);
:meth:`RedisTier.exists` answers a cluster-wide "who has this block" without moving payloads.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from kvstore.block import HEADER_BYTES, BlockHeader, CorruptBlockError, Keyring, decode_value
from kvstore.buffers import byte_view
from kvstore.formats import NewerFormatError
from kvstore.tiers.base import Buffer, SharedTier, SizeLedger, StoredBlock
from kvstore.tiers.redis_link import SKIPPED, Failed, RedisLink

__all__ = [
    "DEFAULT_MIN_RATE",
    "DEFAULT_OP_TIMEOUT_MAX_S",
    "DEFAULT_RESEND_QUEUE_BLOCKS",
    "DEFAULT_RESEND_QUEUE_BYTES",
    "RedisTier",
]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

#: Default bounds of the queue of refused write-throughs (``redis.resend_queue_*``): about 20 s of
#: write-through at 10 GB/min, enough to ride out a Redis Cluster failover (3-5 s) under load.
DEFAULT_RESEND_QUEUE_BYTES = 256 * 1024**2
DEFAULT_RESEND_QUEUE_BLOCKS = 16384


#: Defaults of ``redis.op_timeout_max_s`` and ``redis.min_rate`` (:mod:`.redis_rate`): no call
#: waits longer than 30 s, and a link is trusted to move at least 4 MiB/s (8 MiB: 2.5 s).
DEFAULT_OP_TIMEOUT_MAX_S = 30.0
DEFAULT_MIN_RATE = 4 * 1024**2
# What a value read is assumed to weigh before any was seen.
_TYPICAL_VALUE = 1024**2

_SINGLE_SCHEMES = ("redis://", "rediss://", "unix://")
_CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")


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
        resend_queue_bytes: int = DEFAULT_RESEND_QUEUE_BYTES,
        resend_queue_blocks: int = DEFAULT_RESEND_QUEUE_BLOCKS,
        op_timeout_max_s: float = DEFAULT_OP_TIMEOUT_MAX_S,
        min_rate: int = DEFAULT_MIN_RATE,
        max_connections: int = 4,
    ) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0 or None (no expiry), got {ttl_s}")
        if op_timeout_s <= 0:
            raise ValueError(f"op_timeout_s must be > 0, got {op_timeout_s}")
        if resend_queue_bytes < 0 or resend_queue_blocks < 0:
            raise ValueError(
                f"resend_queue_bytes and resend_queue_blocks must be >= 0 (0: keep nothing), got "
                f"{resend_queue_bytes} and {resend_queue_blocks}"
            )
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
        #: Bounds of the store's queue of refused copies to send again
        #: (:mod:`kvstore.store.shared_writer`).
        self.resend_queue_bytes = resend_queue_bytes
        self.resend_queue_blocks = resend_queue_blocks
        self._prefix = key_prefix.encode()
        # PX (milliseconds) rather than EX so that fractional TTLs are honoured.
        self._ttl_ms = None if ttl_s is None else max(1, round(ttl_s * 1000))
        if not url.startswith((*_SINGLE_SCHEMES, *_CLUSTER_SCHEMES)):
            allowed = ", ".join([*_SINGLE_SCHEMES, *_CLUSTER_SCHEMES])
            raise ValueError(f"unsupported Redis URL {url!r}; use one of {allowed}")
        if op_timeout_max_s < op_timeout_s:
            raise ValueError(
                f"op_timeout_max_s ({op_timeout_max_s}) must be >= op_timeout_s ({op_timeout_s})"
            )
        self._link = RedisLink(
            url,
            op_timeout_s,
            (low, high),
            max_timeout_s=op_timeout_max_s,
            min_rate=min_rate,
            max_connections=max_connections,
        )
        # The size a value read here is expected to have, for the deadline of a read (whose
        # reply sizes are known only once it has arrived): see _saw_values.
        self._typical_value = float(_TYPICAL_VALUE)
        self._ledger = SizeLedger(self.footprint)
        self.writes_dropped = 0
        self.reads_skipped = 0
        self.read_errors = 0
        self.corrupt_blocks = 0
        #: Values found in a header version newer than this release reads (left in Redis).
        self.newer_format_blocks = 0
        self.blocks_written = 0
        #: Blocks written with a retention TTL (:meth:`write_many`'s ``ttl_s``).
        self.retained_blocks_written = 0
        #: Blocks whose TTL a retained put of an already stored block lengthened.
        self.retained_blocks_extended = 0

    @property
    def up(self) -> bool:
        """True while Redis answers; False from an outage until the reconnect loop succeeds.

        With Redis Cluster, a dead primary leaves the tier up: only its keys are skipped."""
        return self._link.up

    @property
    def outages(self) -> int:
        """Outages of the whole tier (a single server, or a cluster not reachable at all)."""
        return self._link.outages

    @property
    def node_outages(self) -> int:
        """Cluster primaries that stopped answering while the rest of the cluster served."""
        return self._link.node_outages

    @property
    def reconnects(self) -> int:
        """Outages ended by the reconnect loop."""
        return self._link.reconnects

    # -- Tier interface ---------------------------------------------------------------------

    def footprint(self, length: int) -> int:
        """The stored value's size, header plus payload (Redis's own overhead is not counted)."""
        return HEADER_BYTES + length

    @property
    def used(self) -> int:
        """Bytes this node wrote and has not seen disappear: an estimate, not Redis's usage."""
        return self._ledger.used

    def _saw_values(self, mean: float) -> None:
        """Values of ``mean`` bytes went by: the expected size rises to it at once and falls
        toward it slowly, so a read deadline errs long (slow, not down) where sizes vary."""
        self._typical_value = max(mean, self._typical_value + 0.05 * (mean - self._typical_value))

    def _name(self, key: bytes) -> bytes:
        return self._prefix + key.hex().encode()

    async def write(self, header: BlockHeader, payload: Buffer) -> bool:
        """Store one block with the TTL; False only when it was dropped (Redis down or failing)."""
        return (await self.write_many([(header, payload)]))[0]

    async def write_outcomes(
        self, items: Sequence[tuple[BlockHeader, Buffer]], ttl_s: float | None = None
    ) -> list[bool | None]:
        """Store blocks in one pipelined round trip (one per primary in a cluster); per block
        ``True`` (stored), ``False`` (Redis refused or was down: worth sending again) or ``None``
        (its payload no longer matches the checksum it was put with: not signed nor stored,
        counted in ``corrupt_blocks``). ``ttl_s``: the blocks are retained
        (:mod:`kvstore.retention`): they expire no sooner than that, even where the tier's own
        TTL is shorter (counted in ``retained_blocks_written``)."""
        if not items:
            return []
        if not self.up:
            self.writes_dropped += len(items)
            return [False] * len(items)
        size = sum(header.length for header, _ in items)
        values = await _off_loop(size, _seal_all, list(items), self.keyring)
        outcomes: list[bool | None] = [False if value is not None else None for value in values]
        chosen = [i for i, value in enumerate(values) if value is not None]
        if len(chosen) < len(items):
            self.corrupt_blocks += len(items) - len(chosen)
            logger.error(
                "refusing to store %d block(s) changed since their put", len(items) - len(chosen)
            )
        if not chosen:
            return outcomes
        names = [self._name(items[i][0].key) for i in chosen]
        by_name = dict(zip(names, (values[i] for i in chosen), strict=True))
        ttl = self._ttl_ms
        if ttl_s and ttl is not None:
            ttl = max(ttl, round(ttl_s * 1000))
        sent = sum(len(values[i] or b"") for i in chosen)
        started = time.monotonic()
        results = await self._link.pipelined(
            "write",
            names,
            lambda pipe, name: pipe.set(name, by_name[name], px=ttl),
            replicated=True,
            size=sent,
        )
        if not any(isinstance(result, (Failed, Exception)) for result in results):
            self._link.rate.observe(sent, time.monotonic() - started)
            self._saw_values(sent / len(names))
        refusal: Exception | None = None
        for i, result in zip(chosen, results, strict=True):
            header = items[i][0]
            if isinstance(result, (Failed, Exception)):
                if isinstance(result, Exception):
                    refusal = result
                self.writes_dropped += 1
                continue
            # Redis forgets it after its TTL, and tells no one: so does the ledger.
            self._ledger.add(header.key, header.length, None if ttl is None else ttl / 1000)
            self.blocks_written += 1
            if ttl_s:
                self.retained_blocks_written += 1
            outcomes[i] = True
        if refusal is not None:
            # One line per batch, at debug: a failover refuses every write for seconds, and the
            # store's re-send queue reports it once (kvstore.store.shared_writer).
            logger.debug("redis refused writes of this batch, e.g.: %s", refusal)
        return outcomes

    async def read(self, keys: Sequence[bytes]) -> list[StoredBlock | None]:
        """Read a batch in one round trip; absent, corrupt or unreachable blocks are ``None``."""
        if not keys:
            return []
        if not self.up:
            self.reads_skipped += len(keys)
            return [None] * len(keys)
        names = [self._name(key) for key in keys]
        replies: list[Any]
        # The deadline grows with what the batch should bring back (kvstore.tiers.redis_rate).
        expected = round(len(keys) * self._typical_value)
        started = time.monotonic()
        if self._link.cluster:
            replies = await self._link.pipelined(
                "read", names, lambda pipe, name: pipe.get(name), size=expected
            )
        else:
            # One MGET: 10-20% faster than a pipeline of GETs for 32 KiB-1 MiB values.
            answer = await self._link.call("read", lambda client: client.mget(names), size=expected)
            replies = [answer] * len(names) if isinstance(answer, Failed) else answer
        elapsed = time.monotonic() - started
        values: list[Any] = []
        failed = 0
        for key, reply in zip(keys, replies, strict=True):
            if isinstance(reply, (Failed, Exception)):
                if reply is SKIPPED:
                    self.reads_skipped += 1
                else:
                    failed += 1
                values.append(None)
                continue
            if reply is None:
                # Expired, evicted by Redis or removed by another node: stop counting it.
                self._ledger.discard(key)
            values.append(reply)
        if failed:
            self.read_errors += 1
        size = sum(len(value) for value in values if value is not None)
        found = sum(1 for value in values if value is not None)
        if found and not failed:
            self._link.rate.observe(size, elapsed)
            self._saw_values(size / found)
        decoded = await _off_loop(size, _decode_all, list(keys), values, self.keyring)
        blocks: list[StoredBlock | None] = []
        corrupt: list[bytes] = []
        for key, block in zip(keys, decoded, strict=True):
            if isinstance(block, NewerFormatError):
                # A later release's block: not ours to judge, and its readers still want it.
                logger.debug("redis block %s: %s", key.hex(), block)
                self.newer_format_blocks += 1
                blocks.append(None)
                continue
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
        await self._link.pipelined("remove", names, lambda pipe, name: pipe.unlink(name))
        return True

    async def extend(self, keys: Sequence[bytes], ttl_s: float) -> int:
        """``PEXPIRE ... GT`` per key: the blocks Redis holds live at least ``ttl_s`` more (a
        longer TTL, or none, is kept); returns how many it lengthened. Skipped while down."""
        if not keys or not self.up:
            return 0
        names = [self._name(key) for key in keys]
        ttl = max(1, round(ttl_s * 1000))
        replies = await self._link.pipelined(
            "extend", names, lambda pipe, name: pipe.pexpire(name, ttl, gt=True)
        )
        # 1 where lengthened; 0 where absent or already living longer (GT), or Failed.
        extended = 0
        for key, reply in zip(keys, replies, strict=True):
            if reply is True or reply == 1:
                extended += 1
                self._ledger.lengthen(key, ttl_s)
        self.retained_blocks_extended += extended
        return extended

    async def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each block is in Redis now (from any node); False while down."""
        if not keys or not self.up:
            return [False] * len(keys)
        names = [self._name(key) for key in keys]
        replies = await self._link.pipelined("exists", names, lambda pipe, name: pipe.exists(name))
        return [reply == 1 for reply in replies]

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
            "node_outages": self.node_outages,
            "down_nodes": len(self._link.down_nodes),
            "writes_unreplicated": self._link.unreplicated,
            "reconnects": self.reconnects,
            "blocks_written": self.blocks_written,
            "writes_dropped": self.writes_dropped,
            "retained_blocks_written": self.retained_blocks_written,
            "retained_blocks_extended": self.retained_blocks_extended,
            "reads_skipped": self.reads_skipped,
            "read_errors": self.read_errors,
            "corrupt_blocks": self.corrupt_blocks,
            "newer_format_blocks": self.newer_format_blocks,
            # What deadlines assume (kvstore.tiers.redis_rate): measured, 0 before any.
            "rate_bytes_per_s": round(self._link.rate.measured or 0),
            "slow_calls_timed_out": self._link.rate.misses,
            # redis.max_connections: calls that found every connection busy until their deadline
            # (or until under MIN_CALL_S of it was left): not sent, and Redis not marked down.
            "calls_waited_out": self._link.slots.waits_timed_out,
        }

    async def close(self) -> None:
        """Stop reconnecting and close the client's connections; the tier is unusable after."""
        await self._link.close()


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
) -> list[StoredBlock | CorruptBlockError | NewerFormatError | None]:
    """Per value, the verified block, the reason it failed, or ``None`` where there was none."""
    out: list[StoredBlock | CorruptBlockError | NewerFormatError | None] = []
    for key, value in zip(keys, values, strict=True):
        if value is None:
            out.append(None)
            continue
        try:
            header, payload = decode_value(key, value, keyring)
        except (CorruptBlockError, NewerFormatError) as exc:
            out.append(exc)
            continue
        out.append(StoredBlock(header, payload))
    return out
