"""The ``[cluster]`` settings: the cluster index and where other nodes' blocks are read from
(loaded by :func:`kvstore.config.load_config` like every other section; kept here so that the
loader stays small)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from kvstore.errors import ConfigError
from kvstore.keys import Namespace

__all__ = ["ENGINE_EVENT_SCHEMES", "SHARED_DATA", "ClusterConfig", "namespace_from_json"]

#: Where a node reads blocks it does not hold: the shared tier, the nodes holding them, or both.
SHARED_DATA = ("redis", "peers", "both")
#: Endpoints ``cluster.engine_events`` may name (those of vLLM's ZMQ publisher).
ENGINE_EVENT_SCHEMES = ("tcp://", "ipc://")
#: Namespace fields filled per request (never part of an engine-wide base namespace).
_PER_REQUEST = frozenset({"lora_id", "cache_salt", "tp_rank"})
_HASH_ALGORITHMS = ("xxh3_128", "sha256")


def namespace_from_json(text: str, setting: str) -> Namespace:
    """An engine's rank-0 base namespace from ``setting``'s value: a JSON object of
    :class:`~kvstore.keys.Namespace` fields (what the connector logs at start), without the
    per-request ones. Used by ``router.namespace`` and ``cluster.engine_namespace`` alike."""
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{setting}: cannot use {text!r}: not JSON ({exc})") from exc
    if not isinstance(fields, dict):
        raise ConfigError(f"{setting}: cannot use {text!r}: not a JSON object")
    known = {f.name for f in dataclasses.fields(Namespace)} - _PER_REQUEST
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ConfigError(f"{setting}: unknown fields {unknown}; known: {sorted(known)}")
    try:
        return Namespace(**fields, tp_rank=0)
    except (ConfigError, TypeError) as exc:
        raise ConfigError(f"{setting}: cannot use {text!r}: {exc}") from exc


@dataclass(frozen=True)
class ClusterConfig:
    """The cluster index (:mod:`kvstore.cluster`): which node holds which blocks, in Redis.

    ``url`` empty means ``redis.url``; ``node_id`` empty means one generated once and kept in
    the nvme directory (random per start without one). ``shared_data`` (:data:`SHARED_DATA`):
    where other nodes' blocks are read from: ``redis`` (the shared tier), ``peers`` (straight
    from the node holding them, :mod:`kvstore.cluster.peers`; Redis then holds only the index),
    ``both`` (peers first, then Redis). ``peer_token``: the bearer token a node presents to its
    peers (empty: none); ``peer_timeout_s`` bounds a peer read when its request set no deadline.
    """

    enabled: bool = False
    url: str = ""
    node_id: str = ""
    lease_ttl_s: float = 10.0
    publish_interval_s: float = 0.1
    key_prefix: str = "kvstore:cluster:v1:"
    shared_data: str = "redis"
    peer_token: str = field(default="", repr=False)
    peer_timeout_s: float = 2.0
    engine_events: str = ""
    engine_namespace: str = ""
    engine_chunk_size: int = 256
    engine_hash_algorithm: str = "xxh3_128"
    engine_max_blocks: int = 200_000

    def __post_init__(self) -> None:
        if self.lease_ttl_s < 0.1:
            raise ConfigError(f"cluster.lease_ttl_s must be >= 0.1, got {self.lease_ttl_s}")
        if not 0 < self.publish_interval_s <= self.lease_ttl_s:
            raise ConfigError(
                "cluster.publish_interval_s must be > 0 and <= cluster.lease_ttl_s, "
                f"got {self.publish_interval_s}"
            )
        if self.shared_data not in SHARED_DATA:
            raise ConfigError(
                f"cluster.shared_data must be one of {list(SHARED_DATA)}, got {self.shared_data!r}"
            )
        if self.peer_timeout_s <= 0:
            raise ConfigError(f"cluster.peer_timeout_s must be > 0, got {self.peer_timeout_s}")
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
        if not self.engine_namespace:
            raise ConfigError(
                "cluster.engine_events needs cluster.engine_namespace (the connector's base "
                'namespace as JSON, e.g. \'{"model": "org/model", ...}\'), got ""'
            )
        namespace_from_json(self.engine_namespace, "cluster.engine_namespace")
        if self.engine_chunk_size < 1:
            raise ConfigError(
                f"cluster.engine_chunk_size must be >= 1, got {self.engine_chunk_size}"
            )
        if self.engine_hash_algorithm not in _HASH_ALGORITHMS:
            raise ConfigError(
                f"cluster.engine_hash_algorithm must be one of {list(_HASH_ALGORITHMS)}, "
                f"got {self.engine_hash_algorithm!r}"
            )
        if self.engine_max_blocks < 1:
            raise ConfigError(
                f"cluster.engine_max_blocks must be >= 1, got {self.engine_max_blocks}"
            )
