"""The key scheme the router names a request's chunks by: the one the fleet's nodes publish.

Each node publishes the key schemes it serves in its description in the cluster index
(:mod:`kvstore.cluster.records`: its ``[keys]`` settings and the namespaces its engines'
connectors declared). :class:`FleetKeys` reads them every :data:`REFRESH_S` (in the background:
a request never waits for it) and, per model, takes the scheme most nodes publish (ties: the
first in JSON order, so every router picks the same one) as the *agreed* one. The router names
a request's chunks with it (:class:`~kvstore.router.keys.RouterKeys`), so it needs no key
settings of its own: change ``keys.chunk_size`` on the nodes and the router follows.

A replica whose node publishes a scheme that differs from the agreed one (another chunk size,
hash algorithm, secret or namespace) names its chunks otherwise: its index entries can never
match the router's keys, and crediting them would be wrong, so it is *refused for prefix
routing*: left out of the index's answer (routed by load and the router's provisional entries
alone), with one WARNING line per replica and change, and ``kvstore_router_replica_scheme_refused
{replica}`` at 1.

The secret never travels: the router reads it from ``$secret_env`` of the agreed scheme and
checks it against the scheme's ``secret_check``; a router whose secret differs logs one ERROR
and routes by load (its keys would match nothing).

Requests choose the scheme by their ``model`` field where the fleet serves several models (the
namespace's ``model``: the engine's model name, as ``vllm serve`` names it unless
``--served-model-name`` renames it); with one model every request uses it. The deprecated
``router.namespace``, ``router.chunk_size`` and ``router.hash_algorithm`` are a fallback used
only while no node publishes a scheme with a namespace (warned once).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping

from kvstore.cluster.index import ClusterIndex
from kvstore.cluster.layout import REDIS_ERRORS
from kvstore.config.router import ROUTER_KEYS_DEPRECATED
from kvstore.errors import ConfigError
from kvstore.key_scheme import KeyScheme
from kvstore.router.keys import RouterKeys
from kvstore.router.metrics import RouterMetrics

__all__ = ["REFRESH_S", "FleetKeys", "agreed_schemes"]

logger = logging.getLogger(__name__)

#: How often the published schemes are read again (a node's change shows within this plus its
#: own re-signing, which is immediate).
REFRESH_S = 2.0
#: The most schemes read from one node (a node keeps at most 64; more is not a node of ours).
MAX_SCHEMES_PER_NODE = 64


def agreed_schemes(published: Mapping[str, Collection[KeyScheme]]) -> dict[str, KeyScheme]:
    """Per model, the scheme (with a namespace) the most nodes of ``published`` (node id ->
    its schemes) publish; ties go to the first in JSON order."""
    votes: Counter[str] = Counter()
    for schemes in published.values():
        votes.update({s.to_json() for s in schemes if s.namespace is not None})
    agreed: dict[str, KeyScheme] = {}
    for text, _count in sorted(votes.items(), key=lambda item: (-item[1], item[0])):
        scheme = KeyScheme.from_json(text, "an agreed scheme")
        assert scheme.namespace is not None
        agreed.setdefault(scheme.namespace.model, scheme)
    return agreed


def _differs(schemes: Collection[KeyScheme], agreed: Mapping[str, KeyScheme]) -> list[str]:
    """How a node's schemes differ from the agreed ones (empty: they do not). A scheme with a
    namespace is compared with its model's; one without (a node no engine declared to yet) with
    every agreed one (its chunk size, algorithm and secret)."""
    for scheme in schemes:
        if scheme.namespace is not None:
            others = [agreed[scheme.namespace.model]] if scheme.namespace.model in agreed else []
        else:
            others = list(agreed.values())
        for other in others:
            found = other.differences(scheme)
            if found:
                return found
    return []


class FleetKeys:
    """What the router names chunks by, read from the nodes' published schemes."""

    def __init__(
        self,
        index: ClusterIndex | None,
        metrics: RouterMetrics,
        fallback: RouterKeys | None = None,
        env: Mapping[str, str] | None = None,
        refresh_s: float = REFRESH_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.index = index
        self.metrics = metrics
        #: From the deprecated router.* settings: used while no node publishes a scheme.
        self.fallback = fallback
        self.refresh_s = refresh_s
        self._env = os.environ if env is None else env
        self._clock = clock
        #: Per model, the agreed scheme and the router's keys for it (``None``: the router's
        #: secret differs).
        self.agreed: dict[str, KeyScheme] = {}
        self._keys: dict[str, RouterKeys | None] = {}
        #: Node id -> why it is refused for prefix routing.
        self.refused: dict[str, str] = {}
        self._read_at = -float("inf")
        self._task: asyncio.Task[None] | None = None
        self._warned_fallback = False
        self._index_down = False

    def keys_for(self, model: str | None) -> RouterKeys | None:
        """The keys a request for ``model`` is named by (``None``: route it by load); starts a
        background read when the last one is older than ``refresh_s``."""
        self._maybe_refresh()
        if not self._keys:
            if self.fallback is not None and not self._warned_fallback:
                self._warned_fallback = True
                logger.warning(
                    "no node publishes a key scheme yet: naming chunks by the old settings; %s",
                    ROUTER_KEYS_DEPRECATED,
                )
            return self.fallback
        if len(self._keys) == 1:
            return next(iter(self._keys.values()))
        return self._keys.get(model or "")

    def _maybe_refresh(self) -> None:
        if self.index is None or (self._task is not None and not self._task.done()):
            return
        if self._clock() - self._read_at >= self.refresh_s:
            self._read_at = self._clock()
            self._task = asyncio.get_running_loop().create_task(self.refresh())

    async def refresh(self) -> None:
        """Read the schemes the live nodes publish and update the agreed ones and the refused
        replicas (an unreachable index keeps the last ones, logged once)."""
        if self.index is None:
            return
        self._read_at = self._clock()
        try:
            nodes = await self.index.nodes()
        except REDIS_ERRORS as exc:
            if not self._index_down:
                logger.warning("cannot read the nodes' key schemes (%s); keeping the last", exc)
            self._index_down = True
            return
        self._index_down = False
        self.metrics.scheme_reads.inc()
        published: dict[str, list[KeyScheme]] = {}
        for node, info in nodes.items():
            schemes = []
            for text in (info.keys or ())[:MAX_SCHEMES_PER_NODE]:
                with contextlib.suppress(ConfigError):  # not a scheme: it names nothing
                    schemes.append(KeyScheme.from_json(text, f"node {node}"))
            if schemes:
                published[node] = schemes
        self._update(published)

    def _update(self, published: Mapping[str, Collection[KeyScheme]]) -> None:
        agreed = agreed_schemes(published)
        if agreed != self.agreed:
            self._keys = {model: self._router_keys(s) for model, s in agreed.items()}
            for scheme in agreed.values():
                logger.info("naming chunks as the fleet does: %s", scheme.describe())
        self.agreed = agreed
        refused = {}
        for node, schemes in published.items():
            found = _differs(schemes, agreed)
            if found:
                refused[node] = ", ".join(found)
        for node, why in refused.items():
            if self.refused.get(node) != why:
                logger.warning(
                    "replica %s refused for prefix routing: its key scheme differs (%s)", node, why
                )
            self.metrics.scheme_refused.labels(node).set(1)
        for node in self.refused.keys() - refused.keys():
            logger.info("replica %s accepted for prefix routing: its key scheme agrees", node)
            self.metrics.scheme_refused.labels(node).set(0)
        self.refused = refused

    def _router_keys(self, scheme: KeyScheme) -> RouterKeys | None:
        assert scheme.namespace is not None
        try:
            secret = scheme.secret(self._env)
        except ConfigError:  # the fingerprint of this router's secret is not the fleet's
            logger.error(
                "this router's $%s differs from the key secret of the fleet's nodes (model %r): "
                "its chunk keys would match nothing; routing by load",
                scheme.secret_env,
                scheme.namespace.model,
            )
            return None
        return RouterKeys(
            scheme.namespace, scheme.chunk_size, secret.decode(), scheme.hash_algorithm
        )

    async def aclose(self) -> None:
        """Stop a read in progress."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
