"""``kvstore router`` assembled from its configuration, and run: the replicas of
``router.replicas`` (or, in P/D mode, of ``router.prefill`` and ``router.decode``), the index
client, the deprecated key settings, and the HTTP server that hands each connection to
:meth:`kvstore.router.service.Router.handle` until the process is told to stop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from redis.asyncio.cluster import RedisCluster

from kvstore.cluster.index import ClusterIndex
from kvstore.cluster.layout import Client, Layout, connect
from kvstore.config import Config, RouterConfig, hash_secret
from kvstore.errors import ConfigError
from kvstore.router.keys import RouterKeys, parse_namespace
from kvstore.router.lookup import ScriptIndex
from kvstore.router.pd import PrefillStage
from kvstore.router.scoring import Replica
from kvstore.router.service import Index, Router
from kvstore.router.tokenize import load_tokenizer

__all__ = ["build_router", "parse_replicas", "pd_replicas", "run_router"]


def parse_replicas(text: str, setting: str = "router.replicas") -> list[Replica]:
    """``router.replicas`` (or ``setting``): comma-separated ``URL=NODE_ID`` pairs."""
    replicas = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        url, sep, node = item.rpartition("=")
        if not sep or not url.startswith(("http://",)) or not node:
            raise ConfigError(
                f"{setting}: cannot use {item!r}: give URL=NODE_ID, e.g. "
                "http://10.0.0.5:8000=node-a"
            )
        replicas.append(Replica(url.rstrip("/"), node))
    if not replicas:
        raise ConfigError(f"{setting} is empty; give at least one URL=NODE_ID")
    if len({r.url for r in replicas}) != len(replicas):
        raise ConfigError(f"{setting} names a URL twice: {text!r}")
    return replicas


def build_router(config: Config) -> tuple[Router, Client | None]:
    """The router of ``config`` and its index client (``None`` without an index URL)."""
    settings = config.router
    prefill: list[Replica] = []
    if settings.prefill or settings.decode:
        prefill, replicas = pd_replicas(settings.replicas, settings.prefill, settings.decode)
    else:
        replicas = parse_replicas(settings.replicas)
    url = config.cluster.url or config.redis.url
    if not settings.namespace and not prefill and not url:
        raise ConfigError(
            "the router names chunks by the key scheme its nodes publish in the cluster index, "
            "and has none: set cluster.url (or redis.url) to the index the nodes publish to"
        )
    keys = _configured_keys(settings)
    # The socket timeout is the cap: the adaptive deadline (index_query) cuts queries off first.
    cap_s = max(settings.index_timeout_max_s, settings.index_timeout_s)
    client = connect(url, cap_s) if url else None
    layout = Layout(config.cluster.key_prefix, settings.tenant)
    router = Router(
        replicas,
        keys,
        _index(client, layout, settings.index_timeout_s),
        tokenizer=load_tokenizer(settings.tokenizer),
        provisional_ttl_s=settings.provisional_ttl_s,
        hit_weight=settings.hit_weight,
        request_cost_tokens=settings.request_cost_tokens,
        index_retry_s=settings.index_retry_s,
        index_timeout_s=settings.index_timeout_s,
        index_timeout_max_s=settings.index_timeout_max_s,
        policy=settings.policy,
        max_body_bytes=settings.max_body_bytes,
        # The nodes' descriptions (all tenants share them), read unsigned: a router holds no
        # integrity secrets.
        fleet_index=(
            ClusterIndex(client, Layout(config.cluster.key_prefix), timeout_s=cap_s)
            if client is not None
            else None
        ),
    )
    if prefill:
        router.prefill = PrefillStage(
            prefill,
            router.metrics.registry,
            timeout_s=settings.prefill_timeout_s,
            request_cost_tokens=settings.request_cost_tokens,
        )
    return router, client


def _configured_keys(settings: RouterConfig) -> RouterKeys | None:
    """How the router names chunks by its own settings (``router.namespace``, deprecated: only
    while no node publishes a scheme); ``None`` where it reads the nodes' schemes."""
    if settings.hash_algorithm not in ("xxh3_128", "sha256"):
        raise ConfigError(
            f"router.hash_algorithm: cannot use {settings.hash_algorithm!r}: "
            "one of xxh3_128, sha256"
        )
    if not settings.namespace:
        return None
    return RouterKeys(
        parse_namespace(settings.namespace),
        settings.chunk_size,
        hash_secret(),
        "sha256" if settings.hash_algorithm == "sha256" else "xxh3_128",
    )


def _index(client: Client | None, layout: Layout, timeout_s: float) -> Index | None:
    """Who holds which chunks, from the tenant's cluster index (``None`` without one): one
    script call per question on a single Redis (:class:`ScriptIndex`), a pipeline on a Redis
    Cluster, whose keys of one request lie in many slots."""
    if isinstance(client, RedisCluster):
        return ClusterIndex(client, layout, timeout_s=timeout_s)
    if client is not None:
        return ScriptIndex(client, layout)
    return None


def pd_replicas(replicas: str, prefill: str, decode: str) -> tuple[list[Replica], list[Replica]]:
    """P/D mode's prefill and decode replicas (``router.prefill``, ``router.decode``)."""
    if replicas:
        raise ConfigError(
            "router.replicas: cannot use it with router.prefill/router.decode: in P/D mode every "
            "replica is a prefill or a decode one"
        )
    if not prefill or not decode:
        missing = "router.decode" if prefill else "router.prefill"
        raise ConfigError(f"{missing} is empty; P/D mode needs prefill and decode replicas")
    pre, dec = parse_replicas(prefill, "router.prefill"), parse_replicas(decode, "router.decode")
    both = sorted({r.url for r in pre} & {r.url for r in dec})
    if both:
        raise ConfigError(f"router.prefill and router.decode both name {both}; give each once")
    return pre, dec


async def run_router(config: Config, on_ready: Callable[[str], None]) -> None:
    """Serve until cancelled (SIGINT/SIGTERM end the process's loop)."""
    router, client = build_router(config)
    if router.fleet is not None:  # name chunks as the nodes do from the first request on
        await router.fleet.refresh()
    host, _, port = config.router.listen.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"router.listen: cannot use {config.router.listen!r}: give HOST:PORT")
    server = await asyncio.start_server(router.handle, host, int(port), limit=1 << 20)
    bound = server.sockets[0].getsockname()
    on_ready(f"http://{bound[0]}:{bound[1]}")
    try:
        async with server:
            await server.serve_forever()
    finally:
        await router.drain()
        if router.fleet is not None:
            await router.fleet.aclose()
        router.close()
        if client is not None:
            await client.aclose()
