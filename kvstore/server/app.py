"""Running the store: build it from a :class:`Config`, serve it on grpc.aio, stop it gracefully.

``run_server`` is what ``kvstore serve`` calls. SIGTERM or SIGINT flips the health status to
NOT_SERVING, lets in-flight calls finish for ``server.shutdown_grace_s`` seconds, waits for
background block moves and closes the tiers (so LMDB is left clean for the next start).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc
from grpc_health.v1 import _async as health_async
from grpc_health.v1 import health_pb2

from kvstore.block import install_keyring
from kvstore.config import Config
from kvstore.policy import Policy
from kvstore.protocol.messages import MESSAGE_TARGET_BYTES
from kvstore.protocol.ucx import UcxTransportError
from kvstore.server.auth import check_exposure, interceptors, server_credentials
from kvstore.server.budget import InflightBudget
from kvstore.server.health import add_health_to_server
from kvstore.server.integrity import load_keyring
from kvstore.server.servicer import SERVICE_NAME, KVStoreServicer, add_to_server
from kvstore.server.shm import ShmServer
from kvstore.server.shm_limits import ShmLimits
from kvstore.server.ucx import UcxDataServer
from kvstore.server.ucx_service import add_ucx_to_server
from kvstore.store import TieredStore
from kvstore.store.prefetch import Prefetcher
from kvstore.tiers import build_tiers

__all__ = ["SERVICE_NAME", "RunningServer", "run_server", "start_server"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


def build_store(config: Config) -> TieredStore:
    """The :class:`TieredStore` a config describes, its index rebuilt from persistent tiers.

    Installs the configured integrity keyring first: blocks are signed and verified with it.
    """
    install_keyring(load_keyring(config))
    store = TieredStore(
        build_tiers(config),
        max_block_bytes=config.server.max_block_bytes,
        max_keys_per_request=config.server.max_keys_per_request,
        policy=Policy(
            shared_write=config.policy.shared_write,
            nvme_admission=config.policy.nvme_admission,
            eviction=config.policy.eviction,
        ),
    )
    store.load_index()
    return store


@dataclass
class RunningServer:
    """A started server: its bound address, the store behind it, and how to stop it."""

    server: grpc.aio.Server
    store: TieredStore
    health: health_async.HealthServicer
    address: str
    grace_s: float
    servicer: KVStoreServicer
    shm: ShmServer | None = None
    ucx: UcxDataServer | None = None

    async def stop(self) -> None:
        """Refuse new calls, let in-flight ones finish, save DRAM to NVMe, close the store.

        Saving the hot set (most recently used first, for up to ``grace_s`` seconds) makes a
        restart on the same NVMe directory warm even when everything fitted in DRAM. Each step
        runs whatever happened in the ones before (a failure is logged and the next step runs):
        a data plane that broke must not cost the saved blocks or leave LMDB unclosed.
        """
        await _step("entering graceful shutdown", self.health.enter_graceful_shutdown())
        await _step("stopping the gRPC server", self.server.stop(self.grace_s))
        if self.ucx is not None:
            await _step("closing the UCX data path", self.ucx.close())
        # Before persist and close: a prefetch batch may still be reading the nvme tier.
        await _step("closing the servicer", self.servicer.close())
        if self.shm is not None:
            await _step("closing the shared-memory data plane", self.shm.close())
            _remove_private_dir(self.shm.path)
        saved = await _step("saving volatile tiers to disk", self.store.persist(self.grace_s))
        if saved is not None:
            logger.info("saved %d block(s) from volatile tiers to disk", saved)
        await _step("closing the store", self.store.close())
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
    check_exposure(config.server)
    credentials = server_credentials(config.server)
    auth = interceptors(config.server)
    store = build_store(config)
    # Clients and the Get stream pack messages up to a soft target plus one whole block; leave
    # room beyond that so an oversized block reaches the store's own check and its clearer message.
    message_limit = 2 * config.server.max_block_bytes + MESSAGE_TARGET_BYTES + 1024**2
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", message_limit),
            ("grpc.max_send_message_length", message_limit),
            ("grpc.so_reuseport", 0),
        ],
        interceptors=auth or None,
    )
    prefetcher = Prefetcher(store, max_queued_keys=config.server.prefetch_queue_keys)
    servicer = KVStoreServicer(store, prefetcher, InflightBudget(config.server.inflight_bytes))
    add_to_server(servicer, server)
    health = health_async.HealthServicer()
    add_health_to_server(health, server)
    if credentials is None:
        port = server.add_insecure_port(config.server.listen)
    else:
        port = server.add_secure_port(config.server.listen, credentials)
    if port == 0:
        await store.close()
        raise OSError(f"cannot listen on {config.server.listen}")
    shm = await _start_shm(config, store, servicer)
    ucx = await _start_ucx(config, store, server, servicer)
    await server.start()
    for service in ("", SERVICE_NAME):
        await health.set(service, health_pb2.HealthCheckResponse.SERVING)
    host = config.server.listen.rpartition(":")[0]
    address = f"{host}:{port}"
    logger.info(
        "kvstore serving on %s (%s, %s) with tiers %s",
        address,
        "TLS" if credentials is not None else "plaintext",
        "authenticated" if auth else "unauthenticated",
        [t.name for t in store.tiers],
    )
    return RunningServer(
        server, store, health, address, config.server.shutdown_grace_s, servicer, shm, ucx
    )


_AUTO_SOCKET = "shm.sock"
# Directories this process made for ``auto`` sockets: the only ones it removes again.
_AUTO_DIRS: set[str] = set()


def shm_socket_path(setting: str, mode: int = 0o660) -> str:
    """The socket path a ``server.shm_socket`` setting names ("" when the data plane is off).

    ``auto`` creates a fresh directory with an unpredictable name (``mkdtemp``) in
    ``$XDG_RUNTIME_DIR`` (private to the user) when there is one, else the temp directory, and
    names the socket inside it: nobody else can create that path first. The directory is 0700
    plus search (x, not list) permission for group and others exactly where the socket's
    ``mode`` lets them write it, so clients the socket admits can reach it and no one else can.
    """
    if setting != "auto":
        return setting
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    parent = runtime if runtime and os.path.isdir(runtime) else tempfile.gettempdir()
    directory = tempfile.mkdtemp(prefix="kvstore-", dir=parent)
    os.chmod(directory, 0o700 | ((mode & 0o022) >> 1))
    _AUTO_DIRS.add(directory)
    return os.path.join(directory, _AUTO_SOCKET)


def _remove_private_dir(socket_path: str) -> None:
    """Remove the directory :func:`shm_socket_path` made for an ``auto`` socket, if empty."""
    directory = os.path.dirname(socket_path)
    if directory in _AUTO_DIRS:
        _AUTO_DIRS.discard(directory)
        try:
            os.rmdir(directory)
        except OSError as exc:
            logger.warning("cannot remove socket directory %s: %s", directory, exc)


async def _start_shm(
    config: Config, store: TieredStore, servicer: KVStoreServicer
) -> ShmServer | None:
    """Serve the dram arena to co-located clients, if configured and there is an arena.

    A socket that cannot be created (no such directory, no permission, a path too long) turns
    only this data plane off: the server announces no socket and clients use gRPC.
    """
    if not config.server.shm_socket or store.arena is None:
        return None
    settings = config.server
    path = shm_socket_path(settings.shm_socket, settings.shm_socket_mode)
    limits = ShmLimits(
        max_connections=settings.shm_max_connections,
        max_connections_per_uid=settings.shm_max_connections_per_uid,
        # One connection may hold a quarter of the arena unless told otherwise: several engines
        # share it, and none may pin or fill all of it.
        session_bytes=settings.shm_session_bytes or max(store.arena.capacity // 4, 1),
        frame_timeout_s=settings.shm_frame_timeout_s,
    )
    shm = ShmServer(store, path, os.urandom(16), mode=settings.shm_socket_mode, limits=limits)
    try:
        await shm.start()
    except OSError as exc:
        _remove_private_dir(path)
        logger.warning(
            "shared-memory data plane off: cannot create socket %s (%s); "
            "co-located clients will use gRPC",
            path,
            exc,
        )
        return None
    servicer.shm_socket = path
    servicer.instance_id = shm.instance_id
    return shm


async def run_server(config: Config, on_ready: Callable[[str], None] | None = None) -> None:
    """Serve until SIGTERM or SIGINT, then shut down gracefully."""
    running = await start_server(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    if on_ready is not None:
        on_ready(running.address)
    await stop.wait()
    logger.info("shutting down (grace %.1fs)", running.grace_s)
    await running.stop()


async def _start_ucx(
    config: Config, store: TieredStore, server: grpc.aio.Server, servicer: KVStoreServicer
) -> UcxDataServer | None:
    """Serve bulk transfers to remote clients over UCX, if configured and ucxx is installed."""
    if not config.server.ucx_listen:
        return None
    try:
        ucx = await add_ucx_to_server(
            server,
            store,
            config.server.ucx_listen,
            transfer_timeout_s=config.server.ucx_transfer_timeout_s,
        )
    except UcxTransportError as exc:
        logger.warning("UCX data path off: %s", exc)
        return None
    servicer.ucx_address = ucx.address
    logger.info("UCX data path on %s", ucx.address)
    return ucx
