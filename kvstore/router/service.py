"""The router: per request, tokenize, name the chunks, ask the index, score, proxy.

:meth:`Router.decide` is the decision (chunk keys, one index query, scoring), what the
benchmark times; :meth:`Router.handle` serves one HTTP connection. The index is optional and
never fails a request: without ``cluster.url``/``redis.url``, after a failed or slow query (for
``router.index_retry_s`` after it) or without token ids, requests are routed by load and the
provisional entries alone, and ``kvstore_router_fallbacks_total`` counts why.

In P/D mode (``router.prefill`` and ``router.decode``) a :class:`~kvstore.router.pd.PrefillStage`
runs each completion on a prefill replica first; the decision then picks among decode replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.asyncio.cluster import RedisCluster

from kvstore.cluster import ClusterIndex, Holding, Layout, connect
from kvstore.cluster.layout import REDIS_ERRORS, Client
from kvstore.config import Config, hash_secret
from kvstore.errors import ConfigError
from kvstore.router.keys import RouterKeys, parse_namespace
from kvstore.router.lookup import ScriptIndex
from kvstore.router.metrics import RouterMetrics
from kvstore.router.pd import PrefillStage
from kvstore.router.proxy import BadRequest, Request, UpstreamError, forward, read_request, respond
from kvstore.router.scoring import Decision, Provisional, Replica, Scorer
from kvstore.router.tokenize import Tokenizer, load_tokenizer, prompt_tokens

__all__ = ["Router", "build_router", "parse_replicas", "pd_replicas", "run_router"]

logger = logging.getLogger(__name__)

_ROUTED = ("/v1/completions", "/v1/chat/completions")

#: What the router asks the index (ClusterIndex, or ScriptIndex on a single Redis).
Index = ClusterIndex | ScriptIndex


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


class Router:
    """Decides and proxies; holds the scorer's load, the index reader and the metrics."""

    def __init__(
        self,
        replicas: Sequence[Replica],
        keys: RouterKeys | None,
        index: Index | None,
        *,
        prefill: PrefillStage | None = None,
        tokenizer: Tokenizer | None = None,
        provisional_ttl_s: float = 5.0,
        hit_weight: float = 2.0,
        request_cost_tokens: int = 256,
        index_retry_s: float = 1.0,
        policy: str = "kv",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.keys = keys  # None (P/D mode without router.namespace): routed by load
        self.index = index
        self.prefill = prefill
        self.tokenizer = tokenizer
        self.metrics = RouterMetrics()
        self.scorer = Scorer(
            replicas,
            keys.chunk_size if keys is not None else 1,
            hit_weight,
            request_cost_tokens,
            Provisional(provisional_ttl_s, clock),
            policy,
        )
        self.index_retry_s = index_retry_s
        self._clock = clock
        self._index_down_until = 0.0

    async def _holdings(self, keys: Sequence[bytes]) -> tuple[Mapping[str, Holding], str]:
        """The index's answer, or nothing and the fallback reason."""
        if self.index is None:
            return {}, "no_index"
        if self._clock() < self._index_down_until:
            return {}, "index_down"
        try:
            # The client's socket timeout is router.index_timeout_s: no wait_for task per request.
            return await self.index.holders(keys), ""
        except REDIS_ERRORS as exc:  # TimeoutError (a slow query) is one of them
            self.metrics.index_errors.inc()
            if self._index_down_until == 0.0 or self._clock() >= self._index_down_until + 1:
                logger.warning("cluster index query failed (%s); routing by load", exc)
            self._index_down_until = self._clock() + self.index_retry_s
            return {}, "index_error"

    async def decide(
        self, tokens: Sequence[int] | None, cache_salt: str = "", lora_id: str = ""
    ) -> tuple[Decision, list[bytes]]:
        """Choose a replica for a prompt (``None``: token ids unknown) and count why."""
        started = time.perf_counter()
        keys: list[bytes] = []
        holdings: Mapping[str, Holding] = {}
        fallback = ""
        if tokens is None:
            fallback = "no_tokens"
        elif self.keys is None:
            fallback = "no_namespace"
        else:
            keys = self.keys.keys(tokens, lora_id, cache_salt)
            if keys and self.scorer.policy == "kv":  # the baselines never ask the index
                holdings, fallback = await self._holdings(keys)
        if fallback:
            self.metrics.fallbacks.labels(fallback).inc()
        decision = self.scorer.choose(keys, len(tokens or ()), holdings)
        m = self.metrics
        m.decision_seconds.observe(time.perf_counter() - started)
        m.decisions.labels(decision.replica.url, decision.reason).inc()
        m.score.observe(decision.score)
        m.predicted_hit_tokens.observe(decision.predicted_hit_tokens)
        m.prompt_tokens.observe(len(tokens or ()))
        return decision, keys

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serve one connection: one request, then close."""
        try:
            try:
                request = await read_request(reader)
            except BadRequest as exc:
                await respond(writer, exc.status, {"error": str(exc)})
                return
            if request is not None:
                await self._serve(request, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _serve(self, request: Request, writer: asyncio.StreamWriter) -> None:
        path = request.target.split("?", 1)[0]
        if path == "/health":
            await respond(writer, 200, {"status": "ok", "replicas": len(self.scorer.replicas)})
        elif path == "/metrics":
            await respond(writer, 200, generate_latest(self.metrics.registry), CONTENT_TYPE_LATEST)
        elif path == "/v1/models" and request.method == "GET":
            await self._proxy(request, writer, list(self.scorer.replicas), None, [], 0)
        elif path in _ROUTED and request.method == "POST":
            try:
                body: Any = json.loads(request.body)
            except ValueError:
                await respond(writer, 400, {"error": "the body is not JSON"})
                return
            if not isinstance(body, dict):
                await respond(writer, 400, {"error": "the body is not a JSON object"})
                return
            tokens = prompt_tokens(path, body, self.tokenizer)
            if self.prefill is not None:
                decode = await self.prefill.run(request, body, len(tokens or ()))
                if decode is not None:  # else the decode replica computes the whole prompt
                    request.body = json.dumps(decode).encode()
            salt = body.get("cache_salt")
            decision, keys = await self.decide(tokens, salt if isinstance(salt, str) else "")
            prefill = len(tokens or ()) - decision.predicted_hit_tokens
            await self._proxy(request, writer, list(decision.ranked), decision, keys, prefill)
        else:
            await respond(writer, 404, {"error": f"no route {request.method} {path}"})

    async def _proxy(
        self,
        request: Request,
        writer: asyncio.StreamWriter,
        ranked: list[Replica],
        decision: Decision | None,
        keys: list[bytes],
        prefill: int,
    ) -> None:
        """Send to the first replica that answers; account its load while it works."""
        scorer, m = self.scorer, self.metrics
        for replica in ranked:
            if decision is not None:
                scorer.dispatched(replica, keys, prefill)
                m.in_flight.labels(replica.url).set(scorer.load[replica.url].in_flight)
            done = False

            def first_byte(replica: Replica = replica) -> None:
                if decision is not None:
                    scorer.prefilled(replica, prefill)

            try:
                await forward(replica.url, request, writer, first_byte)
                m.responses.labels(replica.url, "ok").inc()
                done = True
            except UpstreamError as exc:
                logger.warning("replica %s: %s; trying the next", replica.url, exc)
                m.responses.labels(replica.url, "upstream_error").inc()
                if decision is not None:
                    scorer.prefilled(replica, prefill)
            finally:
                if decision is not None:
                    scorer.finished(replica)
                    m.in_flight.labels(replica.url).set(scorer.load[replica.url].in_flight)
            if done:
                return
        await respond(writer, 502, {"error": "no replica answered"})


def build_router(config: Config) -> tuple[Router, Client | None]:
    """The router of ``config`` and its index client (``None`` without an index URL)."""
    settings = config.router
    prefill: list[Replica] = []
    if settings.prefill or settings.decode:
        prefill, replicas = pd_replicas(settings.replicas, settings.prefill, settings.decode)
    else:
        replicas = parse_replicas(settings.replicas)
    if not settings.namespace and not prefill:
        raise ConfigError("router.namespace is empty; give the engines' base namespace as JSON")
    if settings.hash_algorithm not in ("xxh3_128", "sha256"):
        raise ConfigError(
            f"router.hash_algorithm: cannot use {settings.hash_algorithm!r}: "
            "one of xxh3_128, sha256"
        )
    keys = None
    if settings.namespace:
        keys = RouterKeys(
            parse_namespace(settings.namespace),
            settings.chunk_size,
            hash_secret(),
            "sha256" if settings.hash_algorithm == "sha256" else "xxh3_128",
        )
    url = config.cluster.url or config.redis.url
    client = connect(url, settings.index_timeout_s) if url else None
    layout = Layout(config.cluster.key_prefix, settings.tenant)
    index: Index | None = None
    if isinstance(client, RedisCluster):
        index = ClusterIndex(client, layout)
    elif client is not None:
        index = ScriptIndex(client, layout)
    router = Router(
        replicas,
        keys,
        index,
        tokenizer=load_tokenizer(settings.tokenizer),
        provisional_ttl_s=settings.provisional_ttl_s,
        hit_weight=settings.hit_weight,
        request_cost_tokens=settings.request_cost_tokens,
        index_retry_s=settings.index_retry_s,
        policy=settings.policy,
    )
    if prefill:
        router.prefill = PrefillStage(
            prefill,
            router.metrics.registry,
            timeout_s=settings.prefill_timeout_s,
            request_cost_tokens=settings.request_cost_tokens,
        )
    return router, client


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
        if client is not None:
            await client.aclose()
