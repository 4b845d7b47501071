"""Checks ``kvstore serve`` runs before it opens anything: the arena fits the machine, the port is
free. Each failure is a :class:`ConfigError` of one line naming the setting, the value and what
is allowed, so a misconfigured start leaves nothing opened or written.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import socket
from pathlib import Path

from kvstore.config import Config, ServerConfig, format_size
from kvstore.errors import ConfigError

__all__ = ["arena_limit", "check_arena", "check_listen", "free_metrics_port", "preflight"]

logger = logging.getLogger(__name__)

_DRAM_SOURCES = "--dram-capacity, KVSTORE_DRAM_CAPACITY or dram.capacity in the config file"


def _meminfo(text: str) -> dict[str, int]:
    values = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            values[name] = int(parts[0]) * 1024
    return values


def arena_limit(meminfo: str | None = None, overcommit: str | None = None) -> tuple[int, str]:
    """The largest arena this machine can back and why: its physical memory (an arena in swap
    is no cache), less in strict overcommit mode (``vm.overcommit_memory=2``) what the kernel
    will still commit. ``(0, "")`` when ``/proc`` cannot tell."""
    try:
        meminfo = Path("/proc/meminfo").read_text() if meminfo is None else meminfo
    except OSError:
        return 0, ""
    info = _meminfo(meminfo)
    if "MemTotal" not in info:
        return 0, ""
    limit, why = info["MemTotal"], "MemTotal, the memory of this machine"
    if overcommit is None:
        try:
            overcommit = Path("/proc/sys/vm/overcommit_memory").read_text()
        except OSError:
            overcommit = "0"
    if overcommit.strip() == "2" and "CommitLimit" in info:
        left = max(info["CommitLimit"] - info.get("Committed_AS", 0), 0)
        if left < limit:
            limit, why = left, "what vm.overcommit_memory=2 still lets the kernel commit"
    return limit, why


def check_arena(capacity: int, meminfo: str | None = None, overcommit: str | None = None) -> None:
    """Refuse a dram arena larger than :func:`arena_limit`; warn when it exceeds the memory
    available now (it is filled lazily, so the machine may start swapping later)."""
    if not capacity:
        return
    limit, why = arena_limit(meminfo, overcommit)
    if limit and capacity > limit:
        raise ConfigError(
            f"dram.capacity={format_size(capacity)} cannot be backed by this machine: at most "
            f"{format_size(limit)} ({why}); set a smaller one with {_DRAM_SOURCES}"
        )
    try:
        text = Path("/proc/meminfo").read_text() if meminfo is None else meminfo
    except OSError:
        return
    available = _meminfo(text).get("MemAvailable", 0)
    if available and capacity > available:
        logger.warning(
            "dram.capacity=%s is more than the memory available now (%s): the machine may swap "
            "as the arena fills",
            format_size(capacity),
            format_size(available),
        )


def check_listen(listen: str, setting: str = "server.listen", flag: str = "--listen") -> None:
    """Bind ``server.listen``'s address (or ``setting``'s) once and let go: a port in use (or one
    this user may not bind) is refused here, before any tier opens, instead of by gRPC after."""
    host, _, port_text = listen.rpartition(":")
    port = int(port_text)
    if port == 0:
        return
    host = host.strip("[]")
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(
            f"{setting}={listen!r}: cannot resolve host {host!r} ({exc.strerror}); "
            "use HOST:PORT with an address or name of this machine"
        ) from None
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            # As gRPC binds: a port left in TIME_WAIT by a stopped server is free to use.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise ConfigError(
                        f"{setting}={listen!r}: port {port} is already in use (another "
                        f"kvstore serve?); choose a free port with {flag} HOST:PORT"
                    ) from None
                if exc.errno == errno.EACCES:
                    raise ConfigError(
                        f"{setting}={listen!r}: no permission to bind port {port} (ports "
                        "below 1024 need privileges); use a port from 1024 to 65535"
                    ) from None
                # An address family this machine lacks (::1 without IPv6): gRPC skips it too.
                logger.debug("cannot bind %s for %s: %s", address, listen, exc)


def free_metrics_port(config: Config, default: str = ServerConfig.metrics_listen) -> Config:
    """``config`` with ``/metrics`` on a free port where it would take the ``default`` one and
    another process (a second ``kvstore serve`` on this host) holds it; said in one line.

    Only for a default nobody asked for: a metrics address that was set is checked as given.
    """
    listen = config.server.metrics_listen
    if listen != default:
        return config
    try:
        check_listen(listen, "server.metrics_listen", "--metrics-listen")
    except ConfigError:
        host = listen.rpartition(":")[0]
        logger.warning(
            "metrics port %s is in use (another kvstore serve on this host?): serving /metrics "
            "on a free port instead, shown by the 'kvstore metrics on' line; pin one with "
            "--metrics-listen HOST:PORT",
            listen.rpartition(":")[2],
        )
        server = dataclasses.replace(config.server, metrics_listen=f"{host}:0")
        return dataclasses.replace(config, server=server)
    return config


def preflight(config: Config) -> None:
    """Every check above, in the order a user would fix them."""
    check_arena(config.dram.capacity)
    check_listen(config.server.listen)
    if config.server.metrics_listen:
        check_listen(config.server.metrics_listen, "server.metrics_listen", "--metrics-listen")
