"""Peer fetch: reading a block this node does not index straight from the node that holds it.

:class:`PeerSource` is the store's remote source (:mod:`kvstore.store.remote`) under
``cluster.shared_data = peers | both``. For keys the local tiers miss it asks the cluster index
(:class:`~kvstore.cluster.index.ClusterIndex`) which live node holds each, and reads them from
that node, naming the request's namespace, within what is left of the request's deadline (else
``cluster.peer_timeout_s``).

**Who is asked.** Only nodes whose description in the index is signed under the cluster's
integrity secrets (:mod:`kvstore.node.membership`); the others are ignored, logged once and
counted in ``peer_unverified_nodes``. A request carries no credential, only an authenticator of
itself (:mod:`kvstore.node.peer_auth`) under the tenant's peer key; the holder answers with a
proof that it holds the key too, checked before any byte of the answer is read. A holder that
sends no valid proof is counted in ``peer_unproven`` and is suspect until it restarts, like one
serving forged blocks.

**Transports** (``cluster.peer_transport``). ``auto`` (default): over UCX
(:mod:`kvstore.node.peer_ucx`) where the peer advertises a UCX listener in the index and ucxx
is installed here, over gRPC otherwise. A UCX read that fails (no connection, a late or failed
transfer) is read again over gRPC for the same request, in what is left of its deadline (UCX's
connect may take at most half of it), and UCX to that peer rests for :data:`UCX_RETRY_S`; it is
counted in ``peer_ucx_fallbacks``. ``ucx``: UCX only (a peer without a UCX listener is not asked;
a UCX failure is that read's miss, as a gRPC failure is under ``grpc``). ``grpc``: the client
library over gRPC only (``data_plane = grpc``: never shared memory, which would hide a broken
remote path when peers share a host). Hits are counted per transport (``peer_hits_ucx``,
``peer_hits_grpc``; ``peer_hits`` is their sum).

**Second holder.** Keys a peer failed to serve (it failed, ran late, or no longer holds them)
are asked of the next live holder the index names, fastest tier first, while the deadline
leaves time (counted in ``peer_retries``).

**Suspects.** A peer that does not answer in time (``peer_timeout``) or fails (``peer_down``:
refused, unreachable, any error) is marked suspect with its lease's epoch and expiry at that
moment, and is not asked again until its lease is renewed (its expiry moves later) or its epoch
changes (it restarted); keys it holds are misses meanwhile (``peer_down``). A dead node's lease
expires within ``cluster.lease_ttl_s`` and the index stops naming it. A peer that served a block
failing verification is alive and renews its lease: it is asked again only once its epoch changes
(restarted, e.g. with the right secret).

**Checks.** An index entry proves nothing (anyone able to write to the index Redis can register a
node), so every block comes *sealed*, over either transport: with its wire header, whose keyed MAC
covers key, namespace, length and payload under the cluster's integrity secret bound to the tenant
(the keyring this node's store verifies its nvme and redis blocks with). Each is verified
(:mod:`kvstore.node.peer_blocks`, off the event loop) before it is installed or served; one that
fails (no header, another key or namespace, a MAC under another secret, a length out of
``server.max_block_bytes``) is a ``corrupt`` miss, counted in ``peer_corrupt_blocks`` (the
``tier="peer"`` series of ``kvstore_tier_corrupt_blocks``), its holder is suspect (below) and the
key goes to the next holder. A block sealed in a header version newer than this release reads (a
peer already upgraded, :mod:`kvstore.formats`) is a ``newer_format`` miss, counted in
``peer_newer_format_blocks``, and its holder is not suspect. The store checksums a verified block as
it places it here (like a promotion). For a promotion (a shared-memory or UCX reader's acquire), UCX
receives straight into reserved pages of the host tier (:mod:`kvstore.store.landing`), which become
the block in place once verified; pages of a block refused are abandoned to the landing, never
installed.

**Tenants.** Each tenant's peer source signs with that tenant's peer key (the cluster secrets
bound to its name) and names the tenant; the holder serves from the tenant the authenticator
proves, and seals with that tenant's keyring, so a block of another tenant is refused here like a
forged one. ``cluster.peer_token`` is no longer presented to anyone (a setting left over is
warned about at start).
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvstore.block import Keyring, installed_keyring
from kvstore.cluster.index import ClusterIndex, Holding
from kvstore.cluster.layout import REDIS_ERRORS
from kvstore.cluster.records import NodeInfo
from kvstore.config.cluster import PEER_TRANSPORTS
from kvstore.errors import (
    AuthenticationError,
    ConfigError,
    DeadlineExceededError,
    PermissionDeniedError,
)
from kvstore.node.peer_auth import PeerAuthError, PeerSigner, peer_keyring
from kvstore.node.peer_blocks import SealedBlock, sealed_newer, verify_blocks
from kvstore.node.peer_grpc import GrpcPeerLink
from kvstore.node.peer_links import PeerLinks
from kvstore.node.peer_ucx import UcxPeerLink
from kvstore.protocol.ucx import UcxTransportError, ucx_unavailable_reason
from kvstore.store.counters import StoreCounters
from kvstore.store.remote import Landing, remaining_s

__all__ = ["PeerSource", "holder_rank"]

logger = logging.getLogger(__name__)

#: How long UCX to a peer rests after a failure (its reads go over gRPC meanwhile, under ``auto``).
UCX_RETRY_S = 30.0
#: How often descriptions refused before are read again while the index names their nodes.
REFUSED_RECHECK_S = 10.0
#: How much later a lease's expiry must be to count as renewed (absorbs clock jitter).
_RENEWAL_SLACK_S = 0.05


def holder_rank(key: bytes, node: str) -> int:
    """Where ``node`` comes among the equally fast holders of ``key`` (lowest first): the same
    on every node, different per key, so reads of many keys spread over their holders."""
    return zlib.crc32(node.encode(), zlib.crc32(key))


@dataclass
class _Suspect:
    epoch: bytes | None
    #: ``time.monotonic()`` at which the lease would expire, as seen when marked.
    expires: float
    #: It served blocks that failed verification: a renewed lease does not clear it.
    forged: bool = False


class PeerSource:
    """Reads blocks from the live nodes the index names (one tenant's view, ``index``)."""

    name = "peer"

    def __init__(
        self,
        index: ClusterIndex,
        node_id: str,
        counters: StoreCounters,
        *,
        tenant: str = "",
        timeout_s: float = 2.0,
        max_block_bytes: int = 64 * 1024**2,
        transport: str = "auto",
        keyring: Keyring | None = None,
        ucx_lanes: int = 1,
    ) -> None:
        if transport not in PEER_TRANSPORTS:
            raise ConfigError(
                f"cluster.peer_transport must be one of {list(PEER_TRANSPORTS)}, got {transport!r}"
            )
        unavailable = ucx_unavailable_reason() if transport != "grpc" else None
        if transport == "ucx" and unavailable is not None:
            raise ConfigError(f"cluster.peer_transport = 'ucx' needs ucxx here: {unavailable}")
        if unavailable is not None:
            logger.info("peer fetch: UCX unavailable (%s); reading peers over gRPC", unavailable)
        #: ``auto``, ``ucx`` or ``grpc`` (:data:`~kvstore.config.cluster.PEER_TRANSPORTS`).
        self.transport = transport
        self._ucx_ok = transport != "grpc" and unavailable is None
        self.index = index
        self.node_id = node_id
        self.counters = counters
        self.timeout_s = timeout_s
        self.max_block_bytes = max_block_bytes
        #: UCX endpoints each link opens to its peer (``ucx.lanes``).
        self.ucx_lanes = ucx_lanes
        #: What blocks from peers are verified with (the store's; ``None``: the process's).
        self.keyring = keyring
        #: What this node's requests to its peers are signed with (the tenant's peer key).
        self.signer = PeerSigner(peer_keyring(keyring or installed_keyring()), tenant, node_id)
        self._nodes: dict[str, NodeInfo] = {}
        self._recheck_at = 0.0
        self._suspects: dict[str, _Suspect] = {}
        self._links = PeerLinks(self.signer, max_block_bytes, ucx_lanes)
        counters.add("peer_corrupt_blocks", 0)  # present (at 0) wherever peers are read
        counters.add("peer_unverified_nodes", 0)
        counters.add("peer_unproven", 0)

    async def read(
        self, keys: Sequence[bytes], namespace: bytes, landing: Landing | None = None
    ) -> tuple[list[bytes | None], dict[int, str]]:
        """Each key's payload from a peer holding it (``None`` where none served it), and the
        miss reason of keys a peer was named for but did not serve. With a ``landing``, UCX
        receives into its buffers where it offers them."""
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
        candidates = self._candidates(keys, holders, why)
        while candidates:
            plan: dict[str, list[int]] = {}
            for position, names in candidates.items():
                plan.setdefault(names[0], []).append(position)
            await asyncio.gather(
                *(
                    self._fetch(node, keys, positions, namespace, payloads, why, landing)
                    for node, positions in plan.items()
                )
            )
            # What a holder did not serve goes to the next live one, while time is left.
            candidates = {
                position: [node for node in names[1:] if node not in self._suspects]
                for position, names in candidates.items()
                if payloads[position] is None
            }
            candidates = {position: names for position, names in candidates.items() if names}
            if candidates:
                if self._budget() <= 0:
                    break
                self.counters.add("peer_retries", len(candidates))
        return payloads, why

    def _candidates(
        self, keys: Sequence[bytes], holders: Mapping[str, Holding], why: dict[int, str]
    ) -> dict[int, list[str]]:
        """The nodes to ask for each key, in order (the fastest tier first); a key whose holders
        may not be asked gets its miss reason in ``why`` instead."""
        candidates: dict[int, list[str]] = {}
        refused = self.index.refused  # unsigned descriptions: never asked, not even a miss reason
        for position in range(len(keys)):
            names = [
                node
                for node, held in holders.items()
                if held.tiers[position] and node not in refused
            ]
            if not names:
                continue
            usable = [node for node in names if node not in self._suspects and node in self._nodes]
            if self.transport == "ucx":  # UCX only: a peer without a listener is not asked
                usable = [node for node in usable if self._nodes[node].ucx]
            if not usable:
                if all(node in self.index.newer for node in names):  # a later release's nodes
                    why[position] = "newer_format"
                    continue
                why[position] = "peer_down"
                self.counters.add("peer_skipped_suspect")
                continue
            # The fastest tier first, so a peer holding it in dram beats one reading nvme; among
            # equals, rendezvous order spreads keys over their holders.
            usable.sort(
                key=lambda node: (
                    holders[node].tiers[position] != "dram",
                    holder_rank(keys[position], node),
                )
            )
            candidates[position] = usable
        return candidates

    def _budget(self) -> float:
        left = remaining_s()
        return self.timeout_s if left is None else min(left, self.timeout_s)

    async def _refresh(self, holders: Mapping[str, object]) -> None:
        """Learn the addresses of nodes not seen before; forgive suspects whose lease moved."""
        # A node restarted since its address was read: read again. ``epochs`` is the index's
        # latest answer, which a concurrent read may have replaced since ours: a holder missing
        # from it (its lease lapsed meanwhile) counts as moved, never as a KeyError.
        epochs = self.index.epochs
        refused = self.index.refused  # not again for a description already refused at its epoch
        newer = self.index.newer
        now_ms = time.time() * 1000
        recheck = time.monotonic() >= self._recheck_at

        def stale(node: str) -> bool:
            if node in refused:  # a description fixed since (re-signed) counts again
                return refused[node] != epochs.get(node) or recheck
            if node in newer:  # a later release's: read again as seldom as a refused one
                return newer[node] != epochs.get(node) or recheck
            known = self._nodes.get(node)
            return known is None or known.epoch != epochs.get(node) or known.expires_ms <= now_ms

        if any(stale(node) for node in holders):
            await self._read_nodes()
        suspects = [node for node in holders if node in self._suspects]
        if suspects:
            for node, (epoch, pttl) in zip(suspects, await self._leases(suspects), strict=True):
                mark = self._suspects[node]
                renewed = time.monotonic() + pttl / 1000 > mark.expires + _RENEWAL_SLACK_S
                if epoch != mark.epoch or (epoch is not None and renewed and not mark.forged):
                    logger.info("peer fetch: node %s renewed its lease; asking it again", node)
                    del self._suspects[node]
                    if epoch != mark.epoch:
                        await self._read_nodes()

    async def _read_nodes(self) -> None:
        """Read the signed descriptions of the live nodes again (keeping those still valid)."""
        before = self.index.refused_count
        self._recheck_at = time.monotonic() + REFUSED_RECHECK_S
        self._nodes.update(await self.index.nodes())
        now_ms = time.time() * 1000
        self._nodes = {n: info for n, info in self._nodes.items() if info.expires_ms > now_ms}
        self.counters.add("peer_unverified_nodes", self.index.refused_count - before)

    async def _leases(self, nodes: Sequence[str]) -> list[tuple[bytes | None, int]]:
        layout = self.index.layout
        pipe = self.index.client.pipeline(transaction=False)
        for node in nodes:
            pipe.get(layout.lease(node))
            pipe.pttl(layout.lease(node))
        answers = await pipe.execute()
        return [(answers[i], int(answers[i + 1])) for i in range(0, len(answers), 2)]

    async def _suspect(self, node: str, forged: bool = False) -> None:
        try:
            ((epoch, pttl),) = await asyncio.wait_for(self._leases([node]), self.timeout_s)
        except REDIS_ERRORS:
            epoch, pttl = None, 0
        expires = time.monotonic() + max(pttl, 0) / 1000
        self._suspects[node] = _Suspect(epoch, expires, forged)
        self.counters.add("peer_suspected")
        if forged:
            logger.warning(
                "peer fetch: node %s is not trusted (blocks failing their MAC, or no proof that "
                "it belongs to the cluster: a wrong integrity secret, or not a node of this "
                "cluster); not asked again until it restarts",
                node,
            )
        else:
            logger.warning(
                "peer fetch: node %s did not answer; not asked until its lease renews", node
            )

    def _client(self, node: str) -> GrpcPeerLink:
        return self._links.grpc(self._nodes[node])

    def _link(self, node: str) -> UcxPeerLink | None:
        """The UCX link to ``node`` if reads to it go over UCX now, else ``None``."""
        info = self._nodes[node]
        if not self._ucx_ok or not info.ucx:
            return None
        return self._links.ucx(info)

    async def _fetch(
        self,
        node: str,
        keys: Sequence[bytes],
        positions: list[int],
        namespace: bytes,
        payloads: list[bytes | None],
        why: dict[int, str],
        landing: Landing | None = None,
    ) -> None:
        """Ask ``node`` for the keys at ``positions``: the blocks it serves that verify go into
        ``payloads``, the miss reason of the others into ``why``."""
        self.counters.add("peer_requests")
        wanted = [keys[position] for position in positions]
        reason, forged, transport = "", False, "grpc"
        got: list[SealedBlock | None] | None = None
        try:
            link = self._link(node)
            if link is not None and (link.usable() or self.transport == "ucx"):
                transport = "ucx"
                got = await self._over_ucx_or_none(node, link, wanted, namespace, landing)
                transport = "ucx" if got is not None else "grpc"
            if got is None:
                got = await self._over_grpc(node, wanted, namespace)
        except (DeadlineExceededError, TimeoutError):
            reason = "peer_timeout"
        except PeerAuthError as exc:  # not a node of this cluster: asked again once it restarts
            logger.warning("peer fetch: node %s did not prove itself: %s", node, exc)
            self.counters.add("peer_unproven")
            reason, forged = "peer_down", True
        except (AuthenticationError, PermissionDeniedError) as exc:
            # A node of the cluster refusing this one: other secrets, clocks apart, tenants.
            logger.warning("peer fetch: node %s refused the request: %s", node, exc)
            reason = "peer_down"
        except Exception as exc:  # whatever a peer does wrong is its miss, never the request's
            logger.debug("peer fetch from %s over %s failed: %s", node, transport, exc)
            reason = "peer_down"
        if reason:
            for position in positions:
                why[position] = reason
            self.counters.add(f"{reason}s", len(positions))
            await self._suspect(node, forged)
            return
        assert got is not None
        verdicts = await self._verify(wanted, namespace, got)
        await self._take(node, positions, wanted, got, verdicts, transport, payloads, why, landing)

    async def _over_ucx_or_none(
        self,
        node: str,
        link: UcxPeerLink,
        keys: list[bytes],
        namespace: bytes,
        landing: Landing | None,
    ) -> list[SealedBlock | None] | None:
        """The keys' blocks over UCX; ``None`` where UCX failed and ``auto`` falls back to gRPC
        (the same keys, in what is left of the deadline), UCX to that peer resting meanwhile."""
        try:
            return await self._over_ucx(node, link, keys, namespace, landing)
        except (DeadlineExceededError, TimeoutError, PeerAuthError):
            raise
        except Exception as exc:
            if self.transport == "ucx":
                raise
            link.retry_at = time.monotonic() + UCX_RETRY_S
            self.counters.add("peer_ucx_fallbacks")
            logger.warning(
                "peer fetch: UCX to node %s failed (%s); gRPC for %.0fs", node, exc, UCX_RETRY_S
            )
            return None

    async def _verify(
        self, keys: list[bytes], namespace: bytes, got: list[SealedBlock | None]
    ) -> list[bool]:
        """Whether each block a peer sent is the key's, sealed under the tenant's keyring (off
        the event loop, unless all of them were verified where they arrived)."""
        keyring = self.keyring or installed_keyring()
        if any(block is not None and block.verified is None for block in got):
            return await asyncio.to_thread(
                verify_blocks, keys, namespace, got, keyring, self.max_block_bytes
            )
        if got:  # verified where they arrived (UCX): no second thread hop
            return verify_blocks(keys, namespace, got, keyring, self.max_block_bytes)
        return []

    async def _take(
        self,
        node: str,
        positions: list[int],
        keys: list[bytes],
        got: list[SealedBlock | None],
        verdicts: list[bool],
        transport: str,
        payloads: list[bytes | None],
        why: dict[int, str],
        landing: Landing | None,
    ) -> None:
        """Keep the blocks ``node`` served that verified; the others are misses (``newer_format``
        where a later release sealed them, else ``corrupt``: the node is suspect)."""
        refused: list[bytes] = []
        newer: list[bytes] = []
        for position, key, block, verified in zip(positions, keys, got, verdicts, strict=True):
            if block is None:
                continue  # the peer no longer holds it (evicted since it published): a miss
            if not verified and sealed_newer(block.header):
                # A later release's seal: a miss, and no sign of a rogue (a rolling upgrade).
                newer.append(key)
                why[position] = "newer_format"
                continue
            if not verified:  # never installed nor served; the next holder may have it
                refused.append(key)
                why[position] = "corrupt"
                continue
            payloads[position] = block.payload
            why.pop(position, None)  # an earlier holder's failure, made good
            self.counters.add("peer_hits")
            self.counters.add(f"peer_hits_{transport}")
            self.counters.add("peer_bytes", len(block.payload))
        if newer:
            if landing is not None:
                landing.abandon(newer)
            self.counters.add("peer_newer_format_blocks", len(newer))
        if refused:
            if landing is not None:
                landing.abandon(refused)  # pages they were received into are not reused yet
            self.counters.add("peer_corrupt_blocks", len(refused))
            await self._suspect(node, forged=True)

    async def _over_ucx(
        self,
        node: str,
        link: UcxPeerLink,
        keys: list[bytes],
        namespace: bytes,
        landing: Landing | None,
    ) -> list[SealedBlock | None]:
        budget = self._budget()
        if budget <= 0:
            raise DeadlineExceededError("no time left")
        try:
            keyring = self.keyring or installed_keyring()
            return await link.get(keys, namespace, budget, landing, self._holder(node), keyring)
        except UcxTransportError as exc:
            if self._budget() <= 0:
                raise DeadlineExceededError(f"UCX read from node {node}: {exc}") from exc
            raise

    async def _over_grpc(
        self, node: str, keys: list[bytes], namespace: bytes
    ) -> list[SealedBlock | None]:
        budget = self._budget()
        if budget <= 0:
            raise DeadlineExceededError("no time left")
        link = self._client(node)
        return await asyncio.wait_for(link.get(keys, namespace, budget, self._holder(node)), budget)

    def _holder(self, node: str) -> tuple[str, int]:
        """The node id and boot epoch a request to ``node`` names (from its signed description)."""
        return node, self._nodes[node].epoch

    async def aclose(self) -> None:
        """Close every gRPC and UCX link."""
        await self._links.aclose()
