"""The settings of the two bulk data planes beside gRPC: the shared-memory socket for clients on
this host (``[shm]``, :mod:`kvstore.server.shm`) and the UCX listener for clients on others
(``[ucx]``, :mod:`kvstore.server.ucx`). Plain frozen dataclasses that check their own values;
:mod:`kvstore.config` loads them. Until this release they were ``server.shm_*`` and
``server.ucx_*``; those names are still read, with a warning."""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.config.checks import require_at_least, require_between, require_positive
from kvstore.config.meta import setting
from kvstore.errors import ConfigError

__all__ = ["MAX_UCX_LANES", "ShmConfig", "UcxConfig"]

#: Most UCX lanes (endpoints per peer) any setting allows.
MAX_UCX_LANES = 8


@dataclass(frozen=True)
class ShmConfig:
    """The shared-memory socket (``socket``: a path, ``auto`` for a private one in the runtime or
    temp directory, or empty to turn the shared-memory data plane off) with its permission bits
    (``socket_mode``, octal: a client must be able to write the socket to connect) and its
    bounds: connections in all and per peer uid, arena bytes one connection may hold leased or
    reserved (0: a quarter of ``dram.capacity``), seconds a frame may take to arrive."""

    socket: str = setting(
        "auto",
        help=(
            "UNIX socket of the shared-memory data plane; `auto` = `shm.sock` in a fresh directory"
            " with an unpredictable name (`mkdtemp`) in `$XDG_RUNTIME_DIR`, else `$TMPDIR`, "
            "removed on shutdown; the directory is 0700 plus search (not list) permission for "
            "group/others exactly where `shm.socket_mode` lets them write the socket (0710 for "
            "`0660`), so nobody can pre-bind the path; `''` turns it off. With `[tenants]`, each "
            "tenant whose `shm` is on gets a socket with a random name in a fresh unlistable "
            "directory of its own, next to this path (`PATH.NAME.XXXXXXXX/RANDOM.sock`) or where "
            "`auto` puts its own; clients learn it from `DataPlane`"
        ),
        flag="--shm-socket",
        old_names=("server.shm_socket",),
        metavar="PATH",
        short=(
            "UNIX socket of the shared-memory data plane; 'auto' makes a private one under "
            "$XDG_RUNTIME_DIR or the temp directory, '' turns it off"
        ),
    )
    socket_mode: int = setting(
        0o660,
        help=(
            "permission bits of that socket, octal (`0o660` in TOML); a client must be able to "
            "write it to connect, so other users need the server's group or `0666`"
        ),
        kind="mode",
        flag="--shm-socket-mode",
        old_names=("server.shm_socket_mode",),
        short="octal permission bits of that socket (0660: the server's user and group)",
    )
    max_connections: int = setting(
        256,
        help=(
            "shared-memory connections open at once; more are closed on arrival, with a "
            "(rate-limited) log line"
        ),
        old_names=("server.shm_max_connections",),
    )
    max_connections_per_uid: int = setting(
        64,
        help="the same, per connecting user (the peer uid the kernel reports)",
        old_names=("server.shm_max_connections_per_uid",),
    )
    session_bytes: int = setting(
        0,
        help=(
            "arena bytes one shared-memory connection may hold leased and reserved at once (`0` = "
            "a quarter of `dram.capacity`); a connection holding some already is answered "
            "RESOURCE_EXHAUSTED for more, one holding none gets the blocks past it inline (reads) "
            'or "no room" (writes, sent over gRPC instead)'
        ),
        kind="size",
        old_names=("server.shm_session_bytes",),
    )
    frame_timeout_s: float = setting(
        10.0,
        help=(
            "seconds a shared-memory request may take to arrive once its first byte has; a client "
            "that stalls mid-frame is hung up on (idle connections are not)"
        ),
        old_names=("server.shm_frame_timeout_s",),
    )

    def __post_init__(self) -> None:
        require_positive("shm.max_connections", self.max_connections)
        require_positive("shm.max_connections_per_uid", self.max_connections_per_uid)
        require_at_least(
            "shm.session_bytes", self.session_bytes, 0, "0 = a quarter of dram.capacity"
        )
        require_positive("shm.frame_timeout_s", self.frame_timeout_s)
        if not 0 <= self.socket_mode <= 0o777:
            # Shown in octal: a decimal 660 in TOML (not 0o660) lands here as 0o1224.
            raise ConfigError(
                "shm.socket_mode must be permission bits from 0o000 to 0o777 "
                f'(0o660 in TOML, "0660" elsewhere), got {oct(self.socket_mode)}'
            )


@dataclass(frozen=True)
class UcxConfig:
    """The UCX listener for remote bulk transfers (``listen``: HOST:PORT, port 0 picks one; empty
    is off), how long one transfer may take, the endpoints (lanes) this node opens per peer for
    its peer reads and one transfer may name, and the bytes in flight one endpoint and one tenant
    may have at once."""

    listen: str = setting(
        "",
        help=(
            "`HOST:PORT` of the UCX listener for remote clients (`:0` picks a port); `''` turns it"
            " off. The listener takes every interface whatever `HOST` says (ucxx binds a port "
            "only; the server warns): `HOST` is the address advertised to clients, so firewall the"
            " port where other hosts must not reach it"
        ),
        flag="--ucx-listen",
        old_names=("server.ucx_listen",),
        metavar="HOST:PORT",
        short="UCX listener for remote clients, port 0 picks one, '' turns it off",
    )
    transfer_timeout_s: float = setting(
        30.0,
        help="longest a UCX transfer may take before its endpoint is aborted",
        old_names=("server.ucx_transfer_timeout_s",),
    )

    lanes: int = setting(
        1,
        help=(
            "UCX endpoints (lanes) this node opens to each peer it reads blocks from "
            f"(`cluster.shared_data = peers`), 1 to {MAX_UCX_LANES}; a batch's messages spread "
            "over them. Over TCP on 2 cores a second lane measured no gain (one UCX worker "
            "progresses them all); worth trying where one endpoint cannot fill the link "
            "(clients: `KVSTORE_UCX_LANES`)"
        ),
    )
    max_lanes: int = setting(
        8,
        help=(
            f"most endpoints one UCX transfer may name (1 to {MAX_UCX_LANES}); a call naming more "
            "is refused (INVALID_ARGUMENT)"
        ),
    )
    connection_bytes_in_flight: int = setting(
        256 * 1024**2,
        help=(
            "payload bytes one UCX endpoint may have in flight; a transfer past it waits within "
            "its deadline (one alone always moves), then moves over gRPC"
        ),
        kind="size",
    )
    tenant_bytes_in_flight: int = setting(
        1024**3,
        help="the same, for all of one tenant's UCX transfers together",
        kind="size",
    )

    def __post_init__(self) -> None:
        require_positive("ucx.transfer_timeout_s", self.transfer_timeout_s)
        for name in ("lanes", "max_lanes"):
            require_between(f"ucx.{name}", getattr(self, name), 1, MAX_UCX_LANES)
        require_positive("ucx.connection_bytes_in_flight", self.connection_bytes_in_flight)
        require_positive("ucx.tenant_bytes_in_flight", self.tenant_bytes_in_flight)
