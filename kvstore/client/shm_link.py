"""How a client decides, by itself, whether to use the shared-memory data plane.

The first data call asks the server over gRPC where its shared-memory socket is (``DataPlane``)
and tries to connect. That works only on the same host: elsewhere the path is missing, or leads to
another server, which the greeting's instance id exposes. If it works, data calls go through
shared memory; if not, or if the path breaks later, they go through gRPC, and the client tries
shared memory again after :data:`RETRY_AFTER_S` seconds (a restarted server, say).

``data_plane="grpc"`` never tries; ``"shm"`` insists and raises
:class:`~kvstore.errors.StoreUnavailableError` where ``"auto"`` (the default) would fall back;
``"ucx"`` skips shared memory for the UCX path (which ``"auto"`` takes when shared memory is not
possible and the server has a UCX listener; see :mod:`kvstore.client.ucx`).
A client built without ``data_plane`` takes it from its
:class:`~kvstore.client.settings.ClientSettings` (``KVSTORE_DATA_PLANE``), else ``"auto"``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from kvstore.client.arena_registration import Registrar
from kvstore.client.settings import DATA_PLANES, ClientSettings
from kvstore.client.shm import ShmDataPlane, ShmUnavailableError
from kvstore.errors import StoreUnavailableError
from kvstore.keys import NAMESPACE_BYTES

__all__ = ["DATA_PLANES", "RETRY_AFTER_S", "ShmLink"]

logger = logging.getLogger(__name__)

#: Seconds to wait after a failure before trying shared memory again.
RETRY_AFTER_S = 5.0


class ShmLink:
    """The shared-memory path of one client, if it has one (see the module docstring)."""

    def __init__(self, settings: ClientSettings, namespace: bytes | None, timeout: float) -> None:
        self.mode = settings.data_plane
        self._direct_reads = settings.shm_direct_reads
        self._prefault = settings.shm_prefault
        self._register_limit = settings.shm_cuda_register
        self._registrar: Registrar | None = None  # set by register_with
        #: Whether :meth:`register_with` was called (with a registrar or without one).
        self.register_asked = False
        self._namespace = namespace
        self._timeout = timeout
        self._plane: ShmDataPlane | None = None
        self._retry_at = 0.0
        self._lock = threading.Lock()

    def wanted(self) -> bool:
        """Whether a data call should try shared memory now (else it goes straight to gRPC)."""
        if self.mode in ("grpc", "ucx") or self._namespace is None:
            return False
        if len(self._namespace) != NAMESPACE_BYTES:
            return False  # let the gRPC call report the malformed namespace
        # "shm" insists: every call tries (and raises) rather than sliding to gRPC meanwhile.
        return self.mode == "shm" or self._plane is not None or time.monotonic() >= self._retry_at

    @property
    def plane(self) -> ShmDataPlane | None:
        """The connected path, if any."""
        return self._plane

    def connect(self, endpoints: Any, timeout: float | None = None) -> ShmDataPlane | None:
        """Connect to the socket a ``DataPlaneResponse`` names, waiting at most ``timeout``
        seconds (default: the client's) for its greeting; ``None`` means use gRPC."""
        with self._lock:
            if self._plane is not None:
                return self._plane
            plane = None
            try:
                if not endpoints.shm_socket:
                    raise ShmUnavailableError("the server has no shared-memory data plane")
                assert self._namespace is not None
                plane = ShmDataPlane(
                    endpoints.shm_socket,
                    self._namespace,
                    timeout=self._timeout,
                    direct_reads=self._direct_reads,
                    prefault=self._prefault,
                    connect_timeout=timeout,
                )
                if plane.instance_id != endpoints.instance_id:
                    raise ShmUnavailableError(
                        f"{endpoints.shm_socket} belongs to another server (not on this host?)"
                    )
            except ShmUnavailableError as exc:
                if plane is not None:
                    plane.close()
                self._give_up(exc)
                return None
            self._plane = plane
            if self._registrar is not None:
                plane.register_with(self._registrar, self._register_limit)
            logger.debug("using the shared-memory data plane at %s", endpoints.shm_socket)
            return plane

    def register_with(self, registrar: Registrar | None) -> None:
        """Page-lock the mapped arena for DMA with ``registrar`` from now on: the plane of
        today, and each one a reconnection opens (a restarted server's arena is another);
        ``None`` records that there is nothing to register with (no CUDA in this process)."""
        with self._lock:
            self._registrar, self.register_asked = registrar, True
            plane = self._plane
        if plane is not None and registrar is not None:
            plane.register_with(registrar, self._register_limit)

    def failed(self, exc: BaseException) -> None:
        """Forget a path that broke mid-call (the call then goes through gRPC)."""
        with self._lock:
            plane, self._plane = self._plane, None
        if plane is not None:
            plane.close()
        self._give_up(exc)

    def _give_up(self, exc: BaseException) -> None:
        self._retry_at = time.monotonic() + RETRY_AFTER_S
        if self.mode == "shm":
            raise StoreUnavailableError(f"shared-memory data plane unavailable: {exc}") from exc
        logger.debug("shared-memory data plane unavailable, using gRPC: %s", exc)

    def close(self) -> None:
        """Close the path, if open."""
        with self._lock:
            plane, self._plane = self._plane, None
        if plane is not None:
            plane.close()
