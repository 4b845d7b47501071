"""The key schemes one node serves: its configured chunk size and hash algorithm, and the
namespaces its engines declared.

A node's ``[keys]`` settings are the one place a deployment sets its chunk size and hash
algorithm. Each engine's connector asks its node for them at start and declares its base
namespace (which only the engine can work out: model, shape, cache layout, tenant); the node
keeps one scheme per declared namespace, publishes them in its description in the cluster index,
and the router reads them there (:mod:`kvstore.key_scheme`).

Bounded: a node keeps at most :data:`MAX_SCHEMES` namespaces (an engine declares one per model it
serves; more is a misconfiguration or an abuse, refused with a message).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable

from kvstore.errors import ConfigError
from kvstore.key_scheme import KeyScheme, engine_base
from kvstore.keys import Namespace

__all__ = ["MAX_SCHEMES", "NodeKeySchemes", "SecretMismatch", "TooManySchemes"]

logger = logging.getLogger(__name__)

#: The most namespaces one node keeps declared.
MAX_SCHEMES = 64


class SecretMismatch(ConfigError):
    """An engine declared a key secret other than the one its tenant's schemes use here."""


class TooManySchemes(ConfigError):
    """The node already keeps :data:`MAX_SCHEMES` namespaces."""


class NodeKeySchemes:
    """The node's configured scheme and the namespaces declared to it (thread-safe).

    ``configured`` carries ``keys.chunk_size``, ``keys.hash_algorithm``, the node's secret check
    (empty when the node has no secret of its own) and, where set, a namespace configured ahead
    of any engine (``keys.namespace``, for ``cluster.engine_events``).
    """

    def __init__(self, configured: KeyScheme) -> None:
        self.configured = configured
        self._lock = threading.Lock()
        self._declared: dict[str, KeyScheme] = {}
        self._listeners: list[Callable[[], None]] = []
        if configured.namespace is not None:
            self._declared[configured.to_json()] = configured

    def declare(self, namespace: Namespace, secret_check: str) -> KeyScheme:
        """Record that an engine names chunks under ``namespace`` with a secret whose
        fingerprint is ``secret_check``; returns the scheme it must use (this node's chunk size
        and algorithm). :class:`SecretMismatch` (one line) if its secret differs from the node's
        (where the node has one) or from an earlier engine's of the same tenant (tenants may key
        their chunks with secrets of their own); :class:`TooManySchemes` if the node already
        keeps :data:`MAX_SCHEMES` namespaces."""
        base = engine_base(namespace)
        known = self.known_secret_check(base.tenant)
        if known and secret_check and secret_check != known:
            raise SecretMismatch(
                f"the engine's ${self.configured.secret_env} differs from this node's "
                "(every engine, node and router of a deployment needs the same key secret)"
            )
        scheme = dataclasses.replace(
            self.configured, namespace=base, secret_check=known or secret_check
        )
        with self._lock:
            key = scheme.to_json()
            if key in self._declared:
                return scheme
            if len(self._declared) >= MAX_SCHEMES:
                raise TooManySchemes(
                    f"this node already serves {MAX_SCHEMES} declared namespaces; "
                    "refusing another (one per model an engine serves is expected)"
                )
            self._declared[key] = scheme
            listeners = list(self._listeners)
        logger.info("key scheme declared by an engine: %s", scheme.describe())
        for listener in listeners:
            listener()
        return scheme

    def current(self) -> tuple[KeyScheme, ...]:
        """Every scheme this node serves (configured or declared), oldest first."""
        with self._lock:
            return tuple(self._declared.values())

    def add_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` (no arguments, on the declaring thread) after each new scheme."""
        with self._lock:
            self._listeners.append(listener)

    def known_secret_check(self, tenant: str) -> str:
        """The secret check an engine of ``tenant`` must match: the node's own, else the first
        one an engine of that tenant declared ("" while there is none)."""
        if self.configured.secret_check:
            return self.configured.secret_check
        with self._lock:
            return next(
                (
                    s.secret_check
                    for s in self._declared.values()
                    if s.secret_check and s.namespace is not None and s.namespace.tenant == tenant
                ),
                "",
            )
