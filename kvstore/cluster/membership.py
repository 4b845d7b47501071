"""A node's membership of the cluster index: its id, boot epoch, addresses and lease.

At start the node takes a new boot epoch (``INCR`` of its counter), writes its description and
sets its lease (value: the epoch, ``PX`` ``cluster.lease_ttl_s``). A background task renews the
lease every third of the TTL. A renewal that finds the lease gone (it expired while the node was
cut off, or Redis restarted empty) registers again and asks the publisher for a full resync, as
does the first success after Redis was unreachable. Redis being down never stops the node: it
logs once and keeps trying. :meth:`Membership.stop` deletes the lease, so everything the node
published stops counting at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kvstore.cluster.layout import REDIS_ERRORS, Client, Layout

__all__ = ["NODE_ID_FILE", "Membership", "NodeInfo", "node_id_for"]

logger = logging.getLogger(__name__)

#: The file in the nvme directory that keeps a node's generated id across restarts.
NODE_ID_FILE = "cluster-node-id"


@dataclass(frozen=True)
class NodeInfo:
    """What a node says about itself in the index."""

    node_id: str
    epoch: int
    #: The gRPC target clients dial.
    grpc: str
    #: The UCX data path's address ("" without one).
    ucx: str = ""
    #: Bytes per tier name.
    capacity: Mapping[str, int] = field(default_factory=dict)

    def fields(self) -> dict[str, str]:
        """The hash fields stored under :meth:`Layout.node`."""
        return {
            "epoch": str(self.epoch),
            "grpc": self.grpc,
            "ucx": self.ucx,
            "capacity": json.dumps(dict(self.capacity)),
        }

    @classmethod
    def parse(cls, node_id: str, raw: Mapping[bytes, bytes]) -> NodeInfo:
        """The inverse of :meth:`fields`."""
        text = {k.decode(): v.decode() for k, v in raw.items()}
        return cls(
            node_id,
            int(text.get("epoch", "0")),
            text.get("grpc", ""),
            text.get("ucx", ""),
            json.loads(text.get("capacity", "{}")),
        )


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
    time the node (re)registers, so that its blocks are published again in full."""

    def __init__(
        self,
        client: Client,
        layout: Layout,
        describe: Callable[[int], NodeInfo],
        ttl_s: float,
        on_rejoin: Callable[[], None],
    ) -> None:
        self.client = client
        self.layout = layout
        self.node_id = describe(0).node_id
        self.ttl_s = ttl_s
        #: The boot epoch, once Redis gave one (``None`` until then: nothing is published).
        self.epoch: int | None = None
        self._describe = describe
        self._on_rejoin = on_rejoin
        self._task: asyncio.Task[None] | None = None
        self._down = False

    async def start(self) -> None:
        """Register now if Redis answers (else keep trying in the background), then renew."""
        await self._beat()
        self._task = asyncio.create_task(self._renew_forever(), name="cluster-lease")

    async def _register(self) -> None:
        layout, node = self.layout, self.node_id
        epoch = int(await self.client.incr(layout.epoch(node)))
        if self.epoch is None:
            self.epoch = epoch
        elif epoch < self.epoch:  # Redis lost the counter: keep later boots' epochs new
            await self.client.set(layout.epoch(node), self.epoch)
        info = self._describe(self.epoch)
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(layout.node(node), mapping=info.fields())  # type: ignore[arg-type]
        pipe.sadd(layout.nodes, node)
        pipe.set(layout.lease(node), self.epoch, px=self._ttl_ms)
        await pipe.execute()
        logger.info("cluster index: node %s registered, epoch %d", node, self.epoch)
        self._on_rejoin()

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
            elif self._down:
                self._on_rejoin()  # entries may have missed changes while Redis was away
            if self._down:
                logger.warning("cluster index: Redis answers again; republishing")
            self._down = False
        except REDIS_ERRORS as exc:
            if not self._down:
                logger.warning("cluster index: Redis unreachable (%s); the node keeps serving", exc)
            self._down = True

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / 3)
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
