"""What a server serves beside its gRPC port, each started once the port is bound.

``/metrics`` (:mod:`.metrics_http`; a port it cannot bind fails the start), each tenant's
shared-memory socket (:mod:`.shm`) and the UCX listener (:mod:`.ucx_service`). The two data planes
are optional: one that cannot start (a socket that cannot be created, ucxx not installed) is off,
logged, and its clients use gRPC.
"""

from __future__ import annotations

import logging
import os

import grpc

from kvstore.config import Config
from kvstore.protocol.ucx import UcxTransportError
from kvstore.server.metrics import build_registry
from kvstore.server.metrics_http import MetricsServer
from kvstore.server.servicer import KVStoreServicer
from kvstore.server.sessions import ArenaSessions
from kvstore.server.shm import ShmServer
from kvstore.server.shm_limits import ShmLimits
from kvstore.server.shm_paths import remove_private_dir, shm_socket_path, tenant_socket_path
from kvstore.server.tenancy import Tenant, Tenants
from kvstore.server.ucx import UcxDataServer, UcxScope
from kvstore.server.ucx_service import add_ucx_to_server
from kvstore.store import TieredStore

__all__ = ["session_bytes", "start_metrics", "start_shm", "start_ucx"]

logger = logging.getLogger(__name__)


async def start_metrics(config: Config, tenants: Tenants) -> MetricsServer | None:
    """Serve ``/metrics`` on ``server.metrics_listen`` (``None`` where it is off)."""
    if not config.server.metrics_listen:
        return None
    owners = (
        {identity: spec.name for spec in config.tenants for identity in spec.identities}
        if config.tenants
        else None
    )
    metrics = MetricsServer(
        build_registry(tenants), config.server.metrics_listen, config.auth, owners
    )
    url = await metrics.start()
    logger.info("metrics on %s", url)
    return metrics


async def start_shm(config: Config, tenant: Tenant) -> ShmServer | None:
    """Serve a tenant's dram arena to its co-located clients, if configured and it has one.

    A socket that cannot be created (no such directory, no permission, a path too long) turns
    only this data plane off: the server announces no socket and clients use gRPC.
    """
    store = tenant.store
    settings = config.shm
    if not tenant.socket_setting or store.arena is None:
        if tenant.name and store.arena is not None:
            logger.info(
                "tenant %s: no shared-memory data plane (tenants.%s.shm is false); its clients "
                "use gRPC or UCX",
                tenant.name,
                tenant.name,
            )
        return None
    path = ""
    try:
        if tenant.name:
            path = tenant_socket_path(tenant.socket_setting, tenant.name, settings.socket_mode)
        else:
            path = shm_socket_path(tenant.socket_setting, settings.socket_mode)
        shm = ShmServer(
            store,
            path,
            os.urandom(16),
            mode=settings.socket_mode,
            limits=_shm_limits(config, store),
            allowed_uids=tenant.uids,
            allowed_gids=tenant.gids,
            tenant=tenant.name,
        )
        await shm.start()
    except OSError as exc:
        if path:
            remove_private_dir(path)
        logger.warning(
            "shared-memory data plane off: cannot create socket %s (%s); "
            "co-located clients will use gRPC",
            path or tenant.socket_setting,
            exc,
        )
        return None
    if tenant.name and tenant.uids is None and tenant.gids is None:
        _warn_open_socket(tenant.name, settings.socket_mode)
    return shm


def _shm_limits(config: Config, store: TieredStore) -> ShmLimits:
    """What one tenant's shared-memory server lets its connections hold and take."""
    settings = config.shm
    return ShmLimits(
        max_connections=settings.max_connections,
        max_connections_per_uid=settings.max_connections_per_uid,
        session_bytes=session_bytes(config, store),
        frame_timeout_s=settings.frame_timeout_s,
    )


def _warn_open_socket(tenant: str, mode: int) -> None:
    """Warn that a tenant's socket admits any local process its mode lets in (no uids, gids)."""
    logger.warning(
        "tenant %s lists no uids or gids: its shared-memory socket admits every local "
        "process that mode %s lets in and that knows its path (only the path is secret); "
        "set tenants.%s.uids or tenants.%s.gids to admit the tenant's own users only",
        tenant,
        oct(mode),
        tenant,
        tenant,
    )


def session_bytes(config: Config, store: TieredStore) -> int | None:
    """Arena bytes one connection or transfer may hold leased or reserved (``None``: no arena).

    A quarter of the arena unless told otherwise: several engines share it, and none may pin or
    fill all of it.
    """
    if store.arena is None:
        return None
    return config.shm.session_bytes or max(store.arena.capacity // 4, 1)


async def start_ucx(
    config: Config, tenants: Tenants, server: grpc.aio.Server, servicer: KVStoreServicer
) -> UcxDataServer | None:
    """Serve bulk transfers to remote clients over UCX, if configured and ucxx is installed.

    Each call works on its caller's tenant's store, and one transfer holds at most what one
    shared-memory connection may (``shm.session_bytes``) of that tenant's arena.
    """
    if not config.ucx.listen:
        return None
    scopes = {
        tenant.name: UcxScope(
            tenant.name,
            tenant.store,
            ArenaSessions(tenant.store, session_bytes(config, tenant.store)),
        )
        for tenant in tenants
    }
    try:
        ucx = await add_ucx_to_server(
            server,
            next(iter(tenants)).store,
            config.ucx.listen,
            transfer_timeout_s=config.ucx.transfer_timeout_s,
            scopes=lambda: scopes[tenants.current().name],
            max_lanes=config.ucx.max_lanes,
            connection_bytes=config.ucx.connection_bytes_in_flight,
            tenant_bytes=config.ucx.tenant_bytes_in_flight,
        )
    except UcxTransportError as exc:
        logger.warning("UCX data path off: %s", exc)
        return None
    servicer.ucx_address = ucx.address
    logger.info("UCX data path on %s", ucx.address)
    return ucx
