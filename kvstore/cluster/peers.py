"""Peer fetch: reading a block this node does not index straight from the node that holds it.

:class:`PeerSource` is the store's remote source (:mod:`kvstore.store.remote`) under
``cluster.shared_data = peers | both``. For keys the local tiers miss it asks the cluster index
(:class:`~kvstore.cluster.index.ClusterIndex`) which live node holds each, and reads them from
that node with the client library over gRPC (``data_plane = grpc``: never shared memory, which
would hide a broken remote path when peers share a host), presenting ``cluster.peer_token`` and
naming the request's namespace, within what is left of the request's deadline (else
``cluster.peer_timeout_s``).

**Suspects.** A peer that does not answer in time (``peer_timeout``) or fails (``peer_down``:
refused, unreachable, any error) is marked suspect with its lease's epoch and expiry at that
moment, and is not asked again until its lease is renewed (its expiry moves later) or its epoch
changes (it restarted); keys it holds are misses meanwhile (``peer_down``). A dead node's lease
expires within ``cluster.lease_ttl_s`` and the index stops naming it.

**Checks.** A block counts only if the peer says found and its length is within
``server.max_block_bytes``; the store checksums it as it places it here (like a promotion).

**Tenants.** One ``cluster.peer_token`` is presented for every tenant, so a peer serves the
fetch from the tenant that token belongs to there; per-tenant peer tokens are not supported.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvstore.client import AsyncKVStoreClient
from kvstore.cluster.index import ClusterIndex
from kvstore.cluster.layout import REDIS_ERRORS
from kvstore.cluster.membership import NodeInfo
from kvstore.errors import DeadlineExceededError
from kvstore.store.counters import StoreCounters
from kvstore.store.remote import remaining_s

__all__ = ["PeerSource"]

logger = logging.getLogger(__name__)

#: Clients kept open (one per peer and namespace; the least recently used is closed).
MAX_CLIENTS = 64
#: How much later a lease's expiry must be to count as renewed (absorbs clock jitter).
_RENEWAL_SLACK_S = 0.05


@dataclass
class _Suspect:
    epoch: bytes | None
    #: ``time.monotonic()`` at which the lease would expire, as seen when marked.
    expires: float


class PeerSource:
    """Reads blocks from the live nodes the index names (one tenant's view, ``index``)."""

    name = "peer"

    def __init__(
        self,
        index: ClusterIndex,
        node_id: str,
        counters: StoreCounters,
        *,
        token: str = "",
        timeout_s: float = 2.0,
        max_block_bytes: int = 64 * 1024**2,
    ) -> None:
        self.index = index
        self.node_id = node_id
        self.counters = counters
        self.token = token
        self.timeout_s = timeout_s
        self.max_block_bytes = max_block_bytes
        self._nodes: dict[str, NodeInfo] = {}
        self._suspects: dict[str, _Suspect] = {}
        self._clients: OrderedDict[tuple[str, bytes], AsyncKVStoreClient] = OrderedDict()

    async def read(
        self, keys: Sequence[bytes], namespace: bytes
    ) -> tuple[list[bytes | None], dict[int, str]]:
        """Each key's payload from a peer holding it (``None`` where none served it), and the
        miss reason of keys a peer was named for but did not serve."""
        payloads: list[bytes | None] = [None] * len(keys)
        why: dict[int, str] = {}
        budget = self._budget()
        if budget <= 0:
            return payloads, why
        try:
            holders = await asyncio.wait_for(self.index.holders(keys), budget)
            holders.pop(self.node_id, None)
            if holders:
                await asyncio.wait_for(self._refresh(holders), self._budget())
        except REDIS_ERRORS as exc:  # TimeoutError among them
            logger.debug("peer fetch: the cluster index did not answer (%s)", exc)
            return payloads, why
        plan: dict[str, list[int]] = {}
        for position in range(len(keys)):
            names = [node for node, held in holders.items() if held.tiers[position]]
            if not names:
                continue
            usable = [node for node in names if node not in self._suspects and node in self._nodes]
            if not usable:
                why[position] = "peer_down"
                self.counters.add("peer_skipped_suspect")
                continue
            # The fastest tier first, so a peer holding it in dram beats one reading nvme.
            best = min(usable, key=lambda node: holders[node].tiers[position] != "dram")
            plan.setdefault(best, []).append(position)
        if plan:
            await asyncio.gather(
                *(
                    self._fetch(node, keys, positions, namespace, payloads, why)
                    for node, positions in plan.items()
                )
            )
        return payloads, why

    def _budget(self) -> float:
        left = remaining_s()
        return self.timeout_s if left is None else min(left, self.timeout_s)

    async def _refresh(self, holders: Mapping[str, object]) -> None:
        """Learn the addresses of nodes not seen before; forgive suspects whose lease moved."""
        epochs = self.index.epochs  # a node restarted since its address was read: read again
        if any(
            node not in self._nodes or self._nodes[node].epoch != epochs[node] for node in holders
        ):
            self._nodes.update(await self.index.nodes())
        suspects = [node for node in holders if node in self._suspects]
        if suspects:
            for node, (epoch, pttl) in zip(suspects, await self._leases(suspects), strict=True):
                mark = self._suspects[node]
                renewed = time.monotonic() + pttl / 1000 > mark.expires + _RENEWAL_SLACK_S
                if epoch != mark.epoch or (epoch is not None and renewed):
                    logger.info("peer fetch: node %s renewed its lease; asking it again", node)
                    del self._suspects[node]
                    if epoch != mark.epoch:
                        self._nodes.update(await self.index.nodes())

    async def _leases(self, nodes: Sequence[str]) -> list[tuple[bytes | None, int]]:
        layout = self.index.layout
        pipe = self.index.client.pipeline(transaction=False)
        for node in nodes:
            pipe.get(layout.lease(node))
            pipe.pttl(layout.lease(node))
        answers = await pipe.execute()
        return [(answers[i], int(answers[i + 1])) for i in range(0, len(answers), 2)]

    async def _suspect(self, node: str) -> None:
        try:
            ((epoch, pttl),) = await asyncio.wait_for(self._leases([node]), self.timeout_s)
        except REDIS_ERRORS:
            epoch, pttl = None, 0
        self._suspects[node] = _Suspect(epoch, time.monotonic() + max(pttl, 0) / 1000)
        self.counters.add("peer_suspected")
        logger.warning("peer fetch: node %s did not answer; not asked until its lease renews", node)

    def _client(self, node: str, namespace: bytes) -> AsyncKVStoreClient:
        target = self._nodes[node].grpc
        key = (target, namespace)  # a restarted node may listen elsewhere
        client = self._clients.get(key)
        if client is None:
            client = AsyncKVStoreClient(
                target,
                namespace=namespace,
                timeout=self.timeout_s,
                data_plane="grpc",
                token=self.token or None,
            )
            self._clients[key] = client
            if len(self._clients) > MAX_CLIENTS:
                _, old = self._clients.popitem(last=False)
                asyncio.get_running_loop().create_task(old.aclose())
        self._clients.move_to_end(key)
        return client

    async def _fetch(
        self,
        node: str,
        keys: Sequence[bytes],
        positions: list[int],
        namespace: bytes,
        payloads: list[bytes | None],
        why: dict[int, str],
    ) -> None:
        budget = self._budget()
        self.counters.add("peer_requests")
        reason = ""
        try:
            if budget <= 0:
                raise DeadlineExceededError("no time left")
            client = self._client(node, namespace)
            wanted = [keys[position] for position in positions]
            got = await asyncio.wait_for(client.get(wanted, timeout=budget), budget)
        except (DeadlineExceededError, TimeoutError):
            reason = "peer_timeout"
        except (
            Exception
        ) as exc:  # whatever a peer does wrong is its miss, never this request's error
            logger.debug("peer fetch from %s failed: %s", node, exc)
            reason = "peer_down"
        if reason:
            for position in positions:
                why[position] = reason
            self.counters.add(f"{reason}s", len(positions))
            await self._suspect(node)
            return
        for position, payload in zip(positions, got, strict=True):
            if payload is None or not 0 < len(payload) <= self.max_block_bytes:
                continue  # the peer no longer holds it (evicted since it published): a miss
            payloads[position] = payload
            self.counters.add("peer_hits")
            self.counters.add("peer_bytes", len(payload))

    async def aclose(self) -> None:
        """Close every client."""
        clients, self._clients = list(self._clients.values()), OrderedDict()
        for client in clients:
            await client.aclose()
