"""The settings of the ``kvstore serve`` process itself (``[server]``): endpoints, request
limits, the shared-memory and UCX data planes, and security. A plain frozen dataclass that checks
its own values; :mod:`kvstore.config` loads it."""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvstore.errors import ConfigError
from kvstore.store_config import require_positive

__all__ = ["ServerConfig"]


@dataclass(frozen=True)
class ServerConfig:
    """The gRPC endpoint, request limits, ``workers`` threads for blocking disk I/O, and the
    shared-memory socket (``shm_socket``: a path, ``auto`` for one in the temp directory named
    after the process, or empty to turn the shared-memory data plane off) with its permission bits
    (``shm_socket_mode``, octal: a client must be able to write the socket to connect) and its
    bounds (connections in all and per peer uid, arena bytes one connection may hold leased or
    reserved, 0 meaning a quarter of ``dram.capacity``, seconds a frame may take to arrive), and the
    UCX listener for remote bulk transfers (``ucx_listen``: HOST:PORT, port 0 picks one; empty is
    off). ``inflight_bytes`` bounds the payload bytes all calls together hold at once (Put streams
    as they arrive, Get windows as they are read; :func:`load_config` defaults it to
    :func:`default_inflight_bytes` of ``dram.capacity``); ``prefetch_queue_keys`` bounds the keys
    of prefetches not yet finished, across all clients.

    Security (:mod:`kvstore.server.auth`): ``tls_cert``/``tls_key`` (PEM files) serve gRPC over
    TLS; ``tls_client_ca`` (PEM) then requires a client certificate signed by it;
    ``tokens_file`` names a file of ``NAME SHA256HEX`` lines (bearer tokens, stored hashed) that
    every call must match; ``allow_unauthenticated`` lets a server without either listen beyond
    loopback (``listen`` or any ``ucx_listen``). ``operators``: comma-separated identities (token
    names or certificate CNs) whose ``/metrics`` scrapes show every tenant's series; any other
    caller of a server with tenants sees its own tenant's only."""

    listen: str = "127.0.0.1:50051"
    max_block_bytes: int = 64 * 1024**2
    max_keys_per_request: int = 8192
    shutdown_grace_s: float = 5.0
    workers: int = 4
    shm_socket: str = "auto"
    shm_socket_mode: int = 0o660
    shm_max_connections: int = 256
    shm_max_connections_per_uid: int = 64
    shm_session_bytes: int = 0
    shm_frame_timeout_s: float = 10.0
    ucx_listen: str = ""
    #: Prometheus ``/metrics`` endpoint (HOST:PORT, port 0 picks one; empty is off).
    metrics_listen: str = "127.0.0.1:9464"
    ucx_transfer_timeout_s: float = 30.0
    put_stream_timeout_s: float = 60.0
    inflight_bytes: int = 256 * 1024**2
    prefetch_queue_keys: int = 65536
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    tokens_file: str = ""
    allow_unauthenticated: bool = False
    operators: str = ""

    @property
    def operator_identities(self) -> frozenset[str]:
        """The identities of ``operators``."""
        return frozenset(part.strip() for part in self.operators.split(",") if part.strip())

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("server.tls_cert and server.tls_key go together: set both or neither")
        if self.tls_client_ca and not self.tls_cert:
            raise ConfigError("server.tls_client_ca needs server.tls_cert and server.tls_key (TLS)")
        host, sep, port = self.listen.rpartition(":")
        if not sep or not host or not re.fullmatch(r"[0-9]{1,5}", port) or int(port) > 65535:
            raise ConfigError(
                f"server.listen must be HOST:PORT with a port from 0 to 65535 (0 picks a free "
                f"one), e.g. 127.0.0.1:50051, got {self.listen!r}"
            )
        host, sep, port = self.metrics_listen.rpartition(":")
        if self.metrics_listen and (
            not sep or not host or not re.fullmatch(r"[0-9]{1,5}", port) or int(port) > 65535
        ):
            raise ConfigError(
                "server.metrics_listen must be HOST:PORT with a port from 0 to 65535 (0 picks a "
                f"free one), e.g. 127.0.0.1:9464, or '' for no metrics, got {self.metrics_listen!r}"
            )
        require_positive("server.max_block_bytes", self.max_block_bytes)
        require_positive("server.max_keys_per_request", self.max_keys_per_request)
        require_positive("server.workers", self.workers)
        require_positive("server.inflight_bytes", self.inflight_bytes)
        require_positive("server.prefetch_queue_keys", self.prefetch_queue_keys)
        if not self.put_stream_timeout_s > 0:
            raise ConfigError(
                f"server.put_stream_timeout_s must be > 0, got {self.put_stream_timeout_s}"
            )
        if self.shutdown_grace_s < 0:
            raise ConfigError(f"server.shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")
        require_positive("server.shm_max_connections", self.shm_max_connections)
        require_positive("server.shm_max_connections_per_uid", self.shm_max_connections_per_uid)
        if self.shm_session_bytes < 0:
            raise ConfigError(
                "server.shm_session_bytes must be >= 0 (0 = a quarter of dram.capacity), "
                f"got {self.shm_session_bytes}"
            )
        if not self.shm_frame_timeout_s > 0:
            raise ConfigError(
                f"server.shm_frame_timeout_s must be > 0, got {self.shm_frame_timeout_s}"
            )
        if not 0 <= self.shm_socket_mode <= 0o777:
            # Shown in octal: a decimal 660 in TOML (not 0o660) lands here as 0o1224.
            raise ConfigError(
                "server.shm_socket_mode must be permission bits from 0o000 to 0o777 "
                f'(0o660 in TOML, "0660" elsewhere), got {oct(self.shm_socket_mode)}'
            )
