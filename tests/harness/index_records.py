"""Writing node descriptions into the cluster index the way a rogue with write access to its
Redis would (or, with the cluster's secret, the way a node does), for the node-authentication
tests."""

from __future__ import annotations

import time
from typing import Any

from kvstore.block import Keyring
from kvstore.cluster.layout import Layout
from kvstore.cluster.records import NodeInfo, record_keyring

#: The integrity secret of test_peer_fetch's nodes (``peer_env``).
CLUSTER_SECRET = "peer-fetch-test-secret"


def signed_fields(info: NodeInfo, secret: str | None, valid_s: float = 120.0) -> dict[str, str]:
    """``info``'s hash fields: unsigned (``secret`` ``None``), or signed under ``secret``."""
    if secret is None:
        return info.fields()
    ring = record_keyring(Keyring([secret.encode()]))
    return info.signed(ring, int((time.time() + valid_s) * 1000))


def described(redis: Any, prefix: str, node: str) -> NodeInfo:
    """``node``'s description as it is in the index (unverified)."""
    return NodeInfo.parse(node, redis.hgetall(Layout(prefix).node(node)))


def rewrite(redis: Any, prefix: str, info: NodeInfo, secret: str | None) -> None:
    """Replace ``info.node_id``'s description with ``info`` (signed under ``secret``)."""
    key = Layout(prefix).node(info.node_id)
    pipe = redis.pipeline()
    pipe.delete(key)
    pipe.hset(key, mapping=signed_fields(info, secret))
    pipe.execute()


def plant(
    redis: Any,
    prefix: str,
    info: NodeInfo,
    keys: list[bytes],
    secret: str | None,
    tier: str = "dram",
    ttl_s: float = 60.0,
) -> None:
    """Register ``info`` as a live node (description, membership, lease) claiming ``keys``."""
    layout = Layout(prefix)
    rewrite(redis, prefix, info, secret)
    pipe = redis.pipeline()
    pipe.sadd(layout.nodes, info.node_id)
    pipe.set(layout.lease(info.node_id), info.epoch, px=int(ttl_s * 1000))
    for key in keys:
        pipe.hset(layout.entry(key), info.node_id, f"{info.epoch}:{tier}")
    pipe.execute()
