"""Starting and stopping a server's part in the cluster index (``cluster.enabled``).

The node's description carries the key schemes it serves (:class:`NodeKeySchemes`: its
``[keys]`` settings and the namespaces its engines declared), re-signed as soon as an engine
declares a new one. With ``cluster.engine_events`` the engine's blocks are named by the first
scheme with a namespace (``keys.namespace``, else the first an engine's connector declares);
until one exists the events are not followed (logged once).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping

from kvstore.block import Keyring, installed_keyring
from kvstore.cluster.index import ClusterIndex
from kvstore.cluster.layout import Client, Layout, connect
from kvstore.cluster.records import NodeInfo, reads_now
from kvstore.config import Config
from kvstore.config.cluster import PEER_TOKEN_DEPRECATED
from kvstore.errors import ConfigError
from kvstore.formats import RECORD
from kvstore.key_scheme import KeyScheme
from kvstore.node.engine_chunks import EngineChunks, LocalPublisher
from kvstore.node.engine_events import EngineEvents, load_event_modules
from kvstore.node.key_schemes import NodeKeySchemes
from kvstore.node.membership import Membership, node_id_for
from kvstore.node.peers import PeerSource
from kvstore.node.publisher import Publisher
from kvstore.store import TieredStore

__all__ = ["ClusterNode", "start_cluster"]

logger = logging.getLogger(__name__)


class ClusterNode:
    """A node's membership, one publisher per tenant store and, with peer fetch, one peer
    source per tenant store."""

    def __init__(
        self,
        client: Client,
        membership: Membership,
        publishers: list[Publisher],
        peers: Mapping[str, tuple[TieredStore, PeerSource]] | None = None,
        engine: EngineEvents | None = None,
        key_schemes: NodeKeySchemes | None = None,
    ):
        self.client = client
        self.membership = membership
        self.publishers = publishers
        #: By tenant: the store and the peer source it reads through.
        self.peers = dict(peers or {})
        #: The engine's KV events, with ``cluster.engine_events`` (``None`` until a key scheme
        #: with a namespace is known).
        self.engine = engine
        #: The key schemes the node publishes.
        self.key_schemes = key_schemes
        self.stopped = False

    async def stop(self) -> None:
        """Leave the index: lease first (entries stop counting at once), then the entries."""
        self.stopped = True  # a late declaration starts no engine events
        if self.engine is not None:
            await self.engine.stop()
        for store, source in self.peers.values():
            store.set_remote_source(None)
            await source.aclose()
        for publisher in self.publishers:
            await publisher.stop()
        await self.membership.stop()
        for publisher in self.publishers:
            await publisher.withdraw()
        await self.client.aclose()


async def start_cluster(
    config: Config,
    stores: Mapping[str, TieredStore],
    grpc: str,
    ucx: str = "",
    key_schemes: NodeKeySchemes | None = None,
) -> ClusterNode | None:
    """Register this node and publish each tenant's store (keyed by tenant name, "" for a server
    without tenants) and the key schemes it serves (``key_schemes``; ``None``: those of
    ``config.keys``); ``None`` unless ``cluster.enabled``. Redis being down does not fail it."""
    settings = config.cluster
    if not settings.enabled:
        return None
    url = settings.url or config.redis.url
    if not url:  # Config refuses this; a hand-built one may not
        raise ConfigError("cluster.enabled needs cluster.url or redis.url; both are empty")
    schemes = key_schemes if key_schemes is not None else NodeKeySchemes(config.keys.scheme())
    if settings.engine_events:
        load_event_modules()
        if schemes.configured.namespace is not None:
            _engine_tenant(schemes.configured, stores)  # refused before anything starts
    client = connect(url, timeout_s=min(2.0, settings.lease_ttl_s / 3))
    layout = Layout(settings.key_prefix)
    node_id = node_id_for(settings.node_id, config.nvme.path)
    publishers: list[Publisher] = []

    def rejoined() -> None:
        for publisher in publishers:
            publisher.resync()

    # The cluster's secrets, not a tenant's: node descriptions are the whole node's.
    keyring = installed_keyring()
    described = _description(config, node_id, grpc, ucx, _capacity(stores), schemes)
    membership = Membership(client, layout, described, settings.lease_ttl_s, rejoined, keyring)
    local = _add_publishers(publishers, config, client, layout, stores, membership)
    for publisher in publishers:
        publisher.start()
    await membership.start()
    schemes.add_listener(membership.changed)
    logger.info("cluster index: node %s publishing to %s", node_id, settings.key_prefix)
    peers: dict[str, tuple[TieredStore, PeerSource]] = {}
    if settings.shared_data in ("peers", "both"):
        peers = _read_from_peers(config, client, layout, keyring, node_id, stores)
    node = ClusterNode(client, membership, publishers, peers, None, schemes)
    if settings.engine_events:
        _follow_engine(node, settings.engine_events, settings.engine_max_blocks, local)
    return node


def _capacity(stores: Mapping[str, TieredStore]) -> dict[str, int]:
    """The node's capacity by tier name, summed over its tenants' stores."""
    capacity: dict[str, int] = {}
    for store in stores.values():
        for tier in store.tiers:
            capacity[tier.name] = capacity.get(tier.name, 0) + tier.capacity
    return capacity


def _description(
    config: Config,
    node_id: str,
    grpc: str,
    ucx: str,
    capacity: dict[str, int],
    schemes: NodeKeySchemes,
) -> Callable[[int], NodeInfo]:
    """The node's description for a membership epoch (its key schemes read each time, so that a
    re-signed description carries the ones declared since)."""
    settings = config.cluster

    def described(epoch: int) -> NodeInfo:
        return NodeInfo(
            node_id,
            epoch,
            settings.grpc_target(grpc),
            ucx,
            capacity,
            keys=_published(schemes),
            version=RECORD.writes(settings.write_formats),
            formats=reads_now(),
        )

    return described


def _add_publishers(
    publishers: list[Publisher],
    config: Config,
    client: Client,
    layout: Layout,
    stores: Mapping[str, TieredStore],
    membership: Membership,
) -> dict[str, LocalPublisher]:
    """Append one (not yet started) publisher per tenant store to ``publishers`` (the list the
    membership's rejoin callback resyncs); return those that can also publish the engine's
    blocks, by tenant."""
    settings = config.cluster
    local: dict[str, LocalPublisher] = {}
    for tenant, store in stores.items():
        # With engine events any tenant may turn out to be the engine's (its namespace's).
        kind = LocalPublisher if settings.engine_events else Publisher
        publisher = kind(
            client, layout.for_tenant(tenant), store, membership, settings.publish_interval_s
        )
        publishers.append(publisher)
        if isinstance(publisher, LocalPublisher):
            local[tenant] = publisher
    return local


def _read_from_peers(
    config: Config,
    client: Client,
    layout: Layout,
    keyring: Keyring,
    node_id: str,
    stores: Mapping[str, TieredStore],
) -> dict[str, tuple[TieredStore, PeerSource]]:
    """Give each tenant store a peer source (``cluster.shared_data`` peers or both): a miss is
    read from another node that the tenant's index says holds the block."""
    settings = config.cluster
    if settings.peer_token:
        logger.warning("%s", PEER_TOKEN_DEPRECATED)
    peers: dict[str, tuple[TieredStore, PeerSource]] = {}
    for tenant, store in stores.items():
        source = PeerSource(
            ClusterIndex(client, layout.for_tenant(tenant), keyring),
            node_id,
            store.counters,
            tenant=tenant,
            timeout_s=settings.peer_timeout_s,
            max_block_bytes=store.max_block_bytes,
            transport=settings.peer_transport,
            keyring=store.keyring,
            ucx_lanes=config.ucx.lanes,
        )
        store.set_remote_source(source)
        peers[tenant] = (store, source)
    logger.info(
        "cluster index: reading other nodes' blocks from peers (%s, transport %s)",
        settings.shared_data,
        settings.peer_transport,
    )
    return peers


def _published(schemes: NodeKeySchemes) -> tuple[str, ...]:
    """The schemes a node's description carries: those it serves, else (no engine declared one
    yet) its configured one without a namespace, so that a router still sees its chunk size."""
    return tuple(s.to_json() for s in schemes.current() or (schemes.configured,))


def _engine_tenant(scheme: KeyScheme, stores: Mapping[str, object]) -> str:
    """The tenant whose store the engine's connector uses (its namespace's)."""
    assert scheme.namespace is not None
    tenant = scheme.namespace.tenant
    if tenant not in stores:
        raise ConfigError(
            f"the engine's key namespace (keys.namespace, or its connector's) names tenant "
            f"{tenant!r}, which is not served here; tenants: {sorted(stores)}"
        )
    return tenant


def _follow_engine(
    node: ClusterNode, endpoint: str, max_blocks: int, local: Mapping[str, LocalPublisher]
) -> None:
    """Follow the engine's events with the first scheme that has a namespace: now if there is
    one, else once an engine declares one (the declaring thread hands it to the loop)."""
    schemes = node.key_schemes
    assert schemes is not None
    loop = asyncio.get_running_loop()

    def start() -> None:
        if node.engine is not None or node.stopped:
            return
        scheme = next((s for s in schemes.current() if s.namespace is not None), None)
        if scheme is None:
            return
        try:
            publisher = local[_engine_tenant(scheme, local)]
            secret = scheme.secret()
        except ConfigError as exc:
            logger.error("cluster.engine_events: not following the engine's events: %s", exc)
            return
        chunks = EngineChunks(
            scheme.namespace,  # type: ignore[arg-type]
            scheme.chunk_size,
            secret,
            publisher.hold,
            publisher.release,
            algorithm=scheme.hash_algorithm,
            max_blocks=max_blocks,
        )
        node.engine = EngineEvents(endpoint, chunks)
        node.engine.start()
        logger.info("cluster.engine_events: naming the engine's blocks with %s", scheme.describe())

    if any(s.namespace is not None for s in schemes.current()):
        start()
        return
    logger.info(
        "cluster.engine_events: waiting for an engine's connector to declare its key namespace "
        "(or set keys.namespace); the engine's blocks are not published until then"
    )

    def declared() -> None:
        if not loop.is_closed():
            loop.call_soon_threadsafe(start)

    schemes.add_listener(declared)
