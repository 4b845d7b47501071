"""The ``[keys]`` settings: how this deployment names chunks (loaded by
:func:`kvstore.config.load_config` like every other section; kept here so that the loader stays
small).

They are set on the node, the one place a deployment sets them: its connectors ask it for them,
it publishes them in the cluster index and the router reads them there
(:mod:`kvstore.key_scheme`). ``cluster.engine_namespace``, ``cluster.engine_chunk_size`` and
``cluster.engine_hash_algorithm`` are deprecated aliases (:func:`with_aliases`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

from kvstore.config.checks import check_choices
from kvstore.config.cluster import ClusterConfig
from kvstore.config.meta import setting
from kvstore.deprecation import removal_note
from kvstore.errors import ConfigError
from kvstore.key_scheme import (
    DEFAULT_CHUNK_SIZE,
    HASH_ALGORITHMS,
    HASH_SECRET_ENV,
    KeyScheme,
    namespace_from_json,
    secret_fingerprint,
)
from kvstore.keys import HashAlgorithm

__all__ = ["KeysConfig", "with_aliases"]

logger = logging.getLogger(__name__)

#: Deprecated ``[cluster]`` setting -> the ``[keys]`` one it stands for.
ALIASES = {
    "engine_namespace": "namespace",
    "engine_chunk_size": "chunk_size",
    "engine_hash_algorithm": "hash_algorithm",
}


@dataclass(frozen=True)
class KeysConfig:
    """How chunks are named: ``chunk_size`` tokens per chunk, ``hash_algorithm``
    (``xxh3_128`` or ``sha256``), the secret in ``$secret_env`` and, optionally, ``namespace``:
    the engine's base namespace as JSON (what its connector logs at start), for a node whose
    ``cluster.engine_events`` start before any connector declared its own."""

    chunk_size: int = setting(
        DEFAULT_CHUNK_SIZE,
        help=(
            "tokens per chunk: the one place a deployment sets it; connectors ask their node for "
            "it and the node publishes it in the cluster index for the router (see "
            "[KV-aware router](#kv-aware-router))"
        ),
    )
    hash_algorithm: str = setting(
        "xxh3_128",
        help="how chunk keys are hashed",
        kind="choice",
        choices=HASH_ALGORITHMS,
    )
    namespace: str = setting(
        "",
        help=(
            "optional: the engine's base namespace as JSON (what its connector logs at start), "
            "for `cluster.engine_events` to name the engine's blocks before any connector "
            "declared its namespace; `''`: wait for the first declaration"
        ),
    )
    secret_env: str = setting(
        HASH_SECRET_ENV,
        help=(
            "the environment variable holding the key-derivation secret (every engine, node and "
            "router of a deployment needs the same one); only its keyed fingerprint is published"
        ),
    )

    def __post_init__(self) -> None:
        if not self.secret_env:
            raise ConfigError(
                "keys.secret_env must name an environment variable, e.g. KVSTORE_HASH_SECRET"
            )
        check_choices("keys", self)
        self.scheme(env={})  # KeyScheme checks the chunk size and the namespace

    def scheme(self, env: Mapping[str, str] | None = None) -> KeyScheme:
        """These settings as a :class:`KeyScheme`: its secret check that of ``$secret_env`` in
        ``env`` (the process environment if ``None``) when it is set there, else empty (a node
        without a secret of its own takes its first engine's)."""
        env = os.environ if env is None else env
        namespace = (
            namespace_from_json(self.namespace, "keys.namespace") if self.namespace else None
        )
        algorithm = cast(HashAlgorithm, self.hash_algorithm)  # KeyScheme refuses any other
        scheme = KeyScheme(namespace, self.chunk_size, algorithm, self.secret_env)
        if self.secret_env not in env:
            return scheme
        return dataclasses.replace(scheme, secret_check=secret_fingerprint(env[self.secret_env]))


def with_aliases(keys: KeysConfig, cluster: ClusterConfig) -> KeysConfig:
    """``keys`` with each deprecated ``cluster.engine_*`` setting that is set applied where the
    ``keys.*`` one it stands for is left at its default, and one WARNING line naming them."""
    defaults, old_defaults = KeysConfig(), ClusterConfig()
    changes: dict[str, Any] = {}
    used = []
    for old, new in ALIASES.items():
        value = getattr(cluster, old)
        if value == getattr(old_defaults, old):
            continue
        used.append(f"cluster.{old} (set keys.{new} instead)")
        if getattr(keys, new) == getattr(defaults, new):
            changes[new] = value
    if used:
        logger.warning("deprecated settings: %s; %s", "; ".join(used), removal_note(several=True))
    return dataclasses.replace(keys, **changes) if changes else keys
