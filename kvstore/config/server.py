"""The settings of the ``kvstore serve`` process itself (``[server]``): its gRPC endpoint, its
metrics endpoint, request limits, threads and timeouts. The shared-memory and UCX data planes
(``[shm]``, ``[ucx]``, :mod:`kvstore.config.data_plane`) and security (``[auth]``,
:mod:`kvstore.config.auth`) have sections of their own. A plain frozen dataclass that checks its
own values; :mod:`kvstore.config` loads it."""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvstore.config.checks import require_at_least, require_positive
from kvstore.config.meta import setting
from kvstore.errors import ConfigError

__all__ = ["ServerConfig"]


@dataclass(frozen=True)
class ServerConfig:
    """The gRPC endpoint (``listen``), the Prometheus endpoint (``metrics_listen``), request
    limits, ``workers`` threads for blocking disk I/O and the shutdown grace.
    ``inflight_bytes`` bounds the payload bytes all calls together hold at once (Put streams as
    they arrive, Get windows as they are read; :func:`load_config` defaults it to
    :func:`default_inflight_bytes` of ``dram.capacity``); ``prefetch_queue_keys`` bounds the keys
    of prefetches not yet finished, across all clients."""

    listen: str = setting(
        "127.0.0.1:50051",
        help="gRPC address (`:0` picks a free port)",
        flag="--listen",
        metavar="HOST:PORT",
    )
    max_block_bytes: int = setting(
        64 * 1024**2,
        help="largest accepted block",
        kind="size",
        flag="--max-block-bytes",
    )
    max_keys_per_request: int = setting(
        8192,
        help="keys per Lookup/Put/Get/Delete",
    )
    shutdown_grace_s: float = setting(
        5.0,
        help="seconds in-flight calls get on SIGTERM",
    )
    workers: int = setting(
        4,
        help="threads doing blocking disk I/O (LMDB)",
    )
    metrics_listen: str = setting(
        "127.0.0.1:9464",
        help=(
            "`HOST:PORT` of the Prometheus endpoint `/metrics` (`:0` picks a port, printed as "
            "`kvstore metrics on URL`); `''` turns it off. Left unset, the default gives way to a "
            "free port (with a warning line) when another process holds 9464; a value that was set"
            " is used as given. Same rules as the gRPC port: with `auth.tokens_file` a scrape "
            "needs `Authorization: Bearer <token>`, with TLS it is HTTPS with the same "
            "certificate, and beyond loopback it needs authentication or "
            "`auth.allow_unauthenticated`. With `[tenants]` a tenant's credentials scrape that "
            "tenant's series only (and `kvstore_build_info`); `auth.operators` scrape all. Names: "
            '`kvstore_tier_*` (`kvstore_tier_corrupt_blocks_total{tier="peer"}`: blocks other '
            "nodes sent that failed verification), `kvstore_peer_untrusted_total{reason}` (nodes "
            "not asked: `unverified_node`, `unproven`), `kvstore_misses_total{reason}`, "
            "`kvstore_shared_*`, `kvstore_prefetch_*`, `kvstore_shm_*`, "
            "`kvstore_request_duration_seconds{op,plane}`, `kvstore_lookups_total{plane}` (lookup "
            "calls by data plane), all with a `tenant` label; and `kvstore_build_info{version}`"
        ),
        flag="--metrics-listen",
        metavar="HOST:PORT",
        short=(
            "Prometheus /metrics endpoint, port 0 picks one, '' turns it off; the default one "
            "gives way to a free port when another server holds it"
        ),
    )
    put_stream_timeout_s: float = setting(
        60.0,
        help=(
            "longest one gRPC `Put` stream may take from its first message to its last; past it "
            "the call ends with `DEADLINE_EXCEEDED`, nothing of it is stored and its charge to "
            "`server.inflight_bytes` is given back (a client stalling mid-stream cannot hold the "
            "budget)"
        ),
    )
    inflight_bytes: int = setting(
        256 * 1024**2,
        help=(
            "payload bytes all gRPC calls together hold at once: Put streams are charged block by "
            "block as they arrive (past it: `RESOURCE_EXHAUSTED`, nothing stored; one Put stream "
            "may not exceed it; the client sends a put of more than 32 MiB as several streams), "
            "Get reads are charged a 16 MiB window at a time (a Get waits for room)"
        ),
        kind="size",
        default_doc="¼ of `dram.capacity`, ≥ `64MiB`",
    )
    prefetch_queue_keys: int = setting(
        65536,
        help=(
            "keys of prefetches not yet finished, across all clients of a tenant (each tenant has "
            "its own queue); past it `Prefetch` answers `RESOURCE_EXHAUSTED`. Finished prefetches "
            "keep counts only, the last 1024 of them (older ids: `NOT_FOUND`)"
        ),
    )

    def __post_init__(self) -> None:
        _require_host_port("server.listen", self.listen, "127.0.0.1:50051")
        if self.metrics_listen:
            _require_host_port(
                "server.metrics_listen", self.metrics_listen, "127.0.0.1:9464, or '' for no metrics"
            )
        require_positive("server.max_block_bytes", self.max_block_bytes)
        require_positive("server.max_keys_per_request", self.max_keys_per_request)
        require_positive("server.workers", self.workers)
        require_positive("server.inflight_bytes", self.inflight_bytes)
        require_positive("server.prefetch_queue_keys", self.prefetch_queue_keys)
        require_positive("server.put_stream_timeout_s", self.put_stream_timeout_s)
        require_at_least("server.shutdown_grace_s", self.shutdown_grace_s, 0)


def _require_host_port(name: str, value: str, example: str) -> None:
    """Refuse a listen address ``name`` that is not ``HOST:PORT`` with a port from 0 to 65535."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not re.fullmatch(r"[0-9]{1,5}", port) or int(port) > 65535:
        raise ConfigError(
            f"{name} must be HOST:PORT with a port from 0 to 65535 (0 picks a free one), "
            f"e.g. {example}, got {value!r}"
        )
