"""What a real ``kvstore serve`` node declares about its key schemes, read as a router reads it.

A node publishes the key schemes it serves (its ``[keys]`` settings, and the namespaces its
engines' connectors declared through the ``KeyScheme`` call) in its signed description in the
cluster index (:mod:`kvstore.cluster.records`). Tests that need to see what a node holds
declared start it with :func:`cluster_settings` (a real redis-server of their own) beside their
``keys.*`` settings, and read the index with :func:`published_schemes` or wait for a change with
:func:`wait_published`, not in-process objects.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from kvstore.cluster import ClusterIndex, Layout, connect
from kvstore.key_scheme import KeyScheme

__all__ = ["KEY_PREFIX", "cluster_settings", "published_schemes", "wait_published"]

#: The index prefix of the tests' nodes (the default's: a router needs no setting for it).
KEY_PREFIX = "kvstore:cluster:v1:"


def cluster_settings(redis_url: str, node_id: str) -> dict[str, Any]:
    """``ServerProcess`` settings that publish the node as ``node_id`` in the index at
    ``redis_url`` (quickly: a test waits for it)."""
    return {
        "cluster.enabled": True,
        "cluster.url": redis_url,
        "cluster.node_id": node_id,
        "cluster.key_prefix": KEY_PREFIX,
        "cluster.publish_interval_s": 0.05,
    }


def published_schemes(redis_url: str, node_id: str) -> list[KeyScheme] | None:
    """The key schemes ``node_id`` publishes now (``None``: no live description of it)."""

    async def read() -> list[KeyScheme] | None:
        client = connect(redis_url, 5.0)
        try:
            info = (await ClusterIndex(client, Layout(KEY_PREFIX)).nodes()).get(node_id)
        finally:
            await client.aclose()
        if info is None:
            return None
        return [KeyScheme.from_json(text, f"node {node_id}") for text in info.keys or ()]

    return asyncio.run(read())


def wait_published(
    redis_url: str,
    node_id: str,
    done: Callable[[list[KeyScheme]], bool],
    timeout: float = 30.0,
) -> list[KeyScheme]:
    """Poll until what ``node_id`` publishes satisfies ``done``; fails with the last seen."""
    deadline = time.monotonic() + timeout
    while True:
        seen = published_schemes(redis_url, node_id)
        if seen is not None and done(seen):
            return seen
        if time.monotonic() > deadline:
            raise AssertionError(f"node {node_id} publishes {seen} after {timeout:.0f} s")
        time.sleep(0.05)
