"""Running the store: build it from a :class:`Config`, serve it on grpc.aio, stop it gracefully.

``run_server`` is what ``kvstore serve`` calls. SIGTERM or SIGINT flips the health status to
NOT_SERVING, lets in-flight calls finish for ``server.shutdown_grace_s`` seconds, waits for
background block moves and closes the tiers (so LMDB is left clean for the next start).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import _async as health_async
from grpc_health.v1 import health_pb2

from kvstore.block import Keyring, install_keyring, installed_keyring
from kvstore.config import Config
from kvstore.errors import AuthenticationError
from kvstore.node.agent import ClusterNode, start_cluster
from kvstore.node.key_schemes import NodeKeySchemes
from kvstore.policy import Policy
from kvstore.protocol.messages import MESSAGE_TARGET_BYTES
from kvstore.server.auth import check_exposure, interceptors, server_credentials
from kvstore.server.budget import InflightBudget
from kvstore.server.health import add_health_to_server
from kvstore.server.integrity import load_keyring
from kvstore.server.keyring_check import check_shared_keyring
from kvstore.server.memory import install_tracemalloc_dump, trim_heap_periodically
from kvstore.server.metrics_http import MetricsServer
from kvstore.server.peer_gate import PeerGate
from kvstore.server.planes import start_metrics, start_shm, start_ucx
from kvstore.server.servicer import SERVICE_NAME, KVStoreServicer, add_to_server
from kvstore.server.shm import ShmServer
from kvstore.server.shm_paths import remove_private_dir
from kvstore.server.tenancy import TENANTS_DIR, Tenant, Tenants, check_tenants, tenant_config
from kvstore.server.ucx import UcxDataServer
from kvstore.store import TieredStore
from kvstore.store.prefetch import Prefetcher
from kvstore.tiers import build_tiers
from kvstore.tiers.base import Tier
from kvstore.tiers.nvme import private_directory

__all__ = [
    "SERVICE_NAME",
    "RunningServer",
    "build_store",
    "open_tenants",
    "run_server",
    "start_server",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")


def build_store(
    config: Config,
    keyring: Keyring | None = None,
    tiers: list[Tier] | None = None,
    retention_setting: str = "policy.max_retention_s",
) -> TieredStore:
    """The :class:`TieredStore` a config describes, its index rebuilt from persistent tiers.

    Its tiers (``tiers``, else those the config describes) sign and verify blocks with
    ``keyring``; ``None``: the keyring installed for the whole process (:func:`open_tenants`
    installs the configured one first). ``retention_setting`` names where
    ``policy.max_retention_s`` came from, in refusals.
    """
    store = TieredStore(
        tiers if tiers is not None else build_tiers(config),
        max_block_bytes=config.server.max_block_bytes,
        max_keys_per_request=config.server.max_keys_per_request,
        policy=Policy(
            shared_write=config.policy.shared_write,
            nvme_admission=config.policy.nvme_admission,
            eviction=config.policy.eviction,
            promote_after_reads=config.hbm.promote_after_reads,
            max_retention_s=config.policy.max_retention_s,
            max_retention_setting=retention_setting,
        ),
        keyring=keyring,
    )
    store.load_index()
    return store


async def open_tenants(config: Config) -> Tenants:
    """The store of every tenant ``config`` names (:mod:`.tenancy`), or the one shared store of a
    server without tenants; stores opened before one that fails are closed again."""
    keyring = load_keyring(config)
    install_keyring(keyring)
    if not config.tenants:
        return Tenants.single(await _open_tenant("", config, None))
    if config.nvme.path and any(spec.nvme for spec in config.tenants):
        # The tenants' root and its directory of tenant names are ours alone: nobody lists them.
        private_directory(Path(config.nvme.path))
        private_directory(Path(config.nvme.path) / TENANTS_DIR)
    opened: list[Tenant] = []
    try:
        for spec in config.tenants:
            opened.append(
                await _open_tenant(
                    spec.name,
                    tenant_config(config, spec),
                    keyring.for_tenant(spec.name),
                    frozenset(spec.uids) or None,
                    frozenset(spec.gids) or None,
                )
            )
    except BaseException:
        for tenant in opened:
            await _close_tenant(tenant)
        raise
    owners = {identity: spec.name for spec in config.tenants for identity in spec.identities}
    return Tenants(opened, owners)


async def _open_tenant(
    name: str,
    config: Config,
    keyring: Keyring | None,
    uids: frozenset[int] | None = None,
    gids: frozenset[int] | None = None,
) -> Tenant:
    """One tenant's store (``config``: the tenant's own, :func:`tenant_config`), its prefetch
    queue and its in-flight budget; its shared tier only where its keyring matches the other
    nodes' (:mod:`.keyring_check`)."""
    tiers, record = await check_shared_keyring(
        build_tiers(config), keyring or installed_keyring(), name
    )
    setting = (
        f"tenants.{name}.max_retention_s, else policy.max_retention_s"
        if name
        else "policy.max_retention_s"
    )
    store = build_store(config, keyring, tiers, setting)
    server = config.server
    prefetcher = Prefetcher(store, max_queued_keys=server.prefetch_queue_keys)
    return Tenant(
        name,
        store,
        prefetcher,
        InflightBudget(server.inflight_bytes),
        uids,
        gids,
        socket_setting=config.shm.socket,
        keyring_record=record,
    )


async def _close_tenant(tenant: Tenant) -> None:
    """Leave the keyring record and close the store of a tenant that never served."""
    if tenant.keyring_record is not None:
        await tenant.keyring_record.close()
    await tenant.store.close()


@dataclass
class RunningServer:
    """A started server: its bound address, the tenants' stores behind it, and how to stop it.

    ``store`` and ``shm`` are the first tenant's (the only one of a server without tenants).
    """

    server: grpc.aio.Server
    tenants: Tenants
    health: health_async.HealthServicer
    address: str
    grace_s: float
    servicer: KVStoreServicer
    ucx: UcxDataServer | None = None
    cluster: ClusterNode | None = None
    metrics: MetricsServer | None = None

    @property
    def store(self) -> TieredStore:
        """The first tenant's store."""
        return next(iter(self.tenants)).store

    @property
    def shm(self) -> ShmServer | None:
        """The first tenant's shared-memory server."""
        return next(iter(self.tenants)).shm

    async def stop(self) -> None:
        """Refuse new calls, let in-flight ones finish, save DRAM to NVMe, close the store.

        Saving the hot set (most recently used first, for up to ``grace_s`` seconds) makes a
        restart on the same NVMe directory warm even when everything fitted in DRAM. Each step
        runs whatever happened in the ones before (a failure is logged and the next step runs):
        a data plane that broke must not cost the saved blocks or leave LMDB unclosed.
        """
        if self.cluster is not None:  # first: nobody should be routed here any more
            await _step("leaving the cluster index", self.cluster.stop())
        for tenant in self.tenants:
            if tenant.keyring_record is not None:
                await _step("leaving the keyring record", tenant.keyring_record.close())
        await _step("entering graceful shutdown", self.health.enter_graceful_shutdown())
        if self.metrics is not None:
            await _step("closing the metrics endpoint", self.metrics.close())
        await _step("stopping the gRPC server", self.server.stop(self.grace_s))
        if self.ucx is not None:
            await _step("closing the UCX data path", self.ucx.close())
        # Before persist and close: a prefetch batch may still be reading the nvme tier.
        await _step("closing the servicer", self.servicer.close())
        for tenant in self.tenants:
            if tenant.shm is not None:
                await _step("closing the shared-memory data plane", tenant.shm.close())
                remove_private_dir(tenant.shm.path)
        for tenant in self.tenants:
            saved = await _step("saving volatile tiers to disk", tenant.store.persist(self.grace_s))
            if saved:
                logger.info("saved %d block(s) from volatile tiers to disk", saved)
            await _step("closing the store", tenant.store.close())
        logger.info("kvstore stopped")


async def _step(what: str, step: Awaitable[T]) -> T | None:
    """Await one shutdown step; a failure is logged (``None`` returned), never raised."""
    try:
        return await step
    except Exception:
        logger.exception("shutdown: %s failed; going on with the rest", what)
        return None


async def start_server(config: Config) -> RunningServer:
    """Build the store and start serving it; returns once the port is bound.

    Security settings are checked first (a server that would listen beyond loopback with nobody
    authenticated, an unreadable certificate or tokens file): ConfigError before anything opens.
    """
    check_exposure(config)
    check_tenants(config)
    credentials = server_credentials(config.auth)
    gate: PeerGate | None = None

    async def peer_check(method: str, authenticator: str, request: Any, context: Any) -> None:
        if gate is None:  # calls are served only once the server started: not reached
            raise AuthenticationError("the server is starting")
        await gate.check(method, authenticator, request, context)

    # Only a node of a cluster index admits peer reads (elsewhere an authenticator opens nothing).
    auth = interceptors(config.auth, peer_check if config.cluster.enabled else None)
    tenants = await open_tenants(config)
    gate = PeerGate(tenants)
    server = _grpc_server(config, auth)
    servicer = KVStoreServicer(
        tenants=tenants, put_stream_timeout_s=config.server.put_stream_timeout_s
    )
    # The key schemes this node serves: its [keys] settings, and the namespaces its engines'
    # connectors declare (through the servicer's KeyScheme call, which reads
    # servicer.key_schemes); published in the cluster index.
    key_schemes = servicer.key_schemes = NodeKeySchemes(config.keys.scheme())
    add_to_server(servicer, server)
    health = health_async.HealthServicer()
    add_health_to_server(health, server)
    if credentials is None:
        port = server.add_insecure_port(config.server.listen)
    else:
        port = server.add_secure_port(config.server.listen, credentials)
    try:
        if port == 0:
            raise OSError(f"cannot listen on {config.server.listen}")
        metrics = await start_metrics(config, tenants)
    except OSError:
        for tenant in tenants:  # nothing serves them: leave LMDB closed for the next start
            await _close_tenant(tenant)
        raise
    for tenant in tenants:
        tenant.shm = await start_shm(config, tenant)
    ucx = await start_ucx(config, tenants, server, servicer)
    await server.start()
    for service in ("", SERVICE_NAME):
        await health.set(service, health_pb2.HealthCheckResponse.SERVING)
    host = config.server.listen.rpartition(":")[0]
    address = f"{host}:{port}"
    _log_serving(config, address, credentials is not None, tenants)
    cluster = await _join_cluster(config, tenants, address, servicer, key_schemes, gate)
    return RunningServer(
        server,
        tenants,
        health,
        address,
        config.server.shutdown_grace_s,
        servicer,
        ucx,
        cluster,
        metrics,
    )


def _grpc_server(
    config: Config, auth: list[grpc.aio.ServerInterceptor[Any, Any]]
) -> grpc.aio.Server:
    """The gRPC server, its message limits sized to the largest block (no port bound yet)."""
    # Clients and the Get stream pack messages up to a soft target plus one whole block; leave
    # room beyond that so an oversized block reaches the store's own check and its clearer message.
    message_limit = 2 * config.server.max_block_bytes + MESSAGE_TARGET_BYTES + 1024**2
    return grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", message_limit),
            ("grpc.max_send_message_length", message_limit),
            ("grpc.so_reuseport", 0),
        ],
        interceptors=auth or None,
    )


def _log_serving(config: Config, address: str, tls: bool, tenants: Tenants) -> None:
    """Say where the server serves, how callers are checked, and with which tiers."""
    logger.info(
        "kvstore serving on %s (%s, %s) with tiers %s%s",
        address,
        "TLS" if tls else "plaintext",
        "authenticated" if config.auth.authenticates else "unauthenticated",
        [t.name for t in next(iter(tenants)).store.tiers],
        f" for {len(tenants)} tenants" if config.tenants else "",
    )


async def _join_cluster(
    config: Config,
    tenants: Tenants,
    address: str,
    servicer: KVStoreServicer,
    key_schemes: NodeKeySchemes,
    gate: PeerGate,
) -> ClusterNode | None:
    """Take this node's part in the cluster index (``None`` unless ``cluster.enabled``); the
    ``gate`` admits other nodes' reads once the node has a boot epoch."""
    stores = {tenant.name: tenant.store for tenant in tenants}
    cluster = await start_cluster(config, stores, address, servicer.ucx_address, key_schemes)
    if cluster is not None:
        membership = cluster.membership
        gate.identity = lambda: (membership.node_id, membership.epoch)
    return cluster


async def run_server(
    config: Config,
    on_ready: Callable[[str], None] | None = None,
    on_metrics: Callable[[str], None] | None = None,
) -> None:
    """Serve until SIGTERM or SIGINT, then shut down gracefully (``on_metrics`` gets the metrics
    endpoint's URL, where there is one, just before ``on_ready`` the gRPC address)."""
    running = await start_server(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    install_tracemalloc_dump(loop)  # only with KVSTORE_DEBUG_TRACEMALLOC set (debugging)
    # Payload buffers freed after a burst (a failover's re-send queue, a load spike) stay in
    # glibc's heap as free memory, and RSS would keep the burst's high-water mark for good.
    trimmer = loop.create_task(trim_heap_periodically(), name="kvstore-malloc-trim")
    if on_metrics is not None and running.metrics is not None:
        on_metrics(running.metrics.url)
    if on_ready is not None:
        on_ready(running.address)
    await stop.wait()
    logger.info("shutting down (grace %.1fs)", running.grace_s)
    trimmer.cancel()
    await running.stop()
