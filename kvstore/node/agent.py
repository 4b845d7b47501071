"""Starting and stopping a server's part in the cluster index (``cluster.enabled``)."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from kvstore.block import installed_keyring
from kvstore.cluster.index import ClusterIndex
from kvstore.cluster.layout import Client, Layout, connect
from kvstore.cluster.records import NodeInfo
from kvstore.cluster_config import ClusterConfig, namespace_from_json
from kvstore.config import Config, hash_secret
from kvstore.errors import ConfigError
from kvstore.node.engine_chunks import EngineChunks, LocalPublisher
from kvstore.node.engine_events import EngineEvents, load_event_modules
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
    ):
        self.client = client
        self.membership = membership
        self.publishers = publishers
        #: By tenant: the store and the peer source it reads through.
        self.peers = dict(peers or {})
        #: The engine's KV events, with ``cluster.engine_events``.
        self.engine = engine

    async def stop(self) -> None:
        """Leave the index: lease first (entries stop counting at once), then the entries."""
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
    config: Config, stores: Mapping[str, TieredStore], grpc: str, ucx: str = ""
) -> ClusterNode | None:
    """Register this node and publish each tenant's store (keyed by tenant name, "" for a server
    without tenants); ``None`` unless ``cluster.enabled``. Redis being down does not fail it."""
    settings = config.cluster
    if not settings.enabled:
        return None
    url = settings.url or config.redis.url
    if not url:  # Config refuses this; a hand-built one may not
        raise ConfigError("cluster.enabled needs cluster.url or redis.url; both are empty")
    engine_tenant = _engine_tenant(settings, stores)
    client = connect(url, timeout_s=min(2.0, settings.lease_ttl_s / 3))
    layout = Layout(settings.key_prefix)
    node_id = node_id_for(settings.node_id, config.nvme.path)
    capacity: dict[str, int] = {}
    for store in stores.values():
        for tier in store.tiers:
            capacity[tier.name] = capacity.get(tier.name, 0) + tier.capacity
    publishers: list[Publisher] = []

    def rejoined() -> None:
        for publisher in publishers:
            publisher.resync()

    # The cluster's secrets, not a tenant's: node descriptions are the whole node's.
    keyring = installed_keyring()
    membership = Membership(
        client,
        layout,
        lambda epoch: NodeInfo(node_id, epoch, settings.grpc_target(grpc), ucx, capacity),
        settings.lease_ttl_s,
        rejoined,
        keyring,
    )
    engine: EngineEvents | None = None
    for tenant, store in stores.items():
        kind = LocalPublisher if tenant == engine_tenant else Publisher
        publisher = kind(
            client, layout.for_tenant(tenant), store, membership, settings.publish_interval_s
        )
        publishers.append(publisher)
        if isinstance(publisher, LocalPublisher):
            engine = EngineEvents(settings.engine_events, _engine_chunks(settings, publisher))
    for publisher in publishers:
        publisher.start()
    await membership.start()
    if engine is not None:
        engine.start()
    logger.info("cluster index: node %s publishing to %s", node_id, settings.key_prefix)
    peers: dict[str, tuple[TieredStore, PeerSource]] = {}
    if settings.shared_data in ("peers", "both"):
        if settings.peer_token:
            logger.warning(
                "cluster.peer_token is deprecated and no longer sent to any node: nodes prove "
                "themselves to each other with keys derived from the integrity secrets; remove it"
            )
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
            )
            store.set_remote_source(source)
            peers[tenant] = (store, source)
        logger.info(
            "cluster index: reading other nodes' blocks from peers (%s, transport %s)",
            settings.shared_data,
            settings.peer_transport,
        )
    return ClusterNode(client, membership, publishers, peers, engine)


def _engine_tenant(settings: ClusterConfig, stores: Mapping[str, TieredStore]) -> str | None:
    """The tenant whose store the engine's connector uses (its namespace's), or ``None`` when
    ``cluster.engine_events`` is off; checks that the event modules are installed."""
    if not settings.engine_events:
        return None
    load_event_modules()
    tenant = namespace_from_json(settings.engine_namespace, "cluster.engine_namespace").tenant
    if tenant not in stores:
        raise ConfigError(
            f"cluster.engine_namespace: tenant {tenant!r} is not served here; "
            f"tenants: {sorted(stores)}"
        )
    return tenant


def _engine_chunks(settings: ClusterConfig, publisher: LocalPublisher) -> EngineChunks:
    algorithm = settings.engine_hash_algorithm
    return EngineChunks(
        namespace_from_json(settings.engine_namespace, "cluster.engine_namespace"),
        settings.engine_chunk_size,
        hash_secret().encode(),
        publisher.hold,
        publisher.release,
        algorithm="sha256" if algorithm == "sha256" else "xxh3_128",
        max_blocks=settings.engine_max_blocks,
    )
