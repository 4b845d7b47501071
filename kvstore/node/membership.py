"""A node's membership of the cluster index: its id, boot epoch, addresses and lease.

At start the node takes a new boot epoch (``INCR`` of its counter), writes its description and
sets its lease (value: the epoch, ``PX`` ``cluster.lease_ttl_s``). A background task renews the
lease every third of the TTL. A renewal that finds the lease gone (it expired while the node was
cut off, or Redis restarted empty) registers again and asks the publisher for a full resync, as
does the first success after Redis was unreachable. Redis being down never stops the node: it
logs once and keeps trying. :meth:`Membership.stop` deletes the lease, so everything the node
published stops counting at once.

**Signed descriptions.** The node signs its description (:mod:`kvstore.cluster.records`:
what is signed, how a reader verifies it) and re-signs it with its renewals, and at once when
what it describes changed (:meth:`Membership.changed`: an engine declared a new key scheme).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import Callable

from kvstore.block import Keyring, installed_keyring
from kvstore.cluster.layout import REDIS_ERRORS, Client, Layout
from kvstore.cluster.records import RECORD_VALID_S, NodeInfo, record_keyring

__all__ = ["NODE_ID_FILE", "Membership", "node_id_for"]

logger = logging.getLogger(__name__)

#: The file in the nvme directory that keeps a node's generated id across restarts.
NODE_ID_FILE = "cluster-node-id"


def node_id_for(setting: str, nvme_path: str) -> str:
    """``cluster.node_id`` if set; else the id kept in ``nvme_path`` (made there on first use,
    so a node keeps its id across restarts on the same disk); else a random one."""
    if setting:
        return setting
    if nvme_path and os.path.isdir(nvme_path):
        path = os.path.join(nvme_path, NODE_ID_FILE)
        try:
            with open(path, encoding="ascii") as file:
                kept = file.read().strip()
            if kept:
                return kept
        except FileNotFoundError:
            pass
        made = uuid.uuid4().hex[:16]
        # Private like every file of the nvme directory (0600, whatever the umask).
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with open(fd, "w", encoding="ascii") as file:
            file.write(made + "\n")
        return made
    return uuid.uuid4().hex[:16]


class Membership:
    """Registers one node and keeps its lease alive; ``on_rejoin`` is called (on the loop) each
    time the node (re)registers, so that its blocks are published again in full. The node's
    description is signed with ``keyring`` (the cluster's; ``None``: the process's installed
    one)."""

    def __init__(
        self,
        client: Client,
        layout: Layout,
        describe: Callable[[int], NodeInfo],
        ttl_s: float,
        on_rejoin: Callable[[], None],
        keyring: Keyring | None = None,
    ) -> None:
        self.client = client
        self.layout = layout
        self.node_id = describe(0).node_id
        self.ttl_s = ttl_s
        self._ring = record_keyring(keyring or installed_keyring())
        # Renewals come every third of the TTL: many of them within each validity.
        self._valid_s = max(RECORD_VALID_S, 6 * ttl_s)
        #: When the description in Redis stops being believed (unix ms; 0: not written yet).
        self._expires_ms = 0
        #: The boot epoch, once Redis gave one (``None`` until then: nothing is published).
        self.epoch: int | None = None
        self._describe = describe
        self._on_rejoin = on_rejoin
        self._task: asyncio.Task[None] | None = None
        self._down = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake = asyncio.Event()
        self._changed = False

    async def start(self) -> None:
        """Register now if Redis answers (else keep trying in the background), then renew."""
        self._loop = asyncio.get_running_loop()
        await self._beat()
        self._task = asyncio.create_task(self._renew_forever(), name="cluster-lease")

    async def _register(self) -> None:
        layout, node = self.layout, self.node_id
        epoch = int(await self.client.incr(layout.epoch(node)))
        if self.epoch is None:
            self.epoch = epoch
        elif epoch < self.epoch:  # Redis lost the counter: keep later boots' epochs new
            await self.client.set(layout.epoch(node), self.epoch)
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(layout.node(node), mapping=self._signed())  # type: ignore[arg-type]
        pipe.sadd(layout.nodes, node)
        pipe.set(layout.lease(node), self.epoch, px=self._ttl_ms)
        await pipe.execute()
        logger.info("cluster index: node %s registered, epoch %d", node, self.epoch)
        self._on_rejoin()

    def _signed(self) -> dict[str, str]:
        """This node's description, signed, valid for the next ``_valid_s``."""
        assert self.epoch is not None
        self._changed = False  # (set again by _beat if writing it fails)
        expires_ms = int((time.time() + self._valid_s) * 1000)
        fields = self._describe(self.epoch).signed(self._ring, expires_ms)
        self._expires_ms = expires_ms
        return fields

    def changed(self) -> None:
        """What the description says changed: sign and write it again now, not at the next
        renewal (callable from any thread; a no-op before :meth:`start`)."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._mark_changed)

    def _mark_changed(self) -> None:
        self._changed = True
        self._wake.set()

    async def _resign(self) -> None:
        """Sign the description again once half its validity is gone, or it changed."""
        if not self._changed and time.time() * 1000 < self._expires_ms - self._valid_s * 500:
            return
        await self.client.hset(self.layout.node(self.node_id), mapping=self._signed())  # type: ignore[arg-type]

    @property
    def _ttl_ms(self) -> int:
        return max(int(self.ttl_s * 1000), 1)

    async def _beat(self) -> None:
        """Renew the lease, registering when it is gone; log a Redis outage once."""
        try:
            renewed = self.epoch is not None and await self.client.set(
                self.layout.lease(self.node_id), self.epoch, px=self._ttl_ms, xx=True
            )
            if not renewed:
                await self._register()
            else:
                await self._resign()
            if renewed and self._down:
                self._on_rejoin()  # entries may have missed changes while Redis was away
            if self._down:
                logger.warning("cluster index: Redis answers again; republishing")
            self._down = False
        except REDIS_ERRORS as exc:
            self._changed = True  # write the description in full once Redis answers again
            if not self._down:
                logger.warning("cluster index: Redis unreachable (%s); the node keeps serving", exc)
            self._down = True

    async def _renew_forever(self) -> None:
        while True:
            # A change wakes it early (a timeout is the usual renewal).
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.ttl_s / 3)
            self._wake.clear()
            await self._beat()

    async def stop(self) -> None:
        """Stop renewing and delete the lease (the node's entries stop counting at once)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.epoch is None:
            return
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.delete(self.layout.lease(self.node_id))
            pipe.delete(self.layout.node(self.node_id))
            await pipe.execute()
        except REDIS_ERRORS as exc:
            logger.warning("cluster index: cannot delete the lease (%s); it expires", exc)
