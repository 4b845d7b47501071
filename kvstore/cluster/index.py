"""Reading the cluster index: which nodes hold how many leading chunks, in which tier.

:meth:`ClusterIndex.holders` answers in one round trip in the steady state: one pipeline of
``HGETALL`` per chunk key plus ``GET`` of the leases of the nodes seen before. Nodes not seen
before cost a second round trip (their leases), once. An entry counts only if its node's lease
is alive and carries the entry's epoch (see :mod:`kvstore.cluster`).

Built with the cluster's integrity ``keyring``, :meth:`ClusterIndex.nodes` believes only node
descriptions signed under it (:meth:`~kvstore.cluster.records.NodeInfo.verified`); the others
are left out and remembered in :attr:`ClusterIndex.refused`, logged once per node. A description
in a version newer than this release reads (:mod:`kvstore.formats`: its node runs a later
release) is left out too, but as :attr:`ClusterIndex.newer`, not as a refusal. An index entry
``EPOCH:TIER`` may carry ``;``-separated fields after the tier (a later entry version): they are
skipped and the tier still counts.

Every round trip runs under :func:`kvstore.deadline.within`: it ends at ``timeout_s`` and, when
the caller's own deadline (a ``wait_for``) cancels it, returns at once instead of waiting for
redis-py's cluster client to wind the cancelled pipeline down (seconds around a failover).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.block import Keyring
from kvstore.cluster.layout import Client, Layout
from kvstore.cluster.records import NodeInfo, RecordError, record_keyring
from kvstore.deadline import within
from kvstore.formats import NewerFormatError

__all__ = ["ONE_TRIP_NODES", "ClusterIndex", "Holding"]

logger = logging.getLogger(__name__)

#: Most known nodes whose leases ride along with the entries in one pipeline; past it, only the
#: leases of nodes an answer names are read, in a second round trip. A lease GET costs about
#: what a loopback round trip does divided by this (redis-py: ~30 us a command).
ONE_TRIP_NODES = 32


@dataclass
class Holding:
    """What one node holds of a request's keys."""

    #: How many leading keys it holds (all of the first ``leading``).
    leading: int
    #: Per key of the request, the fastest tier it holds the key in ("" where it does not).
    tiers: list[str]


class ClusterIndex:
    """The reader of one tenant's view of the index (``layout``); with ``keyring`` (the
    cluster's integrity secrets), only signed node descriptions count."""

    def __init__(
        self,
        client: Client,
        layout: Layout,
        keyring: Keyring | None = None,
        timeout_s: float | None = None,
    ) -> None:
        self.client = client
        self.layout = layout
        #: Longest one round trip may take (``None``: the client's socket timeout and the
        #: caller's deadline bound it).
        self.timeout_s = timeout_s
        self._ring: Keyring | None = None
        if keyring is not None:  # a node's reader (a router reads unsigned: it holds no secrets)
            self._ring = record_keyring(keyring)
        #: Nodes whose description did not verify at the last :meth:`nodes`, with their epoch.
        self.refused: dict[str, int] = {}
        #: How many times a (node, epoch) was found without a valid description.
        self.refused_count = 0
        #: Nodes whose description is in a version newer than this release reads (a later
        #: release's, :mod:`kvstore.formats`), with their epoch: left out, but not refused.
        self.newer: dict[str, int] = {}
        self._known: set[str] = set()
        #: The boot epoch of each node with a live lease, as of the last :meth:`holders`
        #: answer (a reader's cached address of a node whose epoch moved is stale).
        self.epochs: dict[str, int] = {}

    async def _leases(self, nodes: Sequence[str]) -> dict[str, bytes | None]:
        pipe = self.client.pipeline(transaction=False)
        for node in nodes:
            pipe.get(self.layout.lease(node))
        return dict(zip(nodes, await within(pipe.execute(), self.timeout_s), strict=True))

    async def holders(self, keys: Sequence[bytes]) -> dict[str, Holding]:
        """Per live node holding any of ``keys``: its leading run and tier per key."""
        layout = self.layout
        known = sorted(self._known) if len(self._known) <= ONE_TRIP_NODES else []
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.hgetall(layout.entry(key))
        for node in known:
            pipe.get(layout.lease(node))
        answers = await within(pipe.execute(), self.timeout_s)
        entries: list[dict[bytes, bytes]] = answers[: len(keys)]
        leases = dict(zip(known, answers[len(keys) :], strict=True))
        seen = {field.decode() for entry in entries for field in entry}
        unknown = sorted(seen - leases.keys())
        if unknown:
            leases.update(await self._leases(unknown))
        # Remember live nodes (and those just seen) for the next query's single round trip.
        self._known = {node for node, lease in leases.items() if lease is not None or node in seen}
        live = {node.encode(): lease + b":" for node, lease in leases.items() if lease is not None}
        self.epochs = {node: int(lease) for node, lease in leases.items() if lease is not None}
        found: dict[str, Holding] = {}
        count = len(keys)
        for index, entry in enumerate(entries):
            for field, value in entry.items():
                prefix = live.get(field)
                if prefix is None or not value.startswith(prefix):
                    continue  # no lease, or an entry of an earlier boot
                holding = found.get(field.decode())
                if holding is None:
                    holding = found[field.decode()] = Holding(0, [""] * count)
                # Version 1 is EPOCH:TIER; later versions may append ;fields, not ours to read.
                holding.tiers[index] = value[len(prefix) :].split(b";", 1)[0].decode()
        for holding in found.values():
            tiers = holding.tiers
            holding.leading = next((i for i, tier in enumerate(tiers) if not tier), count)
        return found

    async def _members(self) -> Any:
        return await self.client.smembers(self.layout.nodes)

    async def nodes(self) -> dict[str, NodeInfo]:
        """Every node with a live lease, as it described itself."""
        layout = self.layout
        raw_members = await within(self._members(), self.timeout_s)
        members = sorted(m.decode() if isinstance(m, bytes) else m for m in raw_members)
        if not members:
            return {}
        leases = await self._leases(members)
        pipe = self.client.pipeline(transaction=False)
        for node in members:
            pipe.hgetall(layout.node(node))
        infos = await within(pipe.execute(), self.timeout_s)
        live = {
            node: raw
            for node, raw in zip(members, infos, strict=True)
            if leases[node] is not None and raw and raw.get(b"epoch") == leases[node]
        }
        believed: dict[str, NodeInfo] = {}
        for node, raw in live.items():
            try:
                ring = self._ring
                believed[node] = (
                    _parsed(node, raw) if ring is None else NodeInfo.verified(node, raw, ring)
                )
            except NewerFormatError as exc:
                lease = leases[node] or b""
                epoch = int(lease) if lease.isdigit() else -1
                if self.newer.get(node) != epoch:
                    logger.warning("cluster index: not reading node %r yet: %s", node, exc)
                self.newer[node] = epoch
            except RecordError as exc:
                self._refuse(node, leases[node] or b"", str(exc))
            else:
                self.refused.pop(node, None)
                self.newer.pop(node, None)
        return believed

    def _refuse(self, node: str, lease: bytes, why: str) -> None:
        epoch = int(lease) if lease.isdigit() else -1
        if self.refused.get(node) == epoch:
            return
        self.refused_count += 1
        if node not in self.refused:
            logger.warning(
                "cluster index: ignoring node %r: %s (not a node of this cluster, or its "
                "integrity secrets differ)",
                node,
                why,
            )
        self.refused[node] = epoch


def _parsed(node: str, raw: Any) -> NodeInfo:
    """An unsigned reader's description (:class:`RecordError` if it does not parse)."""
    try:
        return NodeInfo.parse(node, raw)
    except (ValueError, TypeError, AttributeError, UnicodeDecodeError) as exc:
        raise RecordError(f"malformed description ({exc})") from exc
