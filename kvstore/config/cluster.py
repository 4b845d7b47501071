"""The ``[cluster]`` settings: the cluster index and where other nodes' blocks are read from
(loaded by :func:`kvstore.config.load_config` like every other section; kept here so that the
loader stays small)."""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.config.checks import (
    check_choices,
    require_at_least,
    require_choice,
    require_positive,
)
from kvstore.config.meta import setting
from kvstore.deprecation import deprecated
from kvstore.errors import ConfigError
from kvstore.formats import WRITE_FORMATS

# The Namespace JSON codec lives with the key scheme; offered here too, where it used to be.
from kvstore.key_scheme import HASH_ALGORITHMS, namespace_from_json, namespace_to_json

__all__ = [
    "ENGINE_EVENT_SCHEMES",
    "PEER_TOKEN_DEPRECATED",
    "PEER_TRANSPORTS",
    "SHARED_DATA",
    "ClusterConfig",
    "check_advertise",
    "namespace_from_json",
    "namespace_to_json",
]

#: Where a node reads blocks it does not hold: the shared tier, the nodes holding them, or both.
SHARED_DATA = ("redis", "peers", "both")
#: How a node reads its peers' blocks: UCX where offered (else gRPC), only UCX, only gRPC.
PEER_TRANSPORTS = ("auto", "ucx", "grpc")
#: The warning a node logs at start where ``cluster.peer_token`` is set.
PEER_TOKEN_DEPRECATED = deprecated(
    "cluster.peer_token",
    "it is no longer sent to any node (nodes prove themselves to each other with keys derived "
    "from the integrity secrets); remove it",
)
#: Endpoints ``cluster.engine_events`` may name (those of vLLM's ZMQ publisher).
ENGINE_EVENT_SCHEMES = ("tcp://", "ipc://")


@dataclass(frozen=True)
class ClusterConfig:
    """The cluster index (:mod:`kvstore.cluster`): which node holds which blocks, in Redis.

    ``url`` empty means ``redis.url``; ``node_id`` empty means one generated once and kept in
    the nvme directory (random per start without one). ``shared_data`` (:data:`SHARED_DATA`):
    where other nodes' blocks are read from: ``redis`` (the shared tier), ``peers`` (straight
    from the node holding them, :mod:`kvstore.node.peers`; Redis then holds only the index),
    ``both`` (peers first, then Redis). ``peer_token``: deprecated and ignored (nodes
    authenticate each request with keys derived from the integrity secrets,
    :mod:`kvstore.node.peer_auth`; a node warns where it is set); ``peer_timeout_s`` bounds
    a peer read when its request set no deadline.
    ``peer_transport`` (:data:`PEER_TRANSPORTS`): ``auto`` reads over UCX from peers advertising
    a UCX listener and over gRPC otherwise (and after a UCX failure); ``ucx`` only over UCX;
    ``grpc`` only over gRPC.
    """

    enabled: bool = setting(
        False,
        help=(
            "register this node in the cluster index and publish which blocks it holds in which "
            "tier (see [Cluster index](#cluster-index))"
        ),
    )
    url: str = setting(
        "",
        help=(
            "Redis or Redis Cluster URL of the index (same schemes as `redis.url`); `''`: "
            "`redis.url`"
        ),
    )
    node_id: str = setting(
        "",
        help=(
            "this node's id in the index; `''`: generated once and kept in the nvme directory "
            "(`cluster-node-id`), random per start without one"
        ),
    )
    lease_ttl_s: float = setting(
        10.0,
        help=(
            "a node that stops renewing its lease (renewed every third of this) stops counting "
            "after this long"
        ),
    )
    publish_interval_s: float = setting(
        0.1,
        help="how often block changes are sent to the index (at once after 4096 changes)",
    )
    key_prefix: str = setting(
        "kvstore:cluster:v1:",
        help="prefix of every index key",
    )
    shared_data: str = setting(
        "redis",
        help=(
            "where other nodes' blocks are read from: `redis` (the shared tier), `peers` (from the"
            " node the index names, over `cluster.peer_transport`; Redis holds only the index, no "
            "payloads), `both` (peers first, then Redis); keys one holder fails to serve go to the"
            " next live holder while the deadline allows; a peer that fails or times out is a miss"
            " and is not asked again until its lease renews. Every block from a peer is verified "
            "against its keyed MAC before it is installed or served (every node needs the same "
            "integrity secrets, and this release or the one before: see "
            "[docs/upgrades.md](docs/upgrades.md)); one that fails is a `corrupt` miss counted in "
            "`peer_corrupt_blocks`, and its holder is not asked again until it restarts"
        ),
        kind="choice",
        choices=SHARED_DATA,
    )
    peer_token: str = setting(
        "",
        secret=True,
        help=(
            "deprecated and ignored (a warning at start): nodes no longer present a token to each "
            "other, they authenticate each request with keys derived from the integrity secrets "
            "(see [Cluster index](#cluster-index))"
        ),
    )
    peer_timeout_s: float = setting(
        2.0,
        help=(
            "bound of a peer read when the request has no deadline (else the time it has left, at "
            "most this)"
        ),
    )
    engine_events: str = setting(
        "",
        help=(
            "ZMQ endpoint (`tcp://`, `ipc://`) of the KV events of the vLLM engine beside this "
            "node; its prefix cache is then published as tier `local` (see [Engine-local "
            "blocks](#engine-local-blocks)); `''`: off. Needs the `events` extra (`pip install -e "
            "'.[events]'` in the clone; `kvstore` on PyPI is another package)"
        ),
    )
    engine_namespace: str = setting(
        "",
        help="deprecated alias of `keys.namespace` (one WARNING line at start)",
    )
    engine_chunk_size: int = setting(
        256,
        help="deprecated alias of `keys.chunk_size`",
    )
    engine_hash_algorithm: str = setting(
        "xxh3_128",
        help="deprecated alias of `keys.hash_algorithm`",
    )
    engine_max_blocks: int = setting(
        200000,
        help="engine blocks remembered at most; past that the oldest is forgotten with its chunks",
    )
    peer_transport: str = setting(
        "auto",
        help=(
            "how peers are read: `auto` (UCX from peers advertising a UCX listener, gRPC "
            "otherwise; a failed UCX read is read again over gRPC in the same deadline), `ucx` "
            "(UCX only: a failure is a miss), `grpc` (gRPC only); hits counted as `peer_hits_ucx` "
            "/ `peer_hits_grpc` in `stats()`"
        ),
        kind="choice",
        choices=PEER_TRANSPORTS,
    )
    advertise: str = setting(
        "",
        help=(
            "`HOST` or `HOST:PORT` other nodes and routers dial this node at, as published in the "
            "index; `''`: the listen address (a node listening on `0.0.0.0` or `::` must set it)"
        ),
    )

    write_formats: str = setting(
        "previous",
        help=(
            "`previous`: write node descriptions and index entries in the newest versions the "
            "previous release reads, so that nodes not yet upgraded read them (a rolling upgrade);"
            " `latest`: the newest versions, once every node runs this release (see "
            "[docs/upgrades.md](docs/upgrades.md)). Either way every version of this and the "
            "previous release is read"
        ),
        kind="choice",
        choices=WRITE_FORMATS,
    )

    def __post_init__(self) -> None:
        check_choices("cluster", self)
        require_at_least("cluster.lease_ttl_s", self.lease_ttl_s, 0.1)
        if not 0 < self.publish_interval_s <= self.lease_ttl_s:
            raise ConfigError(
                "cluster.publish_interval_s must be > 0 and <= cluster.lease_ttl_s, "
                f"got {self.publish_interval_s}"
            )
        require_positive("cluster.peer_timeout_s", self.peer_timeout_s)
        host, port = _split(self.advertise)
        if self.advertise and (not host.strip("[]") or (":" in host and host[0] != "[")):
            raise ConfigError(
                "cluster.advertise must be HOST or HOST:PORT (an IPv6 address in brackets, e.g. "
                f"[fd00::5]:50051), got {self.advertise!r}"
            )
        if port and not (port.isdigit() and 0 < int(port) < 65536):
            raise ConfigError(
                f"cluster.advertise must name a port from 1 to 65535, got {self.advertise!r}"
            )
        self._check_engine_events()

    def _check_engine_events(self) -> None:
        if not self.engine_events:
            return
        if not self.engine_events.startswith(ENGINE_EVENT_SCHEMES):
            raise ConfigError(
                f"cluster.engine_events must be empty or start with one of "
                f"{list(ENGINE_EVENT_SCHEMES)}, got {self.engine_events!r}"
            )
        if not self.enabled:
            raise ConfigError(
                f"cluster.engine_events = {self.engine_events!r} needs cluster.enabled = true"
            )
        if self.engine_namespace:  # deprecated: keys.namespace
            namespace_from_json(self.engine_namespace, "cluster.engine_namespace")
        require_at_least("cluster.engine_chunk_size", self.engine_chunk_size, 1)
        require_choice("cluster.engine_hash_algorithm", self.engine_hash_algorithm, HASH_ALGORITHMS)
        require_at_least("cluster.engine_max_blocks", self.engine_max_blocks, 1)

    def grpc_target(self, bound: str) -> str:
        """The gRPC target this node publishes when it listens on ``bound`` (``HOST:PORT``):
        ``advertise``'s host in place of ``bound``'s, and its port too where it names one."""
        if not self.advertise:
            return bound
        host, port = _split(self.advertise)
        return f"{host}:{port or bound.rpartition(':')[2]}"


def _split(address: str) -> tuple[str, str]:
    """``HOST`` or ``HOST:PORT`` (IPv6 in brackets) as (host, port or "")."""
    if address.startswith("["):
        host, _, rest = address.partition("]")
        return host + "]", rest.removeprefix(":")
    if address.count(":") == 1:
        host, _, port = address.partition(":")
        return host, port
    return address, ""


def check_advertise(listen: str, cluster: ClusterConfig) -> None:
    """Refuse (ConfigError, one line) to publish an address other nodes cannot dial: a node in
    the cluster index that listens on every interface must say where it is reached."""
    host = listen.rpartition(":")[0].strip("[]")
    if cluster.enabled and not cluster.advertise and host in ("0.0.0.0", "::", ""):
        raise ConfigError(
            f"server.listen = {listen} listens on every interface, which other nodes cannot "
            "dial: set cluster.advertise (KVSTORE_CLUSTER_ADVERTISE) to the host they reach this "
            "node at, e.g. 10.0.0.5"
        )
