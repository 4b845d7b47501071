"""The backend's part of SGLang's ``--hicache-storage-backend-extra-config``, read and checked.

SGLang hands its storage backend the whole extra-config object; the keys SGLang itself reads
(:data:`SGLANG_KEYS`) pass through, every other key must be one of :data:`KNOWN_KEYS` (an unknown
key is usually a typo, and a typo in ``tenant`` or ``cache_salt`` would silently share blocks
that must stay apart). A refused setting raises :class:`~kvstore.errors.ConfigError` with one
line naming the key and what it accepts; the backend logs that line once and SGLang does not
start (:func:`refuse`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

from kvstore.config import hash_secret
from kvstore.errors import ConfigError
from kvstore.key_scheme import HASH_ALGORITHMS
from kvstore.keys import HashAlgorithm

__all__ = ["KNOWN_KEYS", "SGLANG_KEYS", "BackendSettings", "refuse"]

logger = logging.getLogger("kvstore.integrations.sglang")

#: Extra-config keys SGLang reads itself (the dynamic backend's class, the zero-copy switch).
SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})
#: The backend's own keys.
KNOWN_KEYS = frozenset(
    {
        "target",
        "tenant",
        "token",
        "tls_ca",
        "secret",
        "hash_algorithm",
        "revision",
        "cache_salt",
        "timeout_s",
        "lookup_timeout_s",
        "retry_after_s",
    }
)


def refuse(message: str) -> NoReturn:
    """Log ``message`` (one ERROR line: the refused setting, its value, what would do) and raise
    it as a :class:`~kvstore.errors.ConfigError`, which stops SGLang's start."""
    logger.error(message)
    raise ConfigError(message)


@dataclass(frozen=True, slots=True)
class BackendSettings:
    """What the backend reads from the extra config.

    Attributes:
        target: ``HOST:PORT`` of the ``kvstore serve`` process (its gRPC address; a store on this
            host is then reached over shared memory by itself).
        tenant: The tenant whose blocks these are (part of the namespace; a server with tenants
            checks it against the credentials).
        token: Bearer token for a server with ``auth.tokens_file`` (default ``$KVSTORE_TOKEN``).
        tls_ca: PEM file of the server's CA (default ``$KVSTORE_TLS_CA``).
        secret: Key-derivation secret (default ``$KVSTORE_HASH_SECRET``); every engine sharing a
            store needs the same one, and the store refuses another.
        hash_algorithm: How page keys are derived; the store's (``keys.hash_algorithm``) unless
            set here, and then it must be the store's.
        revision: The model's revision (SGLang tells its backend the model's name only).
        cache_salt: A static salt of this deployment's keys: engines with different salts never
            share pages (SGLang's per-request ``extra_key`` / cache salt is already in its page
            hashes).
        timeout_s: Deadline of each load and store call: a slower store costs a miss.
        lookup_timeout_s: Deadline of each ``batch_exists`` (on SGLang's prefetch thread).
        retry_after_s: After a failure, how long the store is treated as down (misses, no saves)
            unless its connection comes back earlier.
        pinned: The keys of :data:`KNOWN_KEYS` the extra config set.
    """

    target: str
    tenant: str = ""
    token: str | None = field(default=None, repr=False)
    tls_ca: str | None = None
    secret: str = field(default="", repr=False)
    hash_algorithm: HashAlgorithm = "xxh3_128"
    revision: str = "main"
    cache_salt: str = ""
    timeout_s: float = 2.0
    lookup_timeout_s: float = 0.5
    retry_after_s: float = 5.0
    pinned: frozenset[str] = frozenset()

    @classmethod
    def from_extra_config(
        cls, extra: Mapping[str, Any] | None, env: Mapping[str, str] | None = None
    ) -> BackendSettings:
        """Read the settings; :func:`refuse` on an unknown key or a bad value. ``env`` is where
        the secret's default is looked up (the process environment if ``None``)."""
        extra = dict(extra or {})
        unknown = sorted(set(extra) - KNOWN_KEYS - SGLANG_KEYS)
        if unknown:
            refuse(
                f"kvstore HiCache backend: unknown --hicache-storage-backend-extra-config keys "
                f"{unknown}; the backend's keys are {sorted(KNOWN_KEYS)}"
            )
        target = extra.get("target")
        if not isinstance(target, str) or ":" not in target:
            refuse(
                "kvstore HiCache backend: --hicache-storage-backend-extra-config needs "
                f"'target': 'HOST:PORT' of the kvstore serve process, got {target!r}"
            )
        numbers: dict[str, float] = {}
        for name, default in (
            ("timeout_s", 2.0),
            ("lookup_timeout_s", 0.5),
            ("retry_after_s", 5.0),
        ):
            value = extra.get(name, default)
            if isinstance(value, bool) or not isinstance(value, int | float):
                refuse(
                    f"kvstore HiCache backend: {name} must be a number of seconds, got {value!r}"
                )
            least_ok = 0.0 if name == "retry_after_s" else 1e-3
            if value < least_ok:
                refuse(f"kvstore HiCache backend: {name} must be >= {least_ok}, got {value!r}")
            numbers[name] = float(value)
        algorithm = extra.get("hash_algorithm", "xxh3_128")
        if algorithm not in HASH_ALGORITHMS:
            refuse(
                f"kvstore HiCache backend: hash_algorithm must be one of {list(HASH_ALGORITHMS)}, "
                f"got {algorithm!r}"
            )
        texts = {}
        for name in ("tenant", "revision", "cache_salt", "token", "tls_ca", "secret"):
            value = extra.get(name)
            if value is not None and not isinstance(value, str):
                refuse(f"kvstore HiCache backend: {name} must be a string, got {value!r}")
            texts[name] = value
        return cls(
            target=target,
            tenant=texts["tenant"] or "",
            token=texts["token"],
            tls_ca=texts["tls_ca"],
            secret=texts["secret"] if texts["secret"] is not None else hash_secret(env),
            hash_algorithm=algorithm,
            revision=texts["revision"] or "main",
            cache_salt=texts["cache_salt"] or "",
            timeout_s=numbers["timeout_s"],
            lookup_timeout_s=numbers["lookup_timeout_s"],
            retry_after_s=numbers["retry_after_s"],
            pinned=frozenset(set(extra) & KNOWN_KEYS),
        )
