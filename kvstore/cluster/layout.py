"""Where the cluster index lives in Redis, and the client that reaches it.

Keys (``P`` is ``cluster.key_prefix``; ``T`` is ``t:TENANT:`` for a tenant's blocks, empty for a
server without tenants):

* ``P epoch:NODE``: the node's boot counter (``INCR`` at each start);
* ``P lease:NODE``: the node's current epoch, with a ``PX`` TTL the node renews;
* ``P node:NODE``: a hash of the node's addresses and capacity (:class:`~.membership.NodeInfo`);
* ``P nodes``: the set of node ids that ever registered (for listing members);
* ``P T k:KEY``: one hash per chunk key (the raw key bytes), field ``NODE`` → ``EPOCH:TIER``
  (``TIER``: a kvstore tier's name, or :data:`LOCAL` for the engine's own prefix cache). That is
  index entry version 1 (:data:`kvstore.formats.INDEX`); a later version may append
  ``;``-separated fields, which readers of version 1 skip (:meth:`.ClusterIndex.holders`).

One hash per chunk key makes a router's question ("which nodes hold these keys") one pipeline
of ``HGETALL``, whatever the number of nodes; with Redis Cluster the keys spread over slots and
the (non-transactional) cluster pipeline sends each slot's commands to its shard.
"""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisClusterException, RedisError

__all__ = ["LOCAL", "REDIS_ERRORS", "Client", "Layout", "connect"]

Client = Redis | RedisCluster

#: The tier name of chunks an engine holds in its own prefix cache (its node publishes them,
#: :mod:`.engine_chunks`; a router weighs them above every kvstore tier).
LOCAL = "local"

#: What an unreachable, stalled or reshaping Redis raises.
REDIS_ERRORS: tuple[type[BaseException], ...] = (
    RedisError,
    RedisClusterException,
    OSError,
    TimeoutError,
)

_SINGLE_SCHEMES = ("redis://", "rediss://", "unix://")
_CLUSTER_SCHEMES = {"redis+cluster://": "redis://", "rediss+cluster://": "rediss://"}


def connect(url: str, timeout_s: float) -> Client:
    """A lazily connecting client for ``url`` (``redis://``, ``rediss://``, ``unix://``, or
    ``redis+cluster://`` / ``rediss+cluster://`` for Redis Cluster)."""
    options: dict[str, Any] = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        # No client-side retries: redis-py's cluster client retries a failed pipeline three
        # times, closing the client and sleeping 0.25 s in between, which turned a 0.5 s
        # timeout into 3.6-4.5 s around a failover. Callers retry on their own schedule.
        "retry": Retry(NoBackoff(), 0),
    }
    for scheme, plain in _CLUSTER_SCHEMES.items():
        if url.startswith(scheme):
            return RedisCluster.from_url(plain + url[len(scheme) :], **options)
    if url.startswith(_SINGLE_SCHEMES):
        return Redis.from_url(url, **options)
    allowed = ", ".join([*_SINGLE_SCHEMES, *_CLUSTER_SCHEMES])
    raise ValueError(f"cluster.url {url!r} is not a Redis URL; use one of {allowed}")


class Layout:
    """The key names of one index (``prefix``) as one tenant (``tenant``) sees it."""

    def __init__(self, prefix: str, tenant: str = "") -> None:
        self.prefix = prefix
        self.tenant = tenant
        self._entries = (prefix + (f"t:{tenant}:" if tenant else "") + "k:").encode()

    def epoch(self, node: str) -> str:
        """The node's boot counter."""
        return f"{self.prefix}epoch:{node}"

    def lease(self, node: str) -> str:
        """The node's lease (its current epoch, expiring)."""
        return f"{self.prefix}lease:{node}"

    def node(self, node: str) -> str:
        """The hash describing the node."""
        return f"{self.prefix}node:{node}"

    @property
    def nodes(self) -> str:
        """The set of registered node ids."""
        return f"{self.prefix}nodes"

    def entry(self, key: bytes) -> bytes:
        """The hash of the nodes holding ``key``."""
        return self._entries + key

    def for_tenant(self, tenant: str) -> Layout:
        """The same index as ``tenant`` sees it."""
        return Layout(self.prefix, tenant)
