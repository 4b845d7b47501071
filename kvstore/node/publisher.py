"""Publishing, batched, which blocks a node holds in which tier.

The store calls :meth:`Publisher.on_change` inside each change (:meth:`TieredStore.add_listener`);
that only records the key's newest state in a dict (a key that changes twice before a flush is
sent once) and never awaits, so the store pays a dict store per change. A background task flushes
every ``interval_s``, or as soon as :data:`BATCH_EVENTS` changes are waiting, in one
non-transactional pipeline: ``HSET entry NODE EPOCH:TIER`` for a key gained or moved,
``HDEL entry NODE`` for a key gone.

When a flush fails (Redis unreachable) the batch is dropped with one log line and the next
successful flush is a full resync: everything the store holds now is written, and everything
published before and no longer held is deleted. The same happens when membership (re)registers.
:meth:`Publisher.withdraw` deletes every entry the node published (a clean stop).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Iterator

from kvstore.cluster.layout import REDIS_ERRORS, Client, Layout
from kvstore.node.membership import Membership
from kvstore.store import TieredStore

__all__ = ["BATCH_EVENTS", "PIPELINE_COMMANDS", "Publisher"]

logger = logging.getLogger(__name__)

#: Changes that trigger a flush before the interval ends.
BATCH_EVENTS = 4096
#: Commands per pipeline round trip (a full resync of a large store is sent in parts).
PIPELINE_COMMANDS = 8192


class Publisher:
    """Publishes one store's holdings under ``layout`` for the node ``membership`` registers."""

    def __init__(
        self,
        client: Client,
        layout: Layout,
        store: TieredStore | None,
        membership: Membership,
        interval_s: float,
    ) -> None:
        self.client = client
        self.layout = layout
        self.store = store
        self.membership = membership
        self.interval_s = interval_s
        #: What Redis holds for this node, as far as this node knows: key → tier.
        self.published: dict[bytes, str] = {}
        self._pending: dict[bytes, str | None] = {}
        self._resync = True
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._failing = False
        #: Block changes sent to Redis (a benchmark and tests read it).
        self.sent = 0

    def on_change(self, key: bytes, tier: str | None) -> None:
        """The store's listener: ``key`` is now held at ``tier`` at best (``None``: gone)."""
        pending = self._pending
        pending[key] = tier
        if len(pending) >= BATCH_EVENTS:
            self._wake.set()

    def resync(self) -> None:
        """Make the next flush publish everything the store holds (soon)."""
        self._resync = True
        self._wake.set()

    def start(self) -> None:
        """Listen to the store and flush in the background."""
        if self.store is not None:
            self.store.add_listener(self.on_change)
        self._task = asyncio.create_task(self._run(), name="cluster-publisher")

    def holdings(self) -> Iterator[tuple[bytes, str]]:
        """What a full resync publishes: every key held and its tier (the store's, by default)."""
        return self.store.holdings() if self.store is not None else iter(())

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval_s)
            self._wake.clear()
            if not await self.flush():
                # Back off while Redis is away; membership's renewals notice it coming back.
                await asyncio.sleep(max(self.interval_s, self.membership.ttl_s / 3))

    async def flush(self) -> bool:
        """Send what changed (or everything, after a failure); False if Redis did not answer."""
        epoch = self.membership.epoch
        if epoch is None:
            return True  # not registered yet: registration asks for a resync
        node, value_of = self.membership.node_id, f"{epoch}:".encode()
        batch, self._pending = self._pending, {}
        if self._resync:
            self._resync = False
            held = dict(self.holdings())
            changes: dict[bytes, str | None] = dict(held)
            changes.update({key: None for key in self.published if key not in held})
            force = True
        else:
            changes, force = batch, False
        writes: list[tuple[bytes, str | None]] = []
        for key, tier in changes.items():
            if tier is None:
                if force or key in self.published:
                    writes.append((key, None))
            elif force or self.published.get(key) != tier:
                writes.append((key, tier))
        try:
            for start in range(0, len(writes), PIPELINE_COMMANDS):
                await self._send(node, value_of, writes[start : start + PIPELINE_COMMANDS])
        except REDIS_ERRORS as exc:
            if not self._failing:
                logger.warning(
                    "cluster index: publishing failed (%s); will republish in full when Redis "
                    "answers",
                    exc,
                )
            self._failing = True
            self._resync = True
            return False
        if self._failing:
            logger.info("cluster index: publishing again")
        self._failing = False
        for key, tier in writes:
            if tier is None:
                self.published.pop(key, None)
            else:
                self.published[key] = tier
        self.sent += len(writes)
        return True

    async def _send(
        self, node: str, value_of: bytes, writes: Iterable[tuple[bytes, str | None]]
    ) -> None:
        entry = self.layout.entry
        pipe = self.client.pipeline(transaction=False)
        for key, tier in writes:
            if tier is None:
                pipe.hdel(entry(key), node)
            else:
                pipe.hset(entry(key), node, value_of + tier.encode())
        await pipe.execute()

    async def stop(self) -> None:
        """Stop flushing (what is pending is not sent)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def withdraw(self) -> None:
        """Delete every entry this node published (after :meth:`stop`)."""
        node = self.membership.node_id
        keys = list(self.published)
        try:
            for start in range(0, len(keys), PIPELINE_COMMANDS):
                part = [(key, None) for key in keys[start : start + PIPELINE_COMMANDS]]
                await self._send(node, b"", part)
        except REDIS_ERRORS as exc:
            logger.warning("cluster index: cannot withdraw entries (%s); they no longer count", exc)
            return
        self.published.clear()
